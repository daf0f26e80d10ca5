"""The store's operations for a worker: claim, renew, checkpoint, and end an attempt, each one
conditional statement fenced by the lease's token, whose returned rows (or row count) tell the
outcome."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...errors import ArgumentsError, CheckpointError, LeaseError
from ...message import Message
from ...states import State
from .. import rows
from ..identity import Facts, checked_id, same_job, takes_over
from ..joined import Joined
from ..joined import joined as as_joined
from ..rows import Claimed, Refusal, Refused
from ..schema import FAILED, LIVE_STATES, QUEUED, RUNNING
from ..session import Session
from ..statements import GAVE_UP_MAX_ATTEMPTS
from .base import CLOCK_SLACK, KeyTaken, token_horizon
from .client import ClientOps
from .triggers import job_params

logger = logging.getLogger("celery_leases")

#: Key in a caller's connection's ``info``: the idle-write bound this store set on it.
IDLE_WRITE_GUARD = "celery_leases_idle_write_timeout"


class AttemptOps(ClientOps):
    """Writes of a worker's attempts."""

    # -- the claim ---------------------------------------------------------------------------

    def claim(
        self,
        delivery: Message,
        *,
        owner: str,
        duration: float,
        holder: str | None = None,
        fresh: bool = False,
        connection: Any = None,
    ) -> Claimed | Refused:
        """Take the lease if ``delivery`` is the job's recorded message and the job is queued
        or its lease expired, under ``leases_max_attempts``; bump the token. One statement when
        it is (the usual case).

        ``holder``: the claimant's keeper (``<table>_holders``), which keeps the lease while it
        renews (if it can hold it now: ``Claimed.bound``). ``fresh``: the delivery is a run
        asked for now, not a message that may be a copy (``Task.apply()``): it takes over the
        id of a job that has ended. ``connection``: the claim joins the caller's transaction
        (an attempt that started inside one)."""
        job_id = checked_id(delivery.id)
        params = {
            "b_id": job_id,
            "b_owner": owner,
            "b_holder": holder,
            "b_duration": duration,
            "b_version": delivery.version,
            "b_task": delivery.task,
            "b_generation": delivery.generation,
            "b_max_attempts": self.settings.max_attempts,
            # A debounced job is claimed at its due time, not before (a later trigger of its
            # burst may still move it); any other job whenever its message comes.
            "b_any_time": delivery.debounce is None and delivery.group is None,
        }
        record = self.sql.record
        hot = record.claim_version if delivery.version else record.claim_job
        for _ in range(3):
            claimed = self._claim_with(hot, params, connection)
            if claimed is not None:
                return claimed
            outcome = self._claim_other(delivery, params, connection, fresh=fresh)
            if outcome is not None:
                return outcome
        raise LeaseError(f"job {job_id}: its row kept changing while it was claimed; try again")

    def _claim_with(self, stmt: Any, params: dict[str, Any], connection: Any) -> Claimed | None:
        def run(c: Connection) -> Claimed | None:
            found = self.dialect.rows(c, stmt, params, read_back=self.sql.record.claimed)
            if not found or not found[0]:
                return None
            token, attempt, text, age, holder = found[0]
            checkpoint = rows.loads(text, params["b_id"], "checkpoint")
            return Claimed(token, attempt, checkpoint, age, created=False, bound=bool(holder))

        return self._on(connection, run, reads_back=True)  # type: ignore[no-any-return]

    def _claim_other(
        self, delivery: Message, params: dict[str, Any], connection: Any, *, fresh: bool
    ) -> Claimed | Refused | None:
        """The delivery matched no claimable recorded message: create the job, take the id
        over, claim the same job recorded without a version, or refuse. None when the row
        changed in between (claim again). A delivery of a lease key that has another live
        job is a trigger of that key (kept on the key), refused as ``coalesced``."""
        try:
            return self._claim_new(delivery, params, connection, fresh=fresh)
        except KeyTaken:
            serving = self._trigger(delivery, delivery.dumps())
            if serving is None:
                return None
            return Refused(
                Refusal.COALESCED, None, None, serving.id, serving.freed, serving.superseded
            )

    def _claim_new(
        self, delivery: Message, params: dict[str, Any], connection: Any, *, fresh: bool
    ) -> Claimed | Refused | None:
        record = self.sql.record
        facts = self._on(connection, lambda c: c.execute(record.facts, params).first())
        if facts is None:
            created = params | job_params(delivery, delivery.dumps())

            def create(c: Connection) -> int | None:
                if not self._insert(c, record.create_claimed, created):
                    return None
                return int(c.execute(record.token_of, params).scalar_one())

            token = self._on(connection, create, refused=ArgumentsError)
            if token is None:
                return None
            return Claimed(token, 1, None, None, created=True, bound=False)
        facts = Facts(*facts)
        if facts.waiting:
            # Published before its admission (a follow-up sent by an older release): its
            # admission publishes it again.
            return Refused(Refusal.WAITING, facts.owner, None)
        lease_over = facts.state == QUEUED or (facts.expires_in or 0.0) <= 0
        if facts.state == RUNNING and not lease_over:
            return Refused(Refusal.HELD, facts.owner, facts.expires_in)
        if facts.state == RUNNING and delivery.group is not None and same_job(delivery, facts):
            return Refused(Refusal.LAPSED, facts.owner, facts.expires_in)
        if takes_over(delivery, facts, published=fresh):
            job = params | job_params(delivery, delivery.dumps())
            job |= {"b_seen_token": facts.token, "b_seen_state": facts.state}

            def take(c: Connection) -> int | None:
                found = self._keyed(
                    c,
                    lambda: self.dialect.rows(
                        c, record.take_over_claimed, job, read_back=record.token_of
                    ),
                )
                return int(found[0][0]) if found and found[0] else None

            token = self._on(connection, take, reads_back=True, refused=ArgumentsError)
            if token is None:
                return None
            return Claimed(token, 1, None, None, created=True, bound=False)
        if facts.state not in LIVE_STATES:
            return Refused(State(facts.state), facts.owner, facts.expires_in)
        limit = self.settings.max_attempts
        if limit is not None and facts.attempts >= limit and lease_over:
            # leases_max_attempts: no attempt past it, whatever sent this one (a Celery retry,
            # a redelivery): the job fails, and the reaper tells the result backend.
            failed = {"b_id": facts_id(params), "b_error": GAVE_UP_MAX_ATTEMPTS}
            self._on(
                connection,
                lambda c: c.execute(self.sql.operators.give_up, failed | {"b_notify": "FAILURE"}),
            )
            return Refused(State.FAILED, facts.owner, facts.expires_in)
        early = facts.state == QUEUED and (facts.due_in or 0.0) > 0
        if early and not params["b_any_time"] and same_job(delivery, facts):
            bound = due_bound(delivery, facts)
            if bound is None or (facts.due_in or 0.0) <= bound + CLOCK_SLACK:
                return Refused(Refusal.EARLY, facts.owner, facts.due_in)
            # Due later than its debounce or its group's rate can make it: the database clock
            # stepped back. It runs now rather than wait out the step.
            logger.warning(
                "job %s: due in %.1f s, more than its %s allows (%.1f s): the database clock "
                "stepped back; it runs now",
                delivery.id,
                facts.due_in,
                "debounce" if delivery.debounce is not None else "group's rate",
                bound,
            )
            params = params | {"b_any_time": True}
            hot = record.claim_version if delivery.version else record.claim_job
            return self._claim_with(hot, params, connection)
        if same_job(delivery, facts):
            return self._claim_with(
                record.claim_job, params, connection
            )  # recorded without a version
        return Refused(Refusal.STALE, facts.owner, facts.expires_in)

    # -- keeping the lease: the keeper's holder ------------------------------------------------

    def renew_holder(
        self, holder: str, *, owner: str, shortest: float, session: Session | None = None
    ) -> None:
        """Renew (make, if missing) the holder ``holder`` of a keeper in ``owner``: every
        running job bound to it lasts while it renews; if it stops, it lasts ``shortest``
        seconds (its shortest lease). One statement. On a keeper's ``session`` it runs on that
        session and binds the holder to it (``Dialect.session_gone``: the reaper takes a gone
        session's holder's jobs at once)."""
        renew = self.sql.renew
        params = {"b_holder": holder, "b_owner": owner, "b_shortest": shortest}
        params["b_pid"] = os.getpid()
        if session is not None:
            session.run(lambda c: self.dialect.upserted(c, renew.bound, params), single=True)
            return
        self._hot(lambda c: self.dialect.upserted(c, renew.unbound, params))

    def bind(self, job_id: str, token: int, holder: str) -> bool:
        """Bind the lease ``token`` of the running job ``job_id`` to ``holder`` (a claim could
        not: its row was missing, or its session cut); False when it cannot yet, or the lease
        is lost."""
        params = {"b_id": job_id, "b_token": token, "b_holder": holder}
        renew = self.sql.renew

        def run(c: Connection) -> bool:
            found = self.dialect.rows(c, renew.bind, params, read_back=renew.holder_of)
            if not (found and found[0] and found[0][0]):
                found = [tuple(r) for r in c.execute(renew.holder_of, params).all()]  # bound?
            return bool(found and found[0][0] == holder)

        return bool(self._hot(run, reads_back=True))

    def detach(self, job_id: str, token: int) -> bool:
        """Stop keeping the lease ``token`` of job ``job_id`` by its holder (a stalled attempt):
        it ends when its last renewal runs out. False when the lease was not bound, or is
        lost."""
        return self._count(self.sql.renew.detach, {"b_id": job_id, "b_token": token}) == 1

    def bound_to(self, holder: str, *, margin: float) -> list[tuple[str, int]]:
        """The running jobs bound to ``holder`` whose last claim or checkpoint is over
        ``margin`` seconds old, as (id, token): its keeper detaches those it does not hold."""
        params = {"b_holder": holder, "b_margin": margin}
        found = self._hot(lambda c: c.execute(self.sql.renew.bound_to, params).all())
        return [(str(job_id), int(token)) for job_id, token in found]

    def drop_holder(self, holder: str) -> None:
        """Delete the holder ``holder`` (its keeper stops), unless it still holds a running
        job (one it could not hand back: the reaper lets it go when its lease runs out)."""
        self._count(self.sql.renew.drop, {"b_holder": holder})

    # -- a checkpoint and a key's cursor: fenced writes of an attempt ----------------------

    def _on(
        self,
        connection: Any,
        operation: Any,
        *,
        reads_back: bool = False,
        refused: type[LeaseError] = LeaseError,
        what: str = "",
    ) -> Any:
        """Run ``operation`` on this process's direct connection (``connection`` None), or in
        the caller's transaction ``connection`` (anything ``joined.joined`` takes)."""
        joined = as_joined(self, connection)
        return self._on_joined(joined, operation, reads_back=reads_back, refused=refused, what=what)

    def _on_joined(
        self,
        joined: Joined | None,
        operation: Any,
        *,
        reads_back: bool = False,
        refused: type[LeaseError] = LeaseError,
        what: str = "",
    ) -> Any:
        """:meth:`_on` with the caller's transaction already found (``joined.joined``)."""
        if joined is None:
            return self._hot(operation, reads_back=reads_back, refused=refused)
        if not self._schema_ready:
            self.check_schema()
        with self.db.wrapped_errors(what, refused=refused):
            return operation(joined.executor)

    def checkpoint(
        self,
        job_id: str,
        token: int,
        state: str,
        *,
        progress: tuple[int, int | None] | None = None,
        connection: Any = None,
        idle_limit: float | None = None,
    ) -> tuple[bool, str | None]:
        """Save a checkpoint (JSON text) and renew, fenced by ``token``.

        Returns (saved, stop request). With ``connection`` (an SQLAlchemy ``Connection``, a
        DBAPI connection, a ``joined.Joined``) the statement joins the caller's transaction,
        so the caller's own writes and the checkpoint commit or roll back together; that
        transaction may then sit idle ``idle_limit`` seconds at most (the lease's length;
        default ``leases_duration``) before the database ends it.
        """
        return self.checkpoint_in(
            as_joined(self, connection),
            job_id,
            token,
            state,
            progress=progress,
            idle_limit=idle_limit,
        )

    def checkpoint_in(
        self,
        joined: Joined | None,
        job_id: str,
        token: int,
        state: str,
        *,
        progress: tuple[int, int | None] | None = None,
        idle_limit: float | None = None,
    ) -> tuple[bool, str | None]:
        """:meth:`checkpoint` in ``joined``, the caller's transaction already found
        (``joined.joined``), or, None, on this process's direct connection."""
        sql = self.sql.checkpoint
        params: dict[str, Any] = {"b_id": job_id, "b_token": token, "b_checkpoint": state}
        stmt = sql.save if progress is None else sql.save_progress
        if joined is not None and joined.guard_idle:
            stmt = sql.save_in_tx if progress is None else sql.save_progress_in_tx
            idle_limit = self._guard_idle_writes(joined, idle_limit)
            params["b_idle_ms"] = str(math.ceil(idle_limit * 1000))
        if progress is not None:
            params["b_done"], params["b_total"] = progress

        def run(c: Any) -> tuple[bool, str | None]:
            # The write first skips a row with a stop request, returning nothing: one
            # statement in the usual case; a row it skipped is saved (fenced as ever) and its
            # request returned (or read back), so a hand-off or a cancel is seen at this
            # checkpoint.
            found = self.dialect.rows(
                c, stmt, params, read_back=sql.stop_of, first_try=(sql.unstopped[stmt], (None,))
            )
            return (bool(found), found[0][0] if found and found[0] else None)

        return self._on_joined(  # type: ignore[no-any-return]
            joined, run, refused=CheckpointError, what="checkpoint not saved"
        )

    def cursor(self, key: str) -> Any:
        """The cursor saved for lease key ``key`` (JSON), None if none was."""
        text = self._hot(lambda c: c.execute(self.sql.keys.cursor_of, {"b_key": key}).scalar())
        return rows.loads(text, key, "cursor_state")

    def save_cursor(
        self,
        key: str,
        job_id: str,
        token: int,
        state: str,
        *,
        connection: Any = None,
        idle_limit: float | None = None,
    ) -> bool:
        """Save the cursor of lease key ``key`` (JSON text), fenced by the lease ``token`` of
        the running job ``job_id`` of that key: False if this attempt lost the lease. One
        statement; with ``connection``, in the caller's transaction, as :meth:`checkpoint`."""
        return self.save_cursor_in(
            as_joined(self, connection), key, job_id, token, state, idle_limit=idle_limit
        )

    def save_cursor_in(
        self,
        joined: Joined | None,
        key: str,
        job_id: str,
        token: int,
        state: str,
        *,
        idle_limit: float | None = None,
    ) -> bool:
        """:meth:`save_cursor` in ``joined``, as :meth:`checkpoint_in`."""
        keys = self.sql.keys
        params = {"b_key": key, "b_id": job_id, "b_token": token, "b_cursor": state}
        stmt = keys.save_cursor
        if joined is not None and joined.guard_idle:
            stmt = keys.save_cursor_in_tx
            idle_limit = self._guard_idle_writes(joined, idle_limit)
            params["b_idle_ms"] = str(math.ceil(idle_limit * 1000))
        return bool(
            self._on_joined(
                joined,
                lambda c: self.dialect.upserted(c, stmt, params),
                refused=CheckpointError,
                what="cursor not saved",
            )
        )

    def bounds_idle(self, connection: Any) -> bool:
        """Whether a transactional checkpoint on ``connection`` bounds how long its
        transaction may sit idle."""
        joined = as_joined(self, connection)
        return joined is not None and self.dialect.bounds_idle(joined.dialect)

    def _guard_idle_writes(self, joined: Joined, idle_limit: float | None) -> float:
        """Bound how long the caller's transaction may sit idle after writing, where the
        database does it with a setting of the session (MariaDB; ``Dialect.with_idle_guard``
        does it in the statement elsewhere): set once per connection, given back when it
        returns to its pool (a connection of another library's: its owner gives it back,
        :meth:`unguard_idle_writes`). The bound, in seconds."""
        idle_limit = self.settings.duration if idle_limit is None else idle_limit
        seconds = max(1, math.ceil(idle_limit))
        if joined.info.get(IDLE_WRITE_GUARD) == seconds:
            return idle_limit
        if not self.dialect.guard_idle_writes(joined.executor, seconds):
            return idle_limit
        joined.info[IDLE_WRITE_GUARD] = seconds
        pool = joined.pool
        if pool is not None and not sa.event.contains(pool, "checkin", self._unguard_on_checkin):
            sa.event.listen(pool, "checkin", self._unguard_on_checkin)
        return idle_limit

    def _unguard_on_checkin(self, dbapi_connection: Any, record: Any) -> None:
        """A pool's ``checkin`` hook: the server's default idle-write bound back."""
        if record.info.pop(IDLE_WRITE_GUARD, None) is None or dbapi_connection is None:
            return
        # A broken connection fails here too: the pool replaces it, and its setting with it.
        with contextlib.suppress(Exception):
            cursor = dbapi_connection.cursor()
            cursor.execute(self.dialect.unguard_sql() or "")
            cursor.close()

    def unguard_idle_writes(self, connection: Any) -> None:
        """Give a foreign connection the server's default idle-write bound back, if a
        transactional checkpoint had set its own (call it outside any transaction)."""
        unguard = self.dialect.unguard_sql()
        if connection.info.pop(IDLE_WRITE_GUARD, None) is not None and unguard is not None:
            connection.exec_driver_sql(unguard)

    # -- how an attempt ends -----------------------------------------------------------------

    def finish(
        self, job_id: str, token: int, *, result: str | None, connection: Any = None
    ) -> bool:
        """Mark the job done, fenced by ``token``. False if this attempt lost the lease.
        ``connection``: in the caller's transaction (an attempt that started inside one)."""
        params = {"b_id": job_id, "b_token": token, "b_result": result}
        finish = self.sql.end.finish
        return bool(self._on(connection, lambda c: c.execute(finish, params).rowcount == 1))

    def fail(
        self,
        job_id: str,
        token: int,
        *,
        error: str,
        state: str = FAILED,
        connection: Any = None,
    ) -> bool:
        """Mark the job failed (or cancelled), keeping its checkpoint; fenced by ``token``."""
        params = {"b_id": job_id, "b_token": token, "b_state": state, "b_error": error}
        fail = self.sql.end.fail
        return bool(self._on(connection, lambda c: c.execute(fail, params).rowcount == 1))

    def replace(self, job_id: str, token: int) -> bool:
        """End the job as ``replaced`` (``Task.replace``): its id goes to the replacement,
        which a later register or claim takes over. Fenced by ``token``."""
        return self._count(self.sql.end.replace, {"b_id": job_id, "b_token": token}) == 1

    def hand_back(
        self, job_id: str, token: int, *, reap_in: float | None, connection: Any = None
    ) -> str | None:
        """Give the lease back, fenced by ``token``: the job's state after it (``queued``, or
        ``cancelled`` when an operator had cancelled it, ``superseded`` when a newer trigger of
        its key had superseded it), None if this attempt lost the lease.

        ``reap_in`` seconds from now the reaper re-publishes the job; None when a message for
        it is already on its way (a Celery retry).
        """
        params = {"b_id": job_id, "b_token": token, "b_reap_in": reap_in}
        return self._handed_back(self.sql.end.hand_back, params, connection)

    def hand_back_retry(
        self,
        job_id: str,
        token: int,
        message: Message,
        *,
        reap_in: float,
        countdown: float = 0.0,
    ) -> str | None:
        """Give the lease back for a Celery retry whose ``message`` becomes the job's, due
        ``countdown`` seconds from now; fenced by ``token``; the state after it, as
        :meth:`hand_back`. The reaper re-publishes it ``reap_in`` seconds from now if no worker
        has claimed it by then; a job of a group waits for its admission instead."""
        params = {
            "b_id": job_id,
            "b_token": token,
            "b_reap_in": reap_in,
            "b_countdown": max(countdown, 0.0),
            "b_version": message.version,
            "b_message": message.dumps(),
        }
        return self._handed_back(self.sql.end.hand_back_retry, params, refused=ArgumentsError)

    def _handed_back(
        self,
        stmt: Any,
        params: dict[str, Any],
        connection: Any = None,
        *,
        refused: type[LeaseError] = LeaseError,
    ) -> str | None:
        def run(c: Connection) -> str | None:
            found = self.dialect.rows(c, stmt, params, read_back=self.sql.end.state_of)
            return str(found[0][0]) if found and found[0] else None

        return self._on(  # type: ignore[no-any-return]
            connection, run, reads_back=True, refused=refused
        )

    def hand_back_owned(
        self, job_id: str, owner: str, *, reap_in: float
    ) -> tuple[str | None, str | None]:
        """Hand back the lease ``owner`` (a dead process) holds on the job: (state after it,
        the message text to send again); (None, None) when ``owner`` holds no lease on it, or
        its attempt saved no checkpoint, or the job reached leases_max_attempts (the reaper
        decides then)."""
        params = {
            "b_id": job_id,
            "b_owner": owner,
            "b_reap_in": reap_in,
            "b_max_attempts": self.settings.max_attempts,
        }
        end = self.sql.end

        def run(c: Connection) -> tuple[str | None, str | None]:
            found = self.dialect.rows(
                c, end.hand_back_owned, params, read_back=end.state_and_message
            )
            return (str(found[0][0]), found[0][1]) if found and found[0] else (None, None)

        return self._hot(run, reads_back=True)  # type: ignore[no-any-return]


def facts_id(params: dict[str, Any]) -> str:
    return str(params["b_id"])


def due_bound(delivery: Message, facts: Facts) -> float | None:
    """The furthest ahead a job's due time can be when its message comes, by the database
    clock that wrote it: a debounced job's ``max_wait``, an admitted job's token horizon at
    its group's rate (``token_horizon``); None when nothing bounds it (its own countdown)."""
    if delivery.debounce is not None:
        return delivery.debounce[1]
    if delivery.group is not None and facts.group_rate:
        return token_horizon(float(facts.group_rate))
    return None


__all__ = ["IDLE_WRITE_GUARD", "AttemptOps"]
