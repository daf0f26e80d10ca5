"""The store's operations for a worker: claim, renew, checkpoint, and end an attempt, each one
conditional statement fenced by the lease's token, whose returned rows (or row count) tell the
outcome."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...errors import CorruptJob, LeaseError
from ...message import Message
from .. import rows
from ..dbapi import Foreign
from ..identity import checked_id, same_job, takes_over
from ..rows import Claimed, Refused, Renewal
from ..schema import FAILED, LIVE_STATES, RUNNING
from ..session import Session
from .base import KeyTaken
from .client import Client, job_params

#: Key in a caller's connection's ``info``: the idle-write bound this store set on it.
IDLE_WRITE_GUARD = "celery_leases_idle_write_timeout"


class Worker(Client):
    """Writes of a worker's attempts."""

    # -- the claim ---------------------------------------------------------------------------

    def claim(
        self,
        delivery: Message,
        *,
        owner: str,
        duration: float,
        fresh: bool = False,
        session: int | None = None,
    ) -> Claimed | Refused:
        """Take the lease if ``delivery`` is the job's recorded message and the job is queued
        or its lease expired; bump the token. One statement when it is (the usual case).

        ``fresh``: the delivery is a run asked for now, not a message that may be a copy
        (``Task.apply()``): it takes over the id of a job that has ended. ``session``: the
        claimant's keeper session (``Session.ident``), which the lease is bound to."""
        job_id = checked_id(delivery.id)
        params = {
            "b_id": job_id,
            "b_owner": owner,
            "b_session": session,
            "b_duration": duration,
            "b_version": delivery.version,
            "b_task": delivery.task,
            "b_generation": delivery.generation,
        }
        record = self.sql.record
        hot = record.claim_version if delivery.version else record.claim_job
        for _ in range(3):
            claimed = self._claim_with(hot, params)
            if claimed is not None:
                return claimed
            outcome = self._claim_other(delivery, params, fresh=fresh)
            if outcome is not None:
                return outcome
        raise LeaseError(f"job {job_id}: its row kept changing while it was claimed; try again")

    def _claim_with(self, stmt: Any, params: dict[str, Any]) -> Claimed | None:
        def run(c: Connection) -> Claimed | None:
            found = self.dialect.rows(c, stmt, params, read_back=self.sql.record.claimed)
            if not found or not found[0]:
                return None
            row = found[0]
            checkpoint = rows.loads(row[2], params["b_id"], "checkpoint")
            return Claimed(row[0], row[1], checkpoint, row[3], created=False)

        return self._hot(run, reads_back=True)  # type: ignore[no-any-return]

    def _claim_other(
        self, delivery: Message, params: dict[str, Any], *, fresh: bool
    ) -> Claimed | Refused | None:
        """The delivery matched no claimable recorded message: create the job, take the id
        over, claim the same job recorded without a version, or refuse. None when the row
        changed in between (claim again). A delivery of a lease key that has another live
        job is a trigger of that key (``coalesce``), refused as ``coalesced``."""
        try:
            return self._claim_new(delivery, params, fresh=fresh)
        except KeyTaken:
            serving = self.coalesce(delivery, delivery.dumps())
            return None if serving is None else Refused("coalesced", None, None, serving)

    def _claim_new(
        self, delivery: Message, params: dict[str, Any], *, fresh: bool
    ) -> Claimed | Refused | None:
        record = self.sql.record
        facts = self._facts(params["b_id"])
        if facts is None:
            created = params | job_params(delivery, delivery.dumps())
            inserted = self._hot(lambda c: self._insert(c, record.create_claimed, created))
            return Claimed(1, 1, None, None, created=True) if inserted else None
        if facts.state == RUNNING and (facts.expires_in or 0.0) > 0:
            return Refused("held", facts.owner, facts.expires_in)
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

            token = self._hot(take, reads_back=True)
            return None if token is None else Claimed(token, 1, None, None, created=True)
        if facts.state not in LIVE_STATES:
            return Refused(facts.state, facts.owner, facts.expires_in)
        if same_job(delivery, facts):
            return self._claim_with(record.claim_job, params)  # recorded without a version
        return Refused("stale", facts.owner, facts.expires_in)

    # -- keeping the lease -------------------------------------------------------------------

    def renew(
        self, leases: Sequence[tuple[str, int]], *, session: Session | None = None
    ) -> Renewal:
        """Extend every lease still held under its token, in one statement. On a keeper's
        ``session``, the statement runs on that session and binds the leases to it."""
        if not leases:
            return Renewal(frozenset(), {})
        sql = self.sql.renew
        if len(leases) == 1:
            ((job_id, token),) = leases
            params: dict[str, Any] = {"b_id": job_id, "b_token": token, "b_pid": os.getpid()}
            renew = sql.one_unbound if session is None else sql.one_bound
            held = sql.one_held
        else:
            params = {
                "b_ids": [i for i, _ in leases],
                "b_tokens": [k for _, k in leases],
                "b_leases": [(i, k) for i, k in leases],
                "b_pid": os.getpid(),
            }
            renew = sql.unbound if session is None else sql.bound
            held = sql.held

        def run(c: Connection) -> Renewal:
            kept = self.dialect.renewed(c, renew, held, params, len(leases))
            return Renewal(
                frozenset(r[0] for r in kept), {r[0]: r[1] for r in kept if r[1] is not None}
            )

        if session is not None:
            return session.run(run)
        return self._hot(run, reads_back=True)  # type: ignore[no-any-return]

    def checkpoint(
        self,
        job_id: str,
        token: int,
        state: str,
        *,
        progress: tuple[int, int | None] | None = None,
        connection: Connection | Foreign | None = None,
        idle_limit: float | None = None,
    ) -> tuple[bool, str | None]:
        """Save a checkpoint (JSON text) and renew, fenced by ``token``.

        Returns (saved, stop request). With ``connection`` the statement joins the caller's
        transaction, so the caller's own writes and the checkpoint commit or roll back
        together; that transaction may then sit idle ``idle_limit`` seconds at most (the
        lease's length; default ``leases_duration``) before the database ends it. A
        :class:`Foreign` (Django's, inside ``transaction.atomic()``) joins that library's
        transaction the same way.
        """
        sql = self.sql.checkpoint
        idle_limit = self.settings.duration if idle_limit is None else idle_limit
        params: dict[str, Any] = {"b_id": job_id, "b_token": token, "b_checkpoint": state}
        if connection is None:
            stmt = sql.save if progress is None else sql.save_progress
        else:
            stmt = sql.save_in_tx if progress is None else sql.save_progress_in_tx
            params["b_idle_ms"] = str(math.ceil(idle_limit * 1000))
        if progress is not None:
            params["b_done"], params["b_total"] = progress

        def run(c: Connection | Foreign) -> tuple[bool, str | None]:
            # Where there is no RETURNING, the write first skips a row with a stop request:
            # one statement in the usual case; a row it skipped is saved (fenced as ever),
            # then its request read, so a hand-off or a cancel is seen at this checkpoint.
            found = self.dialect.rows(
                c, stmt, params, read_back=sql.stop_of, first_try=(sql.unstopped[stmt], (None,))
            )
            return (bool(found), found[0][0] if found and found[0] else None)

        if connection is None:
            return self._hot(run)  # type: ignore[no-any-return]
        with self.db.wrapped_errors("checkpoint failed"):
            self._guard_idle_writes(connection, idle_limit)
            return run(connection)

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
        connection: Connection | None = None,
        idle_limit: float | None = None,
    ) -> bool:
        """Save the cursor of lease key ``key`` (JSON text), fenced by the lease ``token`` of
        the running job ``job_id`` of that key: False if this attempt lost the lease. One
        statement; with ``connection``, in the caller's transaction, which may then sit idle
        ``idle_limit`` seconds at most (default ``leases_duration``), as with
        :meth:`checkpoint`."""
        keys = self.sql.keys
        params = {"b_key": key, "b_id": job_id, "b_token": token, "b_cursor": state}
        stmt = keys.save_cursor
        idle_limit = self.settings.duration if idle_limit is None else idle_limit
        if connection is not None:
            stmt = keys.save_cursor_in_tx
            params["b_idle_ms"] = str(math.ceil(idle_limit * 1000))

        def run(c: Connection) -> bool:
            return bool(self.dialect.upserted(c, stmt, params))

        if connection is None:
            return self._hot(run)  # type: ignore[no-any-return]
        with self.db.wrapped_errors("cursor not saved"):
            self._guard_idle_writes(connection, idle_limit)
            return run(connection)

    def bounds_idle(self, connection: Connection | Foreign) -> bool:
        """Whether a transactional checkpoint on ``connection`` bounds how long its
        transaction may sit idle."""
        return self.dialect.bounds_idle(connection.dialect)

    def _guard_idle_writes(self, connection: Connection | Foreign, idle_limit: float) -> None:
        """Bound how long the caller's transaction may sit idle after writing, where the
        database does it with a setting of the session (MariaDB; ``Dialect.with_idle_guard``
        does it elsewhere): set once per connection, given back when it returns to its pool
        (a foreign connection's owner gives it back: :meth:`unguard_idle_writes`)."""
        seconds = max(1, math.ceil(idle_limit))
        if connection.info.get(IDLE_WRITE_GUARD) == seconds:
            return
        if not self.dialect.guard_idle_writes(connection, seconds):
            return
        connection.info[IDLE_WRITE_GUARD] = seconds
        if isinstance(connection, Foreign):
            return
        pool = connection.engine.pool
        if not sa.event.contains(pool, "checkin", self._unguard_on_checkin):
            sa.event.listen(pool, "checkin", self._unguard_on_checkin)

    def _unguard_on_checkin(self, dbapi_connection: Any, record: Any) -> None:
        """A pool's ``checkin`` hook: the server's default idle-write bound back."""
        if record.info.pop(IDLE_WRITE_GUARD, None) is None or dbapi_connection is None:
            return
        # A broken connection fails here too: the pool replaces it, and its setting with it.
        with contextlib.suppress(Exception):
            cursor = dbapi_connection.cursor()
            cursor.execute(self.dialect.unguard_sql() or "")
            cursor.close()

    def unguard_idle_writes(self, connection: Foreign) -> None:
        """Give a foreign connection the server's default idle-write bound back, if a
        transactional checkpoint had set its own (call it outside any transaction)."""
        unguard = self.dialect.unguard_sql()
        if connection.info.pop(IDLE_WRITE_GUARD, None) is not None and unguard is not None:
            connection.exec_driver_sql(unguard)

    # -- how an attempt ends -----------------------------------------------------------------

    def finish(self, job_id: str, token: int, *, result: str | None) -> bool:
        """Mark the job done, fenced by ``token``. False if this attempt lost the lease."""
        params = {"b_id": job_id, "b_token": token, "b_result": result}
        return self._count(self.sql.end.finish, params) == 1

    def fail(self, job_id: str, token: int, *, error: str, state: str = FAILED) -> bool:
        """Mark the job failed (or cancelled), keeping its checkpoint; fenced by ``token``."""
        params = {"b_id": job_id, "b_token": token, "b_state": state, "b_error": error}
        return self._count(self.sql.end.fail, params) == 1

    def replace(self, job_id: str, token: int) -> bool:
        """End the job as ``replaced`` (``Task.replace``): its id goes to the replacement,
        which a later register or claim takes over. Fenced by ``token``."""
        return self._count(self.sql.end.replace, {"b_id": job_id, "b_token": token}) == 1

    def hand_back(self, job_id: str, token: int, *, reap_in: float | None) -> str | None:
        """Give the lease back, fenced by ``token``: the job's state after it (``queued``, or
        ``cancelled`` when an operator had cancelled it), None if this attempt lost the lease.

        ``reap_in`` seconds from now the reaper re-publishes the job; None when a message for
        it is already on its way (a Celery retry).
        """
        params = {"b_id": job_id, "b_token": token, "b_reap_in": reap_in}
        return self._handed_back(self.sql.end.hand_back, params)

    def hand_back_retry(
        self, job_id: str, token: int, message: Message, *, reap_in: float
    ) -> str | None:
        """Give the lease back for a Celery retry whose ``message`` becomes the job's message;
        fenced by ``token``; the state after it, as :meth:`hand_back`. The reaper re-publishes
        it ``reap_in`` seconds from now if no worker has claimed it by then."""
        params = {
            "b_id": job_id,
            "b_token": token,
            "b_reap_in": reap_in,
            "b_version": message.version,
            "b_message": message.dumps(),
        }
        return self._handed_back(self.sql.end.hand_back_retry, params)

    def _handed_back(self, stmt: Any, params: dict[str, Any]) -> str | None:
        def run(c: Connection) -> str | None:
            found = self.dialect.rows(c, stmt, params, read_back=self.sql.end.state_of)
            return str(found[0][0]) if found and found[0] else None

        return self._hot(run, reads_back=True)  # type: ignore[no-any-return]

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

    # -- lease keys: the follow-up -----------------------------------------------------------

    def start_followup(self, job_id: str) -> Message | None:
        """Hand the lease key of the ended job ``job_id`` to its follow-up, if a trigger
        waits for one: in one transaction, the follow-up is cleared from the ended job and
        recorded as a job of its own, so the key is never free in between (a trigger meanwhile
        waits, then is served by the follow-up). The message to publish, or None (none
        waits, or another caller recorded it)."""
        settings, keys = self.settings, self.sql.keys

        def hand_over(c: Any) -> Message | None:
            found = c.execute(keys.followup_of, {"b_id": job_id}).first()
            if found is None:
                return None
            text, followup_id = found
            c.execute(keys.clear_followup, {"b_id": job_id, "b_followup_id": followup_id})
            try:
                followup = rows.load_message(text, followup_id)
            except CorruptJob:
                return None  # nothing can run it: dropped with the mark
            eta = followup.eta_in()
            countdown = max(eta, 0.0) if eta else None
            # Its message goes out right after this; if that publish is lost (the caller
            # dies), the reaper sends it once this has passed.
            wait = (countdown or 0.0) + (settings.queued_timeout or settings.reap_grace)
            params = job_params(followup, text) | {
                "b_id": checked_id(followup.id),
                "b_countdown": countdown,
                "b_expires_in": wait,
            }
            return followup if self._insert(c, self.sql.record.register, params) else None

        if not self._schema_ready:
            self.check_schema()
        return self.db.run(hand_over, single=False, direct=True)  # type: ignore[no-any-return]


__all__ = ["IDLE_WRITE_GUARD", "Worker"]
