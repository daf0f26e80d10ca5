"""The store's operations for the reaper: holders that are gone, expired leases, give-ups,
notices for the result backend, follow-ups left behind, and the retention purge."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..rows import Job, Reaped
from .base import StoreBase


class Reaper(StoreBase):
    """A reaper pass's operations."""

    def expire_orphaned(self, *, batch: int) -> list[tuple[str, str | None]]:
        """End now the leases of running jobs whose holder's database session is gone (its
        process died, or its host): (id, previous owner) of each. The usual expiry path then
        re-publishes them in the same reaper pass. A holder that is alive but frozen or cut
        off keeps its session: its lease expiry stays the fence. Where the database cannot
        tell a gone session (``Dialect.holder_gone``: SQLite), each candidate is judged here."""
        sql, dialect = self.sql.reaper, self.dialect

        def run(c: Connection) -> list[tuple[str, str | None]]:
            found = c.execute(sql.orphan_candidates, {"b_batch": batch}).all()
            if not sql.sessions_in_sql:
                found = [r for r in found if dialect.holder_gone(r.owner, r.session)]
            ended = []
            for row in found:
                params = {"b_id": row.id, "b_token": row.token, "b_session": row.session}
                if c.execute(sql.expire_orphans, params).rowcount == 1:
                    ended.append((row.id, row.owner))
            return ended

        return self._run(run)  # type: ignore[no-any-return]

    def collect_expired(
        self, *, batch: int, grace: float, max_stalled: int | None, max_attempts: int | None
    ) -> Reaped:
        """Take one batch of live jobs whose lease expired: mark them to be re-published, or
        fail the poison ones.

        Each expired lease is marked by a conditional update that pushes its expiry ``grace``
        seconds forward, so concurrent reapers re-publish it once.
        """
        t, sql = self.table, self.sql.reaper

        def run(c: Connection) -> Reaped:
            found = dict(c.execute(sql.expired_candidates, {"b_batch": batch}).all())
            ids = list(found)
            if not ids:
                return Reaped([], [])
            poison, give_up, republish = sql.expired_batch(
                ids, grace=grace, max_stalled=max_stalled, max_attempts=max_attempts
            )
            gave_up: list[str] = []
            if poison is not None:
                gave_up = [r[0] for r in c.execute(poison).all()]
                if gave_up:
                    c.execute(give_up.where(t.c.id.in_(gave_up), sql.expired))
            live = [i for i in ids if i not in set(gave_up)]
            marked: list[str] = []
            if live:
                stmt = self.dialect.with_returning(
                    republish.where(t.c.id.in_(live), sql.expired), t.c.id
                )
                # (Read back: the select above locked these rows for this transaction.)
                read_back = sa.select(t.c.id).where(t.c.id.in_(live))
                marked = [r[0] for r in self.dialect.rows(c, stmt, {}, read_back=read_back)]
            jobs, corrupt = self._parse_jobs(c, marked)
            if corrupt:
                c.execute(sql.fail_corrupt, {"b_ids": list(corrupt)})
            failed, _ = self._parse_jobs(c, gave_up + list(corrupt))
            return Reaped(jobs, failed, found)

        return self._run(run)  # type: ignore[no-any-return]

    def take_notices(self, *, batch: int) -> list[Job]:
        """Up to ``batch`` jobs whose end the result backend has not been told, now marked as
        told: the caller stores their state (at most once, even with several reapers)."""
        sql = self.sql.reaper

        def run(c: Connection) -> list[Job]:
            ids = [r[0] for r in c.execute(sql.noticed, {"b_batch": batch}).all()]
            if not ids:
                return []
            jobs, _ = self._parse_jobs(c, ids)
            c.execute(sql.clear_notices, {"b_ids": ids})
            # Only what is still marked: a notice another pass took meanwhile is its own.
            return [job for job in jobs if job.notify is not None]

        return self._run(run)  # type: ignore[no-any-return]

    def notify_again(self, job_id: str, notify: str | None) -> None:
        """Mark the job again for :meth:`take_notices` (the result backend refused it)."""
        self._count(self.sql.reaper.set_notify, {"b_id": job_id, "b_notify": notify})

    def followups_pending(self, *, batch: int) -> list[str]:
        """Ids of ended jobs whose follow-up run was not recorded yet (their ender died)."""
        pending = self.sql.keys.followups_pending
        found = self._run(lambda c: c.execute(pending, {"b_batch": batch}).all())
        return [r[0] for r in found]

    def purge(self, *, older_than: float, batch: int) -> int:
        """Delete up to ``batch`` jobs finished more than ``older_than`` seconds ago."""
        sql = self.sql.reaper
        params: dict[str, Any] = {"b_older_than": older_than, "b_batch": batch}

        def run(c: Connection) -> int:
            ids = [r[0] for r in c.execute(sql.purgeable, params).all()]
            if not ids:
                return 0
            return int(c.execute(sql.purge, params | {"b_ids": ids}).rowcount)

        return int(self._run(run))

    def purge_all(self, *, older_than: float, batch: int, max_batches: int = 100) -> int:
        """Purge in batches until fewer than ``batch`` are left (at most ``max_batches``)."""
        purged = 0
        for _ in range(max_batches):
            done = self.purge(older_than=older_than, batch=batch)
            purged += done
            if done < batch:
                break
        return purged


__all__ = ["Reaper"]
