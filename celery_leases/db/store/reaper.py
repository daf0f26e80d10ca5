"""The store's operations for the reaper: holders that are gone, expired leases, give-ups,
notices for the result backend, follow-ups left behind, and the retention purge."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..rows import Job, Reaped
from .base import StoreBase


class ReaperOps(StoreBase):
    """A reaper pass's operations."""

    def expire_orphaned(self, *, batch: int) -> list[tuple[str, str | None]]:
        """End now the leases of the running jobs whose holder is gone: its database session
        ended (its process died, or its host) while the server stayed up, or, where the
        database cannot tell (``Dialect.holder_gone``: SQLite), its mark says so. (id, previous
        owner) of each: the expiry path then re-publishes them in the same reaper pass. A
        holder alive but frozen or cut off keeps its session: its renewals' end is the fence.

        Each gone holder is deleted first (a claim binding to it meanwhile is waited for, or
        binds nothing), then its jobs are let go, in one transaction."""
        sql, dialect = self.sql.reaper, self.dialect

        def run(c: Connection) -> list[tuple[str, str | None]]:
            found = c.execute(sql.gone_holders, {"b_batch": batch}).all()
            if not sql.sessions_in_sql:
                found = [r for r in found if dialect.holder_gone(r.id)]
            ended: list[tuple[str, str | None]] = []
            for holder, _, session in found:
                params = {"b_holder": holder, "b_session": session}
                if c.execute(sql.drop_holder, params).rowcount != 1:
                    continue  # it renewed on a new session meanwhile
                ended += [(r[0], r[1]) for r in c.execute(sql.jobs_held, params).all()]
                c.execute(sql.release_held, params)
            return ended

        return self._run(run)  # type: ignore[no-any-return]

    def release_stale(self) -> int:
        """End now the leases of the running jobs no live holder keeps and whose leases have
        run out (a frozen worker, one cut off from the database, a holder row that is gone):
        the expiry path then re-publishes them. The number of jobs."""
        release = self.sql.reaper.release_stale
        return int(self._run(lambda c: c.execute(release).rowcount, single=True))

    def prune_holders(self, *, idle: float) -> int:
        """Delete the holders no keeper renewed for ``idle`` seconds that hold no running job
        (a live keeper renews its row at least hourly)."""
        prune = self.sql.reaper.prune_holders
        return int(self._run(lambda c: c.execute(prune, {"b_idle": idle}).rowcount, single=True))

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


__all__ = ["ReaperOps"]
