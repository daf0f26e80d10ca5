"""The store's operations for operators (``celery leases``, the Django admin) and for ends that
Celery decides outside any attempt."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ...errors import InvalidJobState, JobNotFound
from .. import rows
from ..dialects.base import like_prefix
from ..rows import Job, StateCounts
from ..schema import CANCELLED, FAILED, FINISHED_STATES, QUEUED, STATES, WAITING
from .base import KeyTaken, StoreBase


class OperatorOps(StoreBase):
    """Reads of jobs, and operators' writes."""

    def get(self, job_id: str) -> Job | None:
        """The job recorded under ``job_id``, or None."""
        job_by_id = self.sql.reads.job_by_id
        found = self._hot(lambda c: c.execute(job_by_id, {"b_id": job_id}).mappings())
        return rows.job(found[0]) if found else None

    def lost_commits(self, job_id: str, token: int) -> bool:
        """Whether the database lost what the attempt holding ``token`` wrote: the job is
        gone, or at a token below ``token`` (tokens only grow, so only a database that lost
        commits goes back: a failover to a replica that missed them, a restore). Read when
        a fenced write of that attempt was refused, to tell that from another attempt's
        claim."""
        return behind(self.get(job_id), token)

    def list_jobs(
        self,
        *,
        states: Iterable[str] = (),
        task: str | None = None,
        group: str | None = None,
        limit: int = 50,
    ) -> list[Job]:
        """Jobs, newest first, filtered by state, task name or group: the newest ``limit`` of
        each state asked (default: every state), each through an index, then the newest of
        those. ``waiting`` is a state here: the queued jobs of a group not admitted yet;
        ``queued`` then asks for the others."""
        reads = self.sql.reads
        stmt = reads.newest_of_group if group else reads.newest_of_task if task else reads.newest
        asked = list(dict.fromkeys(states)) or [*STATES, WAITING]
        read = list(dict.fromkeys(QUEUED if s == WAITING else s for s in asked))

        def newest(c: Any) -> list[Any]:
            params = {"b_task": task, "b_group": group, "b_limit": limit}
            return [r for s in read for r in c.execute(stmt, params | {"b_state": s}).all()]

        found = [rows.job(row._mapping) for row in self._run(newest)]
        if group and task:
            found = [job for job in found if job.task == task]
        found = [job for job in found if (WAITING if job.waiting else job.state) in asked]
        return sorted(found, key=lambda job: job.created_at, reverse=True)[:limit]

    def count_by_state(self) -> dict[str, int]:
        """How many jobs the table holds in each state: every row is counted (a Prometheus
        scrape's count; ``leases list`` uses :meth:`count_states`)."""
        return dict(self._run(lambda c: c.execute(self.sql.reads.count_by_state).all()))

    def count_states(self, *, cap: int) -> StateCounts:
        """How many jobs each state has: the live ones exactly, each finished one up to
        ``cap`` (``capped``: those holding more, counted as ``cap``). Reads the live jobs'
        index entries and at most ``cap + 1`` per finished state, whatever the table holds."""
        reads = self.sql.reads

        def count(c: Any) -> dict[str, int]:
            counts = dict(c.execute(reads.count_live).all())
            for state in FINISHED_STATES:
                params = {"b_state": state, "b_cap": cap + 1}
                counts[state] = c.execute(reads.count_up_to, params).scalar_one()
            return {state: n for state, n in counts.items() if n}

        counts = self._run(count)
        capped = frozenset(s for s in FINISHED_STATES if counts.get(s, 0) > cap)
        return StateCounts({s: min(n, cap) for s, n in counts.items()}, capped)

    def ids_starting_with(self, prefix: str, *, limit: int) -> list[str]:
        """Ids of up to ``limit`` jobs whose id starts with ``prefix`` (case-sensitive)."""
        params = {"b_prefix": self.dialect.prefix_pattern(prefix), "b_limit": limit}
        stmt = self.sql.reads.ids_starting_with
        found = self._run(lambda c: c.execute(stmt, params).scalars().all())
        # MySQL's default collations ignore case.
        return [i for i in found if i.startswith(prefix)]

    def now(self) -> float:
        """The database clock, in epoch seconds."""
        return float(self._hot(lambda c: c.execute(self.sql.reads.now).scalar_one()))

    # -- ends decided outside any attempt ----------------------------------------------------

    def give_up(self, job_id: str, *, error: str, notify: str | None = None) -> bool:
        """Fail a job no live lease holds (queued, or its lease expired). ``notify``: the
        Celery state the reaper then stores in the result backend (None: Celery already
        records one)."""
        params = {"b_id": job_id, "b_error": error, "b_notify": notify}
        return self._count(self.sql.operators.give_up, params) == 1

    def end_live(self, job_id: str, *, state: str, error: str, notify: str | None = None) -> bool:
        """End a queued or running job as ``state``, whatever attempt holds it: Celery decided
        (a revoke, an expiry, a hard time limit in a worker's main process)."""
        params = {"b_id": job_id, "b_state": state, "b_error": error, "b_notify": notify}
        return self._count(self.sql.operators.end_live, params) == 1

    def end_unheld(self, job_id: str, *, state: str, error: str) -> bool:
        """End a live job as ``state`` unless an attempt holds it under a live lease: a
        worker discarded an expired copy of its message (Celery lets a running task go on
        when another copy of its message expires). False when a live attempt holds it, or it
        has ended."""
        params = {"b_id": job_id, "b_state": state, "b_error": error, "b_notify": None}
        return self._count(self.sql.operators.end_unheld, params) == 1

    def wait_for_worker(self, job_id: str, *, wait: float, error: str) -> bool:
        """A queued job's message was discarded by a worker that does not know its task: the
        reaper sends it again ``wait`` seconds from now (then with doubling waits), until a
        worker that knows it takes it. False when the job is not queued (a running one is
        left alone: its message was a copy)."""
        params = {"b_id": job_id, "b_wait": wait, "b_error": error}
        return self._count(self.sql.operators.wait_for_worker, params) == 1

    # -- operators' actions ------------------------------------------------------------------

    def request_stop(self, job_ids: Sequence[str], kind: str) -> int:
        """Ask running attempts to stop at their next checkpoint (``cancel``, ``preempt``;
        ``supersede`` is asked by a newer trigger of a job's key: ``Store.register``)."""
        params = {"b_ids": list(job_ids), "b_kind": kind}
        return self._count(self.sql.operators.request_stop, params)

    def request_stop_owned_by(self, owner_prefix: str, kind: str) -> int:
        """Ask every running attempt whose owner starts with ``owner_prefix`` to stop."""
        params = {"b_owner_like": like_prefix(owner_prefix), "b_kind": kind}
        return self._count(self.sql.operators.request_stop_owned_by, params)

    def cancel_queued(self, job_id: str) -> bool:
        """Cancel a job that no worker holds; its message will be dropped by the claim."""
        return self._count(self.sql.operators.cancel_queued, {"b_id": job_id}) == 1

    def release(self, job_id: str) -> bool:
        """Expire a running job's lease now (an operator knows its host is dead), so the next
        reaper pass re-publishes it."""
        return self._count(self.sql.operators.release, {"b_id": job_id}) == 1

    def requeue(
        self,
        job_id: str,
        *,
        from_states: Sequence[str] = (FAILED, CANCELLED),
        queued_timeout: float | None = None,
    ) -> Job:
        """Put a finished job back to ``queued`` (its checkpoint kept) and return it.

        With ``queued_timeout``, the reaper re-publishes it if no worker claims it in time.
        """
        params = {
            "b_id": job_id,
            "b_from_states": list(from_states),
            "b_queued_timeout": queued_timeout,
        }
        requeue = self.sql.operators.requeue
        try:
            requeued = self._hot(
                lambda c: self._keyed(c, lambda: c.execute(requeue, params).rowcount)
            )
        except KeyTaken:
            raise InvalidJobState(
                f"job {job_id}: another job of its lease key is queued or running; retry "
                f"this one when that one has ended"
            ) from None
        if requeued != 1:
            job = self.get(job_id)
            if job is None:
                raise JobNotFound(f"no job {job_id!r} in {self.table.name}")
            raise InvalidJobState(
                f"job {job_id} is {job.state}; only {' or '.join(from_states)} jobs can be retried"
            )
        job = self.get(job_id)
        assert job is not None
        return job

    def set_cursor(self, key: str, state: str | None) -> bool:
        """Set the cursor of lease key ``key`` to ``state`` (JSON text; None clears it), for
        an operator or a test: only while no job holds the key (none queued, running, or
        ended with a follow-up to start). False, and nothing written, when one does. One
        statement."""
        params = {"b_key": key, "b_cursor": state}
        set_cursor = self.sql.keys.set_cursor
        return self._run(  # type: ignore[no-any-return]
            lambda c: self.dialect.upserted(c, set_cursor, params), single=True
        )


__all__ = ["OperatorOps", "like_prefix"]


def behind(job: Job | None, token: int) -> bool:
    """Whether the database, which holds ``job`` (None: not at all), went back behind the
    attempt of ``token``: the job gone, or at an older token (tokens only grow)."""
    return job is None or job.token is None or job.token < token
