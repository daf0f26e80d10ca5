"""The lease store: the operations celery-leases performs on its jobs table.

Each operation binds values, runs its statements (``statements.py``) on the database
(``database.py``) and maps the rows (``rows.py``). Every worker operation (claim, renew tick,
checkpoint, finish, fail, hand back) is one conditional statement whose row count or RETURNING
tells the outcome. MariaDB/MySQL have no ``UPDATE ... RETURNING``: there a claim reads its row
back in the same transaction, and a renew tick asks which rows it kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import migrations, rows
from .config import TASK_OPTIONS, Settings, settings_for
from .database import Database, Session, local_process_gone
from .direct import Foreign
from .errors import (
    ConfigurationError,
    CorruptJob,
    InvalidJobState,
    JobNotFound,
    LeaseError,
)
from .identity import Facts, checked_id, checked_key, same_job, takes_over
from .message import Message
from .rows import Claimed, Job, Reaped, Refused, Renewal
from .schema import (
    CANCELLED,
    FAILED,
    LIVE_STATES,
    RUNNING,
    jobs_table,
    keys_table,
)
from .statements import Statements

logger = logging.getLogger("celery_leases")

#: Key in a caller's connection's ``info``: the idle-write bound this store set on it.
IDLE_WRITE_GUARD = "celery_leases_idle_write_timeout"


class Store:
    """Operations on the jobs table of one database. Safe to share between threads."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.db = Database(settings.database_url, settings.engine_options)
        self.table = jobs_table(sa.MetaData(), settings.table, self.db.dialect)
        self.keys = keys_table(self.table.metadata, settings.table)
        self.sql = Statements(self.table, self.db.dialect, self.keys)
        self._schema_ready = False

    @property
    def safe_url(self) -> str:
        return self.db.safe_url

    @property
    def dialect(self) -> str:
        return self.db.dialect

    @property
    def engine(self) -> sa.engine.Engine:
        return self.db.engine

    def _run(self, operation: Any, *, single: bool = False) -> Any:
        if not self._schema_ready:
            self.check_schema()
        return self.db.run(operation, single=single)

    def _hot(self, operation: Any, *, reads_back: bool = False) -> Any:
        """Run an operation of the hot path on this process's direct connection: one
        statement, in autocommit; with ``reads_back``, one that reads its row back where
        the dialect has no RETURNING (MariaDB), in a transaction."""
        if not self._schema_ready:
            self.check_schema()
        return self.db.run(operation, single=self.db.returning or not reads_back, direct=True)

    def _count(self, stmt: Any, params: dict[str, Any] | None = None) -> int:
        return int(self._hot(lambda c: c.execute(stmt, params or {}).rowcount))

    def _insert(self, c: Connection, stmt: Any, params: dict[str, Any]) -> bool:
        """Run an insert-unless-exists; True when it inserted. :class:`_KeyTaken` when another
        live job holds the row's lease key."""
        return bool(self._keyed(c, lambda: self._inserted(c, stmt, params)))

    def _inserted(self, c: Connection, stmt: Any, params: dict[str, Any]) -> bool:
        if self.db.returning:  # INSERT's rowcount is not reliable on every driver; RETURNING is
            return c.execute(stmt, params).first() is not None
        try:
            c.execute(stmt, params)
        except sa.exc.IntegrityError as exc:
            if _duplicate_key(exc) and not self._live_key_taken(exc):
                return False
            raise
        return True

    def _upserted(self, c: Connection, stmt: Any, params: dict[str, Any]) -> bool:
        """Run a conditional upsert of a key's cursor; True when it wrote (RETURNING where the
        dialect has it, else the row count of ``ON DUPLICATE KEY UPDATE``)."""
        if self.db.returning:
            return c.execute(stmt, params).first() is not None
        return bool(c.execute(stmt, params).rowcount)

    def _keyed(self, c: Connection, write: Any) -> Any:
        """Run ``write``, a statement that makes a job live; :class:`_KeyTaken` when another
        live job holds its lease key (the unique index on live keys refused it)."""
        try:
            return write()
        except sa.exc.IntegrityError as exc:
            if self._live_key_taken(exc):
                raise _KeyTaken() from exc
            raise

    def _live_key_taken(self, exc: sa.exc.IntegrityError) -> bool:
        text = str(exc.orig)
        return f"ix_{self.table.name}_live_key" in text or f"{self.table.name}.lease_key" in text

    def check_schema(self) -> None:
        """Check, in one round trip (a read of ``<table>_version``), that the table exists and
        is at the revision this code needs. Creates nothing: a missing or older table raises
        :class:`ConfigurationError` naming the command that migrates it."""

        def read(connection: Connection) -> list[str] | None:
            try:
                return [row[0] for row in connection.execute(self.sql.schema_revision).all()]
            except sa.exc.DBAPIError as exc:
                if exc.connection_invalidated:
                    raise  # the server went away: not a question of schema
                return None  # no version table

        found = self.db.run(read, single=True, direct=True)
        head = migrations.head()
        if found and found[0] == head:
            self._schema_ready = True
            return
        name, where = self.table.name, self.safe_url
        if found and found[0] not in migrations.revisions():
            # A newer celery-leases migrated it: revisions only add what older code ignores,
            # so a rolling deploy's older workers go on.
            logger.warning(
                "celery-leases: table %s in %s is at revision %s, newer than this "
                "celery-leases knows (%s): upgrade celery-leases",
                name,
                where,
                found[0],
                head,
            )
            self._schema_ready = True
            return
        if found:
            raise ConfigurationError(
                f"leases table {name!r} in {where} is at revision {found[0]}, older than this "
                f"celery-leases needs ({head}): run {migrations.UPGRADE_COMMAND}"
            )
        exists = self.db.run(lambda c: sa.inspect(c).has_table(name))
        if exists:
            raise ConfigurationError(
                f"leases table {name!r} in {where} has no migration history (made by an "
                f"older celery-leases, or its migration failed): bring it under the "
                f"migrations, jobs kept, with {migrations.UPGRADE_COMMAND}"
            )
        raise ConfigurationError(
            f"no leases table {name!r} in {where}: create it with {migrations.INIT_COMMAND}"
        )

    def warm(self) -> None:
        """Import the database driver and compile the hot path's statements in this process,
        opening no connection: a worker's main process calls it before forking its pool, so
        every pool process shares them (copy-on-write) instead of building its own."""
        for statement in self.sql.hot():
            self.db.direct.compile(statement)

    def schema_changed(self) -> None:
        """The table was migrated: check it again at the next operation."""
        self._schema_ready = False

    # -- writes of the client -------------------------------------------------------------

    def register(
        self,
        message: Message,
        *,
        countdown: float | None = None,
        queued_timeout: float | None = None,
        fresh: bool = True,
    ) -> Registered:
        """Record the job of a message about to be published: ``new``, ``taken over`` (a new
        job reusing the id of one that ended, or a replacement: :func:`takes_over`),
        ``coalesced`` (its lease key has a live job, which serves it: see :meth:`coalesce`),
        or the state of the job that keeps the id (this message is a copy, dropped at its
        claim).

        ``fresh``: the message was built anew (not from a recorded one, as Celery's re-sends
        of a request are: a retry after a lost pool process carries the job's version)."""
        text = message.dumps()
        job_id = checked_id(message.id)
        expires_in = None if queued_timeout is None else (countdown or 0.0) + queued_timeout
        params = _job_params(message, text) | {
            "b_id": job_id,
            "b_countdown": countdown or None,
            "b_expires_in": expires_in,
        }
        if message.key is not None:
            # A trigger of a busy key (a burst of webhooks) is coalesced after one read, with
            # no INSERT refused by the key's unique index (each refusal is an ERROR line in
            # PostgreSQL's log); an idle key's first trigger pays that read too.
            serving = self.coalesce(message, text)
            if serving is not None:
                return Registered("coalesced", serving)
        for _ in range(3):
            try:
                if self._hot(lambda c: self._insert(c, self.sql.register, params)):
                    return Registered("new", job_id)
                facts = self._facts(job_id)
                if facts is None:
                    continue  # deleted in between
                if not takes_over(message, facts, published=fresh):
                    return Registered(facts.state, job_id)
                seen = params | {"b_seen_token": facts.token, "b_seen_state": facts.state}
                if self._hot(lambda c, p=seen: self._take_over(c, p)):
                    return Registered("taken over", job_id)
            except _KeyTaken:
                serving = self.coalesce(message, text)
                if serving is not None:
                    return Registered("coalesced", serving)
                # The key's live job ended in between: record this one again.
        raise LeaseError(f"job {job_id}: its row kept changing while it was recorded; try again")

    def _take_over(self, c: Connection, params: dict[str, Any]) -> bool:
        return bool(self._keyed(c, lambda: c.execute(self.sql.take_over, params).rowcount == 1))

    def coalesce(self, message: Message, text: str) -> str | None:
        """Hand a trigger (``message``, of a lease key a job holds) to that job: one that has
        not started yet absorbs it (it starts after the trigger); one that has keeps the
        first trigger that came while it ran as its follow-up (started when it ends), and
        later ones are served by that follow-up; the id of the job that serves the trigger.
        None when no job holds the key any more (record it as a job of its own)."""
        params = {"b_key": message.key, "b_message": text, "b_id": message.id}
        for _ in range(3):
            found = self._hot(lambda c: c.execute(self.sql.key_holder, params).first())
            if found is None:
                return None
            holder, attempts, followup_id = found
            if holder == message.id:
                return None  # this very job: not a trigger of another (a copy of its message)
            if followup_id is not None:
                return str(followup_id)
            if attempts == 0:
                return str(holder)
            if self._count(self.sql.set_followup, params) == 1:
                return message.id
            # It ended, or was claimed, or got a follow-up in between: look again.
        raise LeaseError(f"lease key {message.key}: its holder kept changing; try again")

    def start_followup(self, job_id: str) -> Message | None:
        """Hand the lease key of the ended job ``job_id`` to its follow-up, if a trigger
        waits for one: in one transaction, the follow-up is cleared from the ended job and
        recorded as a job of its own, so the key is never free in between (a trigger meanwhile
        waits, then is served by the follow-up). The message to publish, or None (none
        waits, or another caller recorded it)."""
        settings = self.settings

        def hand_over(c: Any) -> Message | None:
            found = c.execute(self.sql.followup_of, {"b_id": job_id}).first()
            if found is None:
                return None
            text, followup_id = found
            c.execute(self.sql.clear_followup, {"b_id": job_id, "b_followup_id": followup_id})
            try:
                followup = rows.load_message(text, followup_id)
            except CorruptJob:
                return None  # nothing can run it: dropped with the mark
            eta = followup.eta_in()
            countdown = max(eta, 0.0) if eta else None
            # Its message goes out right after this; if that publish is lost (the caller
            # dies), the reaper sends it once this has passed.
            wait = (countdown or 0.0) + (settings.queued_timeout or settings.reap_grace)
            params = _job_params(followup, text) | {
                "b_id": checked_id(followup.id),
                "b_countdown": countdown,
                "b_expires_in": wait,
            }
            return followup if self._insert(c, self.sql.register, params) else None

        if not self._schema_ready:
            self.check_schema()
        return self.db.run(hand_over, single=False, direct=True)  # type: ignore[no-any-return]

    def followups_pending(self, *, batch: int) -> list[str]:
        """Ids of ended jobs whose follow-up run was not recorded yet (their ender died)."""
        found = self._run(lambda c: c.execute(self.sql.followups_pending, {"b_batch": batch}).all())
        return [r[0] for r in found]

    def cursor(self, key: str) -> Any:
        """The cursor saved for lease key ``key`` (JSON), None if none was."""
        text = self._hot(lambda c: c.execute(self.sql.cursor_of, {"b_key": key}).scalar())
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
        params = {"b_key": key, "b_id": job_id, "b_token": token, "b_cursor": state}
        stmt = self.sql.save_cursor
        idle_limit = self.settings.duration if idle_limit is None else idle_limit
        if connection is not None:
            stmt = self.sql.save_cursor_in_tx
            params["b_idle_ms"] = str(math.ceil(idle_limit * 1000))

        def run(c: Connection) -> bool:
            return self._upserted(c, stmt, params)

        if connection is None:
            return self._hot(run)  # type: ignore[no-any-return]
        with self.db.wrapped_errors("cursor not saved"):
            self._guard_idle_writes(connection, idle_limit)
            return run(connection)

    def set_cursor(self, key: str, state: str | None) -> bool:
        """Set the cursor of lease key ``key`` to ``state`` (JSON text; None clears it), for
        an operator or a test: only while no job holds the key (none queued, running, or
        ended with a follow-up to start). False, and nothing written, when one does. One
        statement."""
        params = {"b_key": key, "b_cursor": state}
        return self._run(  # type: ignore[no-any-return]
            lambda c: self._upserted(c, self.sql.set_cursor, params), single=True
        )

    def forget(self, job_id: str) -> bool:
        """Delete a job registered but never published (its publish failed)."""
        return self._count(self.sql.forget, {"b_id": job_id}) == 1

    # -- writes of a worker: one statement each --------------------------------------------

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
        hot = self.sql.claim_version if delivery.version else self.sql.claim_job
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
            if self.db.returning:
                row = c.execute(stmt, params).first()
            else:
                row = None
                if c.execute(stmt, params).rowcount == 1:
                    row = c.execute(self.sql.claimed, params).first()
            if row is None:
                return None
            checkpoint = rows.loads(row[2], params["b_id"], "checkpoint")
            return Claimed(row[0], row[1], checkpoint, row[3], created=False)

        return self._hot(run, reads_back=True)  # type: ignore[no-any-return]

    def _claim_other(
        self, delivery: Message, params: dict[str, Any], *, fresh: bool
    ) -> Claimed | Refused | None:
        """The delivery matched no claimable recorded message: create the job, take the id
        over, claim the same job recorded without a version, or refuse. None when the row
        changed in between (claim again). A delivery of a lease key that has another live
        job is a trigger of that key (:meth:`coalesce`), refused as ``coalesced``."""
        try:
            return self._claim_new(delivery, params, fresh=fresh)
        except _KeyTaken:
            serving = self.coalesce(delivery, delivery.dumps())
            return None if serving is None else Refused("coalesced", None, None, serving)

    def _claim_new(
        self, delivery: Message, params: dict[str, Any], *, fresh: bool
    ) -> Claimed | Refused | None:
        facts = self._facts(params["b_id"])
        if facts is None:
            created = params | _job_params(delivery, delivery.dumps())
            inserted = self._hot(lambda c: self._insert(c, self.sql.create_claimed, created))
            return Claimed(1, 1, None, None, created=True) if inserted else None
        if facts.state == RUNNING and (facts.expires_in or 0.0) > 0:
            return Refused("held", facts.owner, facts.expires_in)
        if takes_over(delivery, facts, published=fresh):
            job = params | _job_params(delivery, delivery.dumps())
            job |= {"b_seen_token": facts.token, "b_seen_state": facts.state}

            def take(c: Connection) -> int | None:
                result = self._keyed(c, lambda: c.execute(self.sql.take_over_claimed, job))
                if self.db.returning:
                    row = result.first()
                    return None if row is None else int(row[0])
                return facts.token + 1 if result.rowcount == 1 else None

            token = self._hot(take)
            return None if token is None else Claimed(token, 1, None, None, created=True)
        if facts.state not in LIVE_STATES:
            return Refused(facts.state, facts.owner, facts.expires_in)
        if same_job(delivery, facts):
            return self._claim_with(self.sql.claim_job, params)  # recorded without a version
        return Refused("stale", facts.owner, facts.expires_in)

    def _facts(self, job_id: str) -> Facts | None:
        row = self._hot(lambda c: c.execute(self.sql.facts, {"b_id": job_id}).first())
        return None if row is None else Facts(*row)

    def renew(
        self, leases: Sequence[tuple[str, int]], *, session: Session | None = None
    ) -> Renewal:
        """Extend every lease still held under its token, in one statement. On a keeper's
        ``session``, the statement runs on that session and binds the leases to it."""
        if not leases:
            return Renewal(frozenset(), {})
        sql = self.sql
        if len(leases) == 1:
            ((job_id, token),) = leases
            params: dict[str, Any] = {"b_id": job_id, "b_token": token, "b_pid": os.getpid()}
            renew = sql.renew_one if session is None else sql.renew_one_bound
            renewed = sql.renewed_one
        else:
            params = {
                "b_ids": [i for i, _ in leases],
                "b_tokens": [k for _, k in leases],
                "b_leases": [(i, k) for i, k in leases],
                "b_pid": os.getpid(),
            }
            renew = sql.renew if session is None else sql.renew_bound
            renewed = sql.renewed

        def run(c: Connection) -> Renewal:
            if self.db.returning:
                kept = c.execute(renew, params).all()
                if len(kept) < len(leases) and self.dialect == "postgresql":
                    # Skipped rows (locked) that are still held count as held.
                    kept = c.execute(renewed, params).all()
            else:
                c.execute(renew, params)
                kept = c.execute(renewed, params).all()
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
        transaction, so the caller's own writes and the checkpoint commit or roll back together;
        that transaction may then sit idle ``idle_limit`` seconds at most (the lease's length;
        default ``leases_duration``) before the database ends it. A :class:`Foreign`
        (Django's, inside ``transaction.atomic()``) joins that library's transaction the same way.
        """
        idle_limit = self.settings.duration if idle_limit is None else idle_limit
        params: dict[str, Any] = {"b_id": job_id, "b_token": token, "b_checkpoint": state}
        if connection is None:
            stmt = self.sql.checkpoint if progress is None else self.sql.checkpoint_progress
        else:
            stmt = self.sql.checkpoint_in_tx
            if progress is not None:
                stmt = self.sql.checkpoint_progress_in_tx
            params["b_idle_ms"] = str(math.ceil(idle_limit * 1000))
        if progress is not None:
            params["b_done"], params["b_total"] = progress

        def run(c: Connection | Foreign) -> tuple[bool, str | None]:
            if self.db.returning:
                row = c.execute(stmt, params).first()
                return (row is not None, row[0] if row is not None else None)
            # No RETURNING on MariaDB: the write skips a row with a stop request, so the
            # common case is one statement; a row it skipped is saved (fenced as ever), then
            # its request read, so a hand-off or a cancel is seen at this checkpoint.
            if c.execute(self.sql.unstopped[stmt], params).rowcount == 1:
                return (True, None)
            if c.execute(stmt, params).rowcount != 1:
                return (False, None)
            row = c.execute(self.sql.renewed_one, params).first()  # (id, stop request)
            return (True, row[1] if row is not None else None)

        if connection is None:
            return self._hot(run)  # type: ignore[no-any-return]
        with self.db.wrapped_errors("checkpoint failed"):
            self._guard_idle_writes(connection, idle_limit)
            return run(connection)

    @staticmethod
    def bounds_idle(connection: Connection | Foreign) -> bool:
        """Whether a transactional checkpoint on ``connection`` bounds how long its
        transaction may sit idle (PostgreSQL, MariaDB; not MySQL, not SQLite)."""
        dialect = connection.dialect
        return dialect.name == "postgresql" or bool(getattr(dialect, "is_mariadb", False))

    def _guard_idle_writes(self, connection: Connection | Foreign, idle_limit: float) -> None:
        """MariaDB's bound on how long the caller's transaction may sit idle after writing
        (PostgreSQL's is in the checkpoint statement itself, transaction-local): a worker
        frozen before its commit then loses the connection, and the row's lock, after about
        one lease. MariaDB has no transaction-local setting: the connection keeps it while
        checked out (one ``SET`` at its first transactional checkpoint), and gets the
        server's default back when it returns to its pool (MySQL has no such setting)."""
        if not getattr(connection.dialect, "is_mariadb", False):
            return
        seconds = max(1, math.ceil(idle_limit))
        if connection.info.get(IDLE_WRITE_GUARD) != seconds:
            connection.exec_driver_sql(f"SET SESSION idle_write_transaction_timeout = {seconds}")
            connection.info[IDLE_WRITE_GUARD] = seconds
            if isinstance(connection, Foreign):
                return  # its owner gives the default back (unguard_idle_writes)
            pool = connection.engine.pool
            if not sa.event.contains(pool, "checkin", _unguard_idle_writes):
                sa.event.listen(pool, "checkin", _unguard_idle_writes)

    @staticmethod
    def unguard_idle_writes(connection: Foreign) -> None:
        """Give a foreign connection the server's default idle-write bound back, if a
        transactional checkpoint had set its own (MariaDB; call it outside any transaction)."""
        if connection.info.pop(IDLE_WRITE_GUARD, None) is not None:
            connection.exec_driver_sql("SET SESSION idle_write_transaction_timeout = DEFAULT")

    def finish(self, job_id: str, token: int, *, result: str | None) -> bool:
        """Mark the job done, fenced by ``token``. False if this attempt lost the lease."""
        return (
            self._count(self.sql.finish, {"b_id": job_id, "b_token": token, "b_result": result})
            == 1
        )

    def fail(self, job_id: str, token: int, *, error: str, state: str = FAILED) -> bool:
        """Mark the job failed (or cancelled), keeping its checkpoint; fenced by ``token``."""
        params = {"b_id": job_id, "b_token": token, "b_state": state, "b_error": error}
        return self._count(self.sql.fail, params) == 1

    def hand_back(self, job_id: str, token: int, *, reap_in: float | None) -> str | None:
        """Give the lease back, fenced by ``token``: the job's state after it (``queued``, or
        ``cancelled`` when an operator had cancelled it), None if this attempt lost the lease.

        ``reap_in`` seconds from now the reaper re-publishes the job; None when a message for
        it is already on its way (a Celery retry).
        """
        params = {"b_id": job_id, "b_token": token, "b_reap_in": reap_in}
        return self._handed_back(self.sql.hand_back, params)

    def _handed_back(self, stmt: Any, params: dict[str, Any]) -> str | None:
        def run(c: Connection) -> str | None:
            if self.db.returning:
                row = c.execute(stmt, params).first()
                return None if row is None else str(row[0])
            if c.execute(stmt, params).rowcount != 1:
                return None
            return str(c.execute(self.sql.state_of, params).scalar_one())

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

        def run(c: Connection) -> tuple[str | None, str | None]:
            if self.db.returning:
                row = c.execute(self.sql.hand_back_owned, params).first()
            elif c.execute(self.sql.hand_back_owned, params).rowcount == 1:
                row = c.execute(self.sql.state_and_message, params).first()
            else:
                row = None
            return (None, None) if row is None else (str(row[0]), row[1])

        return self._hot(run, reads_back=True)  # type: ignore[no-any-return]

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
        return self._handed_back(self.sql.hand_back_retry, params)

    def replace(self, job_id: str, token: int) -> bool:
        """End the job as ``replaced`` (``Task.replace``): its id goes to the replacement,
        which a later register or claim takes over. Fenced by ``token``."""
        return self._count(self.sql.replace, {"b_id": job_id, "b_token": token}) == 1

    # -- operators -------------------------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        """The job recorded under ``job_id``, or None."""
        found = self._hot(lambda c: c.execute(self.sql.job_by_id, {"b_id": job_id}).mappings())
        return rows.job(found[0]) if found else None

    def list_jobs(
        self, *, states: Iterable[str] = (), task: str | None = None, limit: int = 50
    ) -> list[Job]:
        """Jobs, newest first, filtered by state and task name."""
        t = self.table
        where: list[Any] = []
        if states:
            where.append(t.c.state.in_(list(states)))
        if task:
            where.append(t.c.task == task)
        return self._jobs(*where, limit=limit, order=t.c.created_at.desc())

    def _jobs(self, *where: Any, limit: int | None = None, order: Any = None) -> list[Job]:
        stmt = self.sql.select_jobs(*where).limit(limit)
        if order is not None:
            stmt = stmt.order_by(order)
        return [rows.job(row._mapping) for row in self._run(lambda c: c.execute(stmt).all())]

    def give_up(self, job_id: str, *, error: str, notify: str | None = None) -> bool:
        """Fail a job no live lease holds (queued, or its lease expired). ``notify``: the
        Celery state the reaper then stores in the result backend (None: Celery already
        records one)."""
        params = {"b_id": job_id, "b_error": error, "b_notify": notify}
        return self._count(self.sql.give_up, params) == 1

    def end_live(self, job_id: str, *, state: str, error: str, notify: str | None = None) -> bool:
        """End a queued or running job as ``state``, whatever attempt holds it: Celery decided
        (a revoke, an expiry, a hard time limit in a worker's main process)."""
        params = {"b_id": job_id, "b_state": state, "b_error": error, "b_notify": notify}
        return self._count(self.sql.end_live, params) == 1

    def request_stop(self, job_ids: Sequence[str], kind: str) -> int:
        """Ask running attempts to stop at their next checkpoint (``cancel`` or ``preempt``)."""
        return self._count(self.sql.request_stop, {"b_ids": list(job_ids), "b_kind": kind})

    def request_stop_owned_by(self, owner_prefix: str, kind: str) -> int:
        """Ask every running attempt whose owner starts with ``owner_prefix`` to stop."""
        params = {"b_owner_like": like_prefix(owner_prefix), "b_kind": kind}
        return self._count(self.sql.request_stop_owned_by, params)

    def cancel_queued(self, job_id: str) -> bool:
        """Cancel a job that no worker holds; its message will be dropped by the claim."""
        return self._count(self.sql.cancel_queued, {"b_id": job_id}) == 1

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
        try:
            requeued = self._hot(
                lambda c: self._keyed(c, lambda: c.execute(self.sql.requeue, params).rowcount)
            )
        except _KeyTaken:
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

    def release(self, job_id: str) -> bool:
        """Expire a running job's lease now (an operator knows its host is dead), so the next
        reaper pass re-publishes it."""
        return self._count(self.sql.release, {"b_id": job_id}) == 1

    def ids_starting_with(self, prefix: str, *, limit: int) -> list[str]:
        """Ids of up to ``limit`` jobs whose id starts with ``prefix`` (case-sensitive)."""
        params = {"b_prefix_like": like_prefix(prefix), "b_limit": limit}
        found = self._run(lambda c: c.execute(self.sql.ids_starting_with, params).scalars().all())
        # LIKE ignores case on SQLite and MySQL's default collations.
        return [i for i in found if i.startswith(prefix)]

    def count_by_state(self) -> dict[str, int]:
        """How many jobs the table holds in each state."""
        return dict(self._run(lambda c: c.execute(self.sql.count_by_state).all()))

    def now(self) -> float:
        """The database clock, in epoch seconds."""
        return float(self._hot(lambda c: c.execute(self.sql.now).scalar_one()))

    # -- the reaper ------------------------------------------------------------------------

    def expire_orphaned(self, *, batch: int) -> list[tuple[str, str | None]]:
        """End now the leases of running jobs whose holder's database session is gone (its
        process died, or its host): (id, previous owner) of each. The usual expiry path then
        re-publishes them in the same reaper pass. A holder that is alive but frozen or cut
        off keeps its session: its lease expiry stays the fence.

        SQLite has no sessions to look at: a holder on this host whose process is gone counts
        (holders on other hosts, as their owner names them, wait for their expiry)."""

        def run(c: Connection) -> list[tuple[str, str | None]]:
            rows = c.execute(self.sql.orphan_candidates, {"b_batch": batch}).all()
            if not self.sql.sessions_in_sql:
                rows = [r for r in rows if local_process_gone(r.owner, r.session)]
            ended = []
            for row in rows:
                params = {
                    "b_id": row.id,
                    "b_token": row.token,
                    "b_session": row.session,
                }
                if c.execute(self.sql.expire_orphans, params).rowcount == 1:
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
        t = self.table

        def run(c: Connection) -> Reaped:
            found = dict(c.execute(self.sql.expired_candidates, {"b_batch": batch}).all())
            ids = list(found)
            if not ids:
                return Reaped([], [])
            poison, give_up, republish = self.sql.expired_batch(
                ids, grace=grace, max_stalled=max_stalled, max_attempts=max_attempts
            )
            gave_up: list[str] = []
            if poison is not None:
                gave_up = [r[0] for r in c.execute(poison).all()]
                if gave_up:
                    c.execute(give_up.where(t.c.id.in_(gave_up), self.sql.expired))
            live = [i for i in ids if i not in set(gave_up)]
            marked: list[str] = []
            if live:
                stmt = republish.where(t.c.id.in_(live), self.sql.expired)
                if self.db.returning:
                    marked = [r[0] for r in c.execute(stmt.returning(t.c.id)).all()]
                else:
                    c.execute(stmt)
                    marked = live  # the select above locked these rows for this transaction
            jobs, corrupt = self._parse_jobs(c, marked)
            if corrupt:
                c.execute(self.sql.fail_corrupt, {"b_ids": list(corrupt)})
            failed, _ = self._parse_jobs(c, gave_up + list(corrupt))
            return Reaped(jobs, failed, found)

        return self._run(run)  # type: ignore[no-any-return]

    def take_notices(self, *, batch: int) -> list[Job]:
        """Up to ``batch`` jobs whose end the result backend has not been told, now marked as
        told: the caller stores their state (at most once, even with several reapers)."""

        def run(c: Connection) -> list[Job]:
            ids = [r[0] for r in c.execute(self.sql.noticed, {"b_batch": batch}).all()]
            if not ids:
                return []
            jobs, _ = self._parse_jobs(c, ids)
            c.execute(self.sql.clear_notices, {"b_ids": ids})
            # Only what is still marked: a notice another pass took meanwhile is its own.
            return [job for job in jobs if job.notify is not None]

        return self._run(run)  # type: ignore[no-any-return]

    def notify_again(self, job_id: str, notify: str | None) -> None:
        """Mark the job again for :meth:`take_notices` (the result backend refused it)."""
        self._count(self.sql.set_notify, {"b_id": job_id, "b_notify": notify})

    def _parse_jobs(self, c: Connection, ids: list[str]) -> tuple[list[Job], dict[str, str]]:
        """The jobs ``ids``, and the ids whose stored values are not JSON (with the error)."""
        if not ids:
            return [], {}
        select = self.sql.select_jobs(self.table.c.id.in_(ids))
        found = c.execute(select).all()
        jobs: list[Job] = []
        corrupt: dict[str, str] = {}
        for row in found:
            try:
                jobs.append(rows.job(row._mapping))
            except CorruptJob as exc:
                corrupt[row._mapping["id"]] = str(exc)
        return jobs, corrupt

    def purge(self, *, older_than: float, batch: int) -> int:
        """Delete up to ``batch`` jobs finished more than ``older_than`` seconds ago."""
        params: dict[str, Any] = {"b_older_than": older_than, "b_batch": batch}

        def run(c: Connection) -> int:
            ids = [r[0] for r in c.execute(self.sql.purgeable, params).all()]
            if not ids:
                return 0
            return int(c.execute(self.sql.purge, params | {"b_ids": ids}).rowcount)

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


def _job_params(message: Message, text: str) -> dict[str, Any]:
    return {
        "b_key": checked_key(message.key),
        "b_task": message.task,
        "b_generation": message.generation,
        "b_version": message.version,
        "b_message": text,
    }


class _KeyTaken(Exception):
    """A write would make a second job of a lease key live (the unique index refused it)."""


@dataclass(frozen=True)
class Registered:
    """What :meth:`Store.register` did with a message: ``outcome`` (``new``, ``taken over``,
    ``coalesced``, or the state of the job that keeps the id), and ``job_id``, the job that
    serves it (another job's id when coalesced)."""

    outcome: str
    job_id: str


def like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``\\``) matching values that start with ``prefix``."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _duplicate_key(exc: sa.exc.IntegrityError) -> bool:
    code = getattr(exc.orig, "args", (None,))[0]
    return code == 1062  # ER_DUP_ENTRY


_stores: dict[tuple[str, ...], Store] = {}
_stores_lock = threading.Lock()


def _unguard_idle_writes(dbapi_connection: Any, record: Any) -> None:
    """A pool's ``checkin`` hook: give a connection the server's default idle-write bound
    back once a transactional checkpoint had set its own (``Store._guard_idle_writes``)."""
    if record.info.pop(IDLE_WRITE_GUARD, None) is None or dbapi_connection is None:
        return
    # A broken connection fails here too: the pool replaces it, and its setting with it.
    with contextlib.suppress(Exception):
        cursor = dbapi_connection.cursor()
        cursor.execute("SET SESSION idle_write_transaction_timeout = DEFAULT")
        cursor.close()


def store_for(settings: Settings) -> Store:
    """The shared Store of these settings (one engine per process and database)."""
    # Every app-wide setting is in the key (the store reads some: bind_session,
    # max_attempts), so settings changed at run time get a store of their own; a task's own
    # options (its lease duration) are not, so they share the store of their database.
    key = tuple(
        json.dumps(getattr(settings, f.name), sort_keys=True, default=repr)
        for f in dataclasses.fields(settings)
        if f.name not in TASK_OPTIONS
    )
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = Store(settings)
        return store


def get_job(app: Any, job_id: str) -> Job | None:
    """The job recorded under ``job_id`` in ``app``'s leases table, or None.

    The :class:`Job` has its state, checkpoint, attempts, token, owner and ``expires_in``
    (seconds left on the lease by the database clock).
    """
    return store_for(settings_for(app)).get(job_id)
