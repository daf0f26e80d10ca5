"""Every SQL statement of celery-leases, built once per table and dialect.

Values travel as bind parameters (``b_*``), so each statement object keeps its SQLAlchemy cache
key and a call only binds: building an UPDATE on every call cost more CPU than the database
spends on it (docs/benchmarks.md). Every time is the database clock (``db_now()``).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.dml import Update

from .direct import NOT_PREPARED
from .schema import (
    CANCELLED,
    DONE,
    FAILED,
    FINISHED_STATES,
    LIVE_STATES,
    QUEUED,
    REPLACED,
    RUNNING,
    SCHEMA_VERSION,
    SESSION_LOCK_PREFIX,
    db_now,
    version_table,
)

GAVE_UP_NO_PROGRESS = (
    "gave up: its last attempts ended (crashed, killed or lost) without saving a checkpoint "
    "(leases_max_attempts_without_progress)"
)
GAVE_UP_MAX_ATTEMPTS = "gave up: reached leases_max_attempts"
GAVE_UP_CORRUPT = "gave up: its stored message or checkpoint cannot be read"
CANCELLED_TEXT = "cancelled by an operator"


def param(name: str, type_: Any = None) -> Any:
    return sa.bindparam(f"b_{name}", type_=type_)


def unindexed(column: Any) -> Any:
    """``column`` in a form no index serves, for a row found by primary key.

    Statistics taken while few jobs ran (a burst after a quiet spell) make PostgreSQL prefer
    the (state, expires_at) index for ``state = 'running'`` and walk every running job on
    each write; SQLite does so without statistics. See docs/benchmarks.md.
    """
    return sa.func.coalesce(column, "")


def holder_session(dialect: str) -> Any:
    """The id of the session running the statement, for a keeper's renewal to bind the
    lease to: PostgreSQL's backend pid, MariaDB's connection id (only while that connection
    holds its keeper lock, which is what the reaper looks for), SQLite's process id (given)."""
    if dialect == "postgresql":
        return sa.func.pg_backend_pid()
    if dialect in ("mysql", "mariadb"):
        lock = sa.func.concat(SESSION_LOCK_PREFIX, sa.func.connection_id())
        return sa.case(
            (sa.func.is_used_lock(lock) == sa.func.connection_id(), sa.func.connection_id()),
            else_=sa.null(),
        )
    return param("pid", sa.BigInteger())


def claimed_session(dialect: str) -> Any:
    """The claimant's keeper session (``b_session``), bound at the claim only if that session
    is alive now (a keeper that has not yet seen its connection drop binds nothing: expiry)."""
    session = param("session", sa.BigInteger())
    if dialect == "postgresql":
        alive = sa.exists().select_from(sa.func.pg_stat_get_activity(sa.cast(session, sa.Integer)))
    elif dialect in ("mysql", "mariadb"):
        alive = sa.func.is_used_lock(sa.func.concat(SESSION_LOCK_PREFIX, session)) == session
    else:
        return session
    return sa.case((alive, session), else_=sa.null())


def session_gone(table: sa.Table, dialect: str) -> Any:
    """SQL true for a running job whose holder's session has ended, and not in a reset that
    ended every session (a restart, a crash recovery, a failover: those leases wait for their
    expiry while their holders bind again). None where the database cannot tell (SQLite: the
    store checks the holder's pid).

    PostgreSQL: some client session older than the lease's last renewal is still alive, so no
    reset happened since (a crash recovery keeps ``pg_postmaster_start_time()``; sessions of
    other database users show no start time, so with those alone nothing counts as gone).
    MariaDB: the server has been up since that renewal (a failover is not seen: expiry)."""
    t = table
    if dialect == "postgresql":
        backend = sa.func.pg_stat_get_activity(sa.cast(t.c.session, sa.Integer))
        activity = sa.table(
            "pg_stat_activity", sa.column("backend_type"), sa.column("backend_start")
        )
        survivor = sa.exists().where(
            activity.c.backend_type == "client backend",
            activity.c.backend_start < sa.func.to_timestamp(t.c.renewed_at),
        )
        return sa.and_(~sa.exists().select_from(backend), survivor)
    if dialect in ("mysql", "mariadb"):
        status = sa.table(
            "GLOBAL_STATUS",
            sa.column("VARIABLE_NAME"),
            sa.column("VARIABLE_VALUE"),
            schema="information_schema",
        )
        uptime = (
            sa.select(sa.cast(status.c.VARIABLE_VALUE, sa.Double()))
            .where(status.c.VARIABLE_NAME == "UPTIME")
            .scalar_subquery()
        )
        lock = sa.func.concat(SESSION_LOCK_PREFIX, t.c.session)
        return sa.and_(sa.func.is_used_lock(lock).is_(None), t.c.renewed_at > db_now() - uptime)
    return None


class SkipLockedUpdate(Update):
    """A MariaDB/MySQL ``UPDATE`` of the rows a derived table named ``lockable`` selected
    ``FOR UPDATE SKIP LOCKED`` (these databases have no ``UPDATE ... SKIP LOCKED``).

    SQLAlchemy renders ``UPDATE jobs, (SELECT ...) AS lockable SET ... WHERE jobs.id =
    lockable.id``, which lets the optimizer scan ``jobs`` first and wait on every locked row
    it reads. This form joins in a fixed order, the derived rows first and then ``jobs`` by
    primary key: ``UPDATE (SELECT ...) AS lockable STRAIGHT_JOIN jobs FORCE INDEX (PRIMARY)
    SET ...``, so only the rows the derived table locked are read.
    """

    inherit_cache = True


@compiles(SkipLockedUpdate, "mysql")
@compiles(SkipLockedUpdate, "mariadb")
def _skip_locked_update(element: SkipLockedUpdate, compiler: Any, **kw: Any) -> str:
    text: str = compiler.visit_update(element, **kw)
    table = compiler.preparer.format_table(element.table)
    head, derived_end = f"UPDATE {table}, (", ") AS lockable SET "
    end = text.find(derived_end)
    if not text.startswith(head) or end < 0:  # pragma: no cover - a new SQLAlchemy layout
        raise sa.exc.CompileError(f"unexpected multi-table UPDATE layout: {text[:80]!r}")
    derived = text[len(head) - 1 : end + len(") AS lockable")]
    rest = text[end + len(") AS lockable") :]
    return f"UPDATE {derived} STRAIGHT_JOIN {table} FORCE INDEX (PRIMARY){rest}"


class Statements:
    """The statements on one jobs table (and its keys table) for one dialect."""

    def __init__(self, table: sa.Table, dialect: str, keys: sa.Table | None = None) -> None:
        self.table = t = table
        self.dialect = dialect
        self.returning = dialect not in ("mysql", "mariadb")
        now = db_now()
        self.now = sa.select(now)
        # The table's migration revision, read once by a process's first operation.
        self.schema_revision = sa.select(version_table(t.metadata, t.name).c.version_num)
        seconds: Any = param("duration", sa.Double())

        # -- a job's row: written by the client, claimed, kept and ended by a worker ----------
        # A new job (or one taking over an id, see Store.register/claim): the message and
        # everything an earlier job of the id left is reset.
        job = {
            "task": param("task", t.c.task.type),
            "generation": param("generation", sa.Integer()),
            "version": param("version", t.c.version.type),
            "message": param("message", t.c.message.type),
            "lease_key": param("key", t.c.lease_key.type),
            "stalled_attempts": 0,
            "sends": 0,
            "created_at": now,
            "schema_version": SCHEMA_VERSION,
        }
        fresh = {
            c: None
            for c in (
                "checkpoint", "progress_done", "progress_total", "result", "error",
                "stop_requested", "notify", "checkpoint_at", "finished_at",
            )
        }  # fmt: skip
        queued = {
            "state": QUEUED,
            "owner": None,
            "session": None,
            "attempts": 0,
            "duration": None,
            "run_after": now + param("countdown", sa.Double()),
            "expires_at": now + param("expires_in", sa.Double()),
            "claimed_at": None,
            "renewed_at": None,
        }
        claimed = {
            "state": RUNNING,
            "owner": param("owner", t.c.owner.type),
            "session": claimed_session(dialect),
            "attempts": 1,
            "duration": seconds,
            "expires_at": now + seconds,
            "claimed_at": now,
            "renewed_at": now,
        }
        self.register = self._insert_ignore({"id": param("id"), "token": 0} | job | queued)
        # A message with no row (sent by name from elsewhere): the job is created claimed.
        self.create_claimed = self._insert_ignore({"id": param("id"), "token": 1} | job | claimed)
        # Another job takes the id over; fenced by what the deciding read saw.
        as_seen = sa.and_(
            t.c.id == param("id"),
            t.c.token == param("seen_token"),
            t.c.state == param("seen_state"),
        )
        self.take_over = (
            sa.update(t).where(as_seen).values({"token": t.c.token + 1} | job | fresh | queued)
        )
        take_over_claimed = (
            sa.update(t).where(as_seen).values({"token": t.c.token + 1} | job | fresh | claimed)
        )
        self.take_over_claimed = (
            take_over_claimed.returning(t.c.token) if self.returning else take_over_claimed
        )
        # What a claim that matched no row needs to decide (Store.claim).
        self.facts = sa.select(
            t.c.state, t.c.owner, t.c.expires_at - now, t.c.task, t.c.generation, t.c.version,
            t.c.token,
        ).where(t.c.id == param("id"))  # fmt: skip

        held = _unindexed_running = unindexed(t.c.state) == RUNNING
        by_token = sa.and_(t.c.id == param("id"), t.c.token == param("token"), held)
        claimable = sa.and_(
            t.c.id == param("id"),
            sa.or_(
                unindexed(t.c.state) == QUEUED,
                sa.and_(_unindexed_running, t.c.expires_at <= now),
            ),
        )
        self.claim_reads = [t.c.token, t.c.attempts, t.c.checkpoint, (now - t.c.checkpoint_at)]
        claim = sa.update(t).values(
            token=t.c.token + 1,
            attempts=t.c.attempts + 1,
            state=RUNNING,
            owner=param("owner", t.c.owner.type),
            session=claimed_session(dialect),
            duration=seconds,
            expires_at=now + seconds,
            claimed_at=now,
            renewed_at=now,
            # A preemption was for the attempt that saw it; a cancel stands.
            stop_requested=sa.case((t.c.stop_requested == "cancel", "cancel"), else_=sa.null()),
        )
        # The delivery is the recorded message (its version), or, for a message recorded by
        # none (sent by name), the same task and generation.
        same_version = t.c.version == param("version")
        same_job = sa.and_(
            t.c.task == param("task"), t.c.generation == param("generation", sa.Integer())
        )
        if self.returning:
            claim = claim.returning(*self.claim_reads)
        self.claim_version = claim.where(claimable, same_version)
        self.claim_job = claim.where(claimable, same_job)
        self.claimed = sa.select(*self.claim_reads).where(t.c.id == param("id"))

        # The plain id list lets every database find the rows by primary key.
        leases = sa.and_(
            t.c.id.in_(sa.bindparam("b_ids", expanding=True)),
            sa.tuple_(t.c.id, t.c.token).in_(sa.bindparam("b_leases", expanding=True)),
            held,
        )
        # A row locked by an open transaction (a checkpoint in a transaction of the task's)
        # is skipped, not waited for: one locked job must not hold up the renewal of the
        # process's other leases. Its checkpoint renews it when that transaction commits.
        lockable = sa.select(t.c.id).where(leases).with_for_update(skip_locked=True)
        renewable: Any = leases
        self.renewed = sa.select(t.c.id, t.c.stop_requested).where(leases)
        if dialect == "postgresql":
            # The leases as two arrays joined to the rows: one statement text whatever their
            # number (prepared once), and a join, not a (id, token) list tested on each row.
            held_leases = (
                sa.func.unnest(
                    param("ids", postgresql.ARRAY(t.c.id.type)),
                    param("tokens", postgresql.ARRAY(sa.BigInteger())),
                )
                .table_valued(sa.column("id", t.c.id.type), sa.column("token", sa.BigInteger()))
                .render_derived()
            )
            is_held = sa.and_(t.c.id == held_leases.c.id, t.c.token == held_leases.c.token)
            # The ids again as ``id = ANY(...)``: the rows are found by primary key.
            by_id = t.c.id == sa.any_(param("ids", postgresql.ARRAY(t.c.id.type)))
            lockable = (
                sa.select(t.c.id)
                .join(held_leases, is_held)
                .where(by_id, held)
                .with_for_update(skip_locked=True, of=t)
            )
            renewable = t.c.id.in_(lockable)
            self.renewed = (
                sa.select(t.c.id, t.c.stop_requested).join(held_leases, is_held).where(by_id, held)
            )
        elif dialect in ("mysql", "mariadb"):
            lockable_rows = lockable.subquery("lockable")
            renewable = t.c.id == lockable_rows.c.id

        # A keeper renews on its session's own connection and binds the leases to it; any
        # other renewal (one without a keeper) leaves them unbound: expiry only.
        def renewals(renewable: Any) -> tuple[Any, Any]:
            """(bound, unbound) renewals of the rows ``renewable`` selects."""
            made = {}
            for bound, session in ((True, holder_session(dialect)), (False, None)):
                renew = (
                    (SkipLockedUpdate(t) if dialect in ("mysql", "mariadb") else sa.update(t))
                    .where(renewable)
                    .values(expires_at=now + t.c.duration, renewed_at=now, session=session)
                )
                made[bound] = (
                    renew.returning(t.c.id, t.c.stop_requested) if self.returning else renew
                )
            return made[True], made[False]

        self.renew_bound, self.renew = renewals(renewable)
        # One lease (what a prefork pool process holds): the same renewal with the lease as
        # two scalars. PostgreSQL prepares it (its plan does not depend on a list's length),
        # and no list is expanded on the client at each tick.
        lockable_one = sa.select(t.c.id).where(by_token).with_for_update(skip_locked=True)
        renewable_one: Any = by_token
        if dialect == "postgresql":
            renewable_one = t.c.id.in_(lockable_one)
        elif dialect in ("mysql", "mariadb"):
            renewable_one = t.c.id == lockable_one.subquery("lockable").c.id
        self.renew_one_bound, self.renew_one = renewals(renewable_one)
        self.renewed_one = sa.select(t.c.id, t.c.stop_requested).where(by_token)
        if dialect == "postgresql":
            # Planned for the arrays they get: a plan made once for arrays of any length
            # (a prepared statement's generic plan) took a 500-lease tick from 9 to 80 ms.
            never_prepared = {NOT_PREPARED: False}
            self.renew_bound = self.renew_bound.execution_options(**never_prepared)
            self.renew = self.renew.execution_options(**never_prepared)
            self.renewed = self.renewed.execution_options(**never_prepared)

        saved = {
            "checkpoint": param("checkpoint", t.c.checkpoint.type),
            "checkpoint_at": now,
            "renewed_at": now,
            "expires_at": now + t.c.duration,
        }
        progress = {
            "progress_done": param("done", sa.BigInteger()),
            "progress_total": param("total", sa.BigInteger()),
        }
        self.checkpoint = self._returning_stop(sa.update(t).where(by_token).values(saved))
        self.checkpoint_progress = self._returning_stop(
            sa.update(t).where(by_token).values(saved | progress)
        )
        # No RETURNING (MariaDB, MySQL): a checkpoint first writes only a row with no stop
        # request, one statement in the common case; a row it skipped is then saved as above
        # and its request read with ``renewed_one`` (``Store.checkpoint``).
        unstopped = sa.and_(by_token, t.c.stop_requested.is_(None))
        self.unstopped = {
            self.checkpoint: sa.update(t).where(unstopped).values(saved),
            self.checkpoint_progress: sa.update(t).where(unstopped).values(saved | progress),
        }
        # In a transaction of the task's (checkpoint(connection=...)), on PostgreSQL: the
        # same statement also bounds how long that transaction may sit idle (the lease's
        # length), so a worker frozen before its commit cannot hold the row's lock, and the
        # job, for longer than its lease.
        self.checkpoint_in_tx, self.checkpoint_progress_in_tx = (
            self.checkpoint,
            self.checkpoint_progress,
        )
        if dialect == "postgresql":
            guard = sa.select(
                sa.func.set_config(
                    "idle_in_transaction_session_timeout", param("idle_ms", sa.String()), True
                ).label("v")
            ).cte("leases_idle_guard")
            guarded = sa.and_(by_token, sa.exists(sa.select(guard.c.v)))
            self.checkpoint_in_tx = self._returning_stop(
                sa.update(t).where(guarded).values(saved).add_cte(guard)
            )
            self.checkpoint_progress_in_tx = self._returning_stop(
                sa.update(t).where(guarded).values(saved | progress).add_cte(guard)
            )
        ended = {
            "owner": None,
            "session": None,
            "expires_at": None,
            "stop_requested": None,
            "finished_at": now,
        }
        # Idempotent for the token that ended it: a retry after a commit whose reply was lost
        # (the connection dropped) finds its own outcome and reports success.
        ended_by = sa.and_(t.c.id == param("id"), t.c.token == param("token"))
        self.finish = (
            sa.update(t)
            .where(ended_by, unindexed(t.c.state).in_([RUNNING, DONE]))
            .values(ended | {"state": DONE, "result": param("result", t.c.result.type)})
        )
        self.fail = (
            sa.update(t)
            .where(ended_by, unindexed(t.c.state).in_([RUNNING, param("state")]))
            .values(
                ended
                | {"state": param("state", t.c.state.type), "error": param("error", t.c.error.type)}
            )
        )
        self.replace = (
            sa.update(t).where(by_token).values(ended | {"state": REPLACED, "result": None})
        )
        # The lease handed back: the job is queued again, unless an operator cancelled it,
        # which it then is (and the reaper tells the result backend). With b_reap_in NULL,
        # expires_at is NULL: a message for the job is already on its way.
        cancel = t.c.stop_requested == "cancel"
        # MySQL evaluates SET left to right: the columns read come first.
        handed_back = [
            (t.c.error, sa.case((cancel, CANCELLED_TEXT), else_=t.c.error)),
            (t.c.notify, sa.case((cancel, "REVOKED"), else_=t.c.notify)),
            (t.c.finished_at, sa.case((cancel, now), else_=sa.null())),
            (
                t.c.expires_at,
                sa.case((cancel, sa.null()), else_=now + param("reap_in", sa.Double())),
            ),
            (t.c.state, sa.case((cancel, CANCELLED), else_=QUEUED)),
            (t.c.stop_requested, None),
            (t.c.owner, None),
            (t.c.session, None),
        ]
        self.hand_back = self._returning_state(
            sa.update(t).where(by_token).ordered_values(*handed_back)
        )
        # A Celery retry: the retry's message becomes the job's message.
        self.hand_back_retry = self._returning_state(
            sa.update(t)
            .where(by_token)
            .ordered_values(
                (t.c.version, sa.case((cancel, t.c.version), else_=param("version"))),
                (t.c.message, sa.case((cancel, t.c.message), else_=param("message"))),
                *handed_back,
            )
        )
        self.state_of = sa.select(t.c.state).where(t.c.id == param("id"))
        # A worker's main process saw the pool process holding the lease die. Only an attempt
        # that saved a checkpoint, under leases_max_attempts: one that died before any (a job
        # that kills its process) is left to the reaper, which counts it towards giving up.
        owned = sa.and_(
            t.c.id == param("id"),
            t.c.owner == param("owner"),
            held,
            t.c.checkpoint_at >= t.c.claimed_at,
            sa.or_(
                param("max_attempts", sa.Integer()).is_(None),
                t.c.attempts < param("max_attempts", sa.Integer()),
            ),
        )
        hand_back_owned = sa.update(t).where(owned).ordered_values(*handed_back)
        self.hand_back_owned = (
            hand_back_owned.returning(t.c.state, t.c.message) if self.returning else hand_back_owned
        )
        self.state_and_message = sa.select(t.c.state, t.c.message).where(t.c.id == param("id"))

        # -- operators ------------------------------------------------------------------------
        by_id = t.c.id == param("id")
        no_live_lease = sa.or_(
            t.c.state == QUEUED, sa.and_(t.c.state == RUNNING, t.c.expires_at <= now)
        )
        # Ended outside any attempt; ``notify``: the Celery state the reaper then stores.
        ended_outside = {
            "owner": None,
            "session": None,
            "expires_at": None,
            "stop_requested": None,
            "error": param("error"),
            "notify": param("notify"),
            "finished_at": now,
        }
        self.give_up = (
            sa.update(t).where(by_id, no_live_lease).values(ended_outside | {"state": FAILED})
        )
        # What Celery decided in a worker's main process (a revoke, an expiry, a hard time
        # limit): the result backend already says so, whatever attempt holds the job.
        self.end_live = (
            sa.update(t)
            .where(by_id, t.c.state.in_(LIVE_STATES))
            .values(ended_outside | {"state": param("state")})
        )
        self.forget = sa.delete(t).where(by_id, t.c.state == QUEUED, t.c.token == 0)
        self.cancel_queued = (
            sa.update(t)
            .where(by_id, t.c.state == QUEUED)
            .values(
                state=CANCELLED,
                expires_at=None,
                error=CANCELLED_TEXT,
                notify="REVOKED",
                finished_at=now,
            )
        )
        self.release = sa.update(t).where(by_id, t.c.state == RUNNING).values(expires_at=now)
        self.request_stop = (
            sa.update(t)
            .where(t.c.id.in_(sa.bindparam("b_ids", expanding=True)), t.c.state == RUNNING)
            .values(stop_requested=param("kind"))
        )
        # A shutdown's preemption never overwrites a pending cancel.
        self.request_stop_owned_by = (
            sa.update(t)
            .where(
                t.c.state == RUNNING,
                t.c.owner.like(param("owner_like"), escape="\\"),
                sa.or_(t.c.stop_requested.is_(None), t.c.stop_requested != "cancel"),
            )
            .values(stop_requested=param("kind"))
        )
        self.requeue = (
            sa.update(t)
            .where(by_id, t.c.state.in_(sa.bindparam("b_from_states", expanding=True)))
            .values(
                state=QUEUED,
                owner=None,
                session=None,
                expires_at=now + param("queued_timeout", sa.Double()),
                error=None,
                finished_at=None,
                stalled_attempts=0,
                stop_requested=None,
            )
        )
        self.ids_starting_with = (
            sa.select(t.c.id)
            .where(t.c.id.like(param("prefix_like"), escape="\\"))
            .order_by(t.c.id)
            .limit(param("limit"))
        )
        self.count_by_state = sa.select(t.c.state, sa.func.count()).group_by(t.c.state)

        # -- the reaper -----------------------------------------------------------------------
        self.expired = sa.and_(t.c.state.in_(LIVE_STATES), t.c.expires_at <= now)
        # Read the clock once per statement (an InitPlan on PostgreSQL), so the search on
        # (state, expires_at) is an index range and not a filter.
        self.expired_candidates = (
            sa.select(t.c.id, t.c.owner)
            .where(
                t.c.state.in_(LIVE_STATES),
                t.c.expires_at <= sa.select(db_now()).scalar_subquery(),
            )
            .order_by(t.c.expires_at)
            .limit(param("batch"))
            .with_for_update(skip_locked=True)
        )
        # Running jobs whose holder's session is gone, lease not yet expired: the reaper
        # expires them now (Store.expire_orphaned). SQLite: the rows bound to a session, for
        # the store to check each holder's pid.
        bound_running = sa.and_(
            t.c.state == RUNNING,
            t.c.session.is_not(None),
            t.c.expires_at > sa.select(db_now()).scalar_subquery(),
        )
        gone = session_gone(t, dialect)
        self.sessions_in_sql = gone is not None
        orphans = bound_running if gone is None else sa.and_(bound_running, gone)
        candidates = (
            sa.select(t.c.id, t.c.token, t.c.owner, t.c.session)
            .where(orphans)
            .order_by(t.c.renewed_at)
            .limit(param("batch"))
        )
        # PostgreSQL locks only the rows it returns; InnoDB would lock every running row it
        # scans (the liveness test runs above it), so MariaDB reads without locking and the
        # update below tests again, by primary key.
        self.orphan_candidates = (
            candidates.with_for_update(skip_locked=True) if dialect == "postgresql" else candidates
        )
        same_binding = sa.and_(
            t.c.id == param("id"),
            t.c.token == param("token"),
            t.c.session == param("session"),
            t.c.state == RUNNING,
        )
        self.expire_orphans = (
            sa.update(t)
            .where(same_binding if gone is None else sa.and_(same_binding, gone))
            .values(expires_at=now)
        )
        self.no_progress = sa.and_(
            t.c.state == RUNNING,
            sa.or_(t.c.checkpoint_at.is_(None), t.c.checkpoint_at < t.c.claimed_at),
        )
        self.fail_corrupt = (
            sa.update(t)
            .where(t.c.id.in_(sa.bindparam("b_ids", expanding=True)))
            .values(
                state=FAILED,
                owner=None,
                session=None,
                expires_at=None,
                finished_at=now,
                error=GAVE_UP_CORRUPT,
                notify="FAILURE",
            )
        )
        finished_before = sa.and_(
            t.c.state.in_(FINISHED_STATES),
            t.c.followup_id.is_(None),
            t.c.finished_at
            <= sa.select(db_now() - param("older_than", sa.Double())).scalar_subquery(),
        )
        # Oldest first: the order makes the planner walk the finished_at index, where a bare
        # LIMIT seq-scans the whole table when nothing is old enough (every idle pass).
        self.purgeable = (
            sa.select(t.c.id).where(finished_before).order_by(t.c.finished_at).limit(param("batch"))
        )
        self.purge = sa.delete(t).where(
            t.c.id.in_(sa.bindparam("b_ids", expanding=True)), finished_before
        )

        # Jobs whose end the result backend has not been told yet (Store.take_notices).
        self.noticed = (
            sa.select(t.c.id)
            .where(t.c.notify.is_not(None))
            .limit(param("batch"))
            .with_for_update(skip_locked=True)
        )
        self.set_notify = sa.update(t).where(by_id).values(notify=param("notify"))
        self.clear_notices = (
            sa.update(t)
            .where(t.c.id.in_(sa.bindparam("b_ids", expanding=True)))
            .values(notify=None)
        )

        # -- lease keys -------------------------------------------------------------------
        # The job holding a key (schema.KEY_HELD): live, or ended with a follow-up to start.
        # A trigger of a held key is read first (no lock, nothing written in the usual case):
        # a job never claimed yet (attempts = 0) starts after it and absorbs it; one with a
        # follow-up already has the job that serves it. Otherwise the trigger becomes the
        # follow-up of a job that has run, conditionally: MySQL evaluates SET left to right,
        # so the follow-up text is decided before its id changes.
        if dialect in ("mysql", "mariadb"):
            # KEY_HELD as the generated live_key (its key, else NULL): one lookup in its unique
            # index. The condition below would read (and, in an UPDATE under REPEATABLE READ,
            # lock) every live job through an index merge.
            holds_key = t.c.live_key == param("key", t.c.live_key.type)
        else:
            # The states as literals in the text, as in the partial index's predicate: a plan
            # made for any key (a prepared statement's generic plan on PostgreSQL; SQLite
            # always) may use that index only if the query's condition is the predicate,
            # values included. With them as parameters, both read the whole table.
            live: Any = sa.bindparam(
                "live_states", list(LIVE_STATES), expanding=True, literal_execute=True
            )
            holds_key = sa.and_(
                t.c.lease_key == param("key"),
                sa.or_(t.c.state.in_(live), t.c.followup_id.is_not(None)),
            )
        coalesced = (t.c.id, t.c.attempts, t.c.followup_id)
        self.key_holder = sa.select(*coalesced).where(holds_key)
        takes_followup = sa.and_(holds_key, t.c.attempts > 0, t.c.followup_id.is_(None))
        set_followup = (
            sa.update(t)
            .where(takes_followup)
            .ordered_values(
                (t.c.followup, param("message", t.c.followup.type)),
                (t.c.followup_id, param("id", t.c.followup_id.type)),
            )
        )
        self.set_followup = set_followup.returning(t.c.id) if self.returning else set_followup
        finished_with_followup = sa.and_(
            t.c.followup_id.is_not(None), t.c.state.in_(FINISHED_STATES)
        )
        # The hand-over of the key to the follow-up, in one transaction: its row locked, the
        # follow-up cleared (the key is free inside the transaction only), the follow-up
        # recorded as a job of its own (``register``).
        self.followup_of = (
            sa.select(t.c.followup, t.c.followup_id)
            .where(t.c.id == param("id"), finished_with_followup)
            .with_for_update()
        )
        self.followups_pending = (
            sa.select(t.c.id).where(finished_with_followup).limit(param("batch"))
        )
        self.clear_followup = (
            sa.update(t)
            .where(t.c.id == param("id"), t.c.followup_id == param("followup_id"))
            .values(followup=None, followup_id=None)
        )
        if keys is not None:
            k = keys
            self.cursor_of = sa.select(k.c.cursor_state).where(k.c.lease_key == param("key"))
            # Fenced by the live job's token; the job's row is read with a share lock, so a
            # claim that bumps the token waits for this write, or this write sees the new
            # token and writes nothing (a stale attempt cannot move the cursor).
            holder = (
                sa.select(t.c.id)
                .where(
                    t.c.id == param("id"),
                    t.c.token == param("token"),
                    unindexed(t.c.state) == RUNNING,
                    t.c.lease_key == param("key"),
                )
                .with_for_update(read=True)
            )
            written = sa.select(
                param("key", k.c.lease_key.type),
                param("cursor", k.c.cursor_state.type),
                param("id", k.c.job_id.type),
                param("token", sa.BigInteger()),
                now,
            ).where(sa.exists(holder))
            columns = ["lease_key", "cursor_state", "job_id", "token", "cursor_at"]

            def upsert_of(select: Any) -> Any:
                # INSERT's rowcount is not reliable on every driver: RETURNING tells it was
                # written.
                if dialect in ("postgresql", "sqlite"):
                    dml = postgresql if dialect == "postgresql" else sqlite
                    upsert: Any = dml.insert(k).from_select(columns, select)
                    return upsert.on_conflict_do_update(
                        index_elements=[k.c.lease_key],
                        set_={c: upsert.excluded[c] for c in columns[1:]},
                    ).returning(k.c.lease_key)
                upsert = mysql.insert(k).from_select(columns, select)
                return upsert.on_duplicate_key_update({c: upsert.inserted[c] for c in columns[1:]})

            self.save_cursor = self.save_cursor_in_tx = upsert_of(written)
            # An operator's (or a test helper's) cursor, written only while no job holds the
            # key (schema.KEY_HELD): the key's next run reads it, and no attempt can write
            # over it meanwhile. A NULL cursor clears it. Job and token NULL: no attempt wrote it.
            self.set_cursor = upsert_of(
                sa.select(
                    param("key", k.c.lease_key.type),
                    param("cursor", k.c.cursor_state.type),
                    sa.cast(sa.null(), k.c.job_id.type),
                    sa.cast(sa.null(), sa.BigInteger()),
                    now,
                ).where(~sa.exists(sa.select(t.c.id).where(holds_key)))
            )
            # In a transaction of the task's (save_cursor(connection=...)), on PostgreSQL: the
            # statement bounds how long that transaction may sit idle, as checkpoint_in_tx
            # does: its share lock on the job's row must not outlive the lease either.
            if dialect == "postgresql":
                guard = sa.select(
                    sa.func.set_config(
                        "idle_in_transaction_session_timeout", param("idle_ms", sa.String()), True
                    ).label("v")
                ).cte("leases_cursor_idle_guard")
                self.save_cursor_in_tx = upsert_of(
                    written.where(sa.exists(sa.select(guard.c.v))).add_cte(guard)
                )

        # -- reading jobs ---------------------------------------------------------------------
        self.job_columns = [
            *(
                c
                for c in t.columns
                if c.name not in ("duration", "schema_version", "followup", "live_key")
            ),
            (t.c.expires_at - now).label("expires_in"),
            (now - t.c.checkpoint_at).label("checkpoint_age"),
            (now - t.c.created_at).label("age"),
        ]

    def hot(self) -> list[Any]:
        """The statements of a worker's hot path (claim, renew, checkpoint, finish and their
        neighbours), for ``Store.warm``."""
        names = (
            "schema_revision", "register", "create_claimed", "claim_version", "claim_job",
            "claimed", "facts", "renew_bound", "renew", "renewed", "renew_one_bound",
            "renew_one", "renewed_one", "checkpoint", "checkpoint_progress",
            "finish", "fail", "hand_back", "hand_back_retry", "state_of", "replace",
            "key_holder", "set_followup",
        )  # fmt: skip
        return [getattr(self, name) for name in names] + list(self.unstopped.values())

    @property
    def job_by_id(self) -> Any:
        """The whole job of id ``b_id`` (``Store.get``), built once."""
        found = self.__dict__.get("_job_by_id")
        if found is None:
            found = self.__dict__["_job_by_id"] = self.select_jobs(self.table.c.id == param("id"))
        return found

    def select_jobs(self, *where: Any) -> Any:
        """A SELECT of whole jobs (as :func:`rows.job` reads them)."""
        return sa.select(*self.job_columns).where(*where)

    def expired_batch(
        self, ids: list[str], *, grace: float, max_stalled: int | None, max_attempts: int | None
    ) -> tuple[Any, Any, Any]:
        """(poison select, give-up update, re-publish update) for the expired jobs ``ids``."""
        t = self.table
        now = db_now()
        give_up_when = []
        stalled_out: Any = sa.false()
        if max_stalled is not None:
            stalled_out = sa.and_(self.no_progress, t.c.stalled_attempts + 1 >= max_stalled)
            give_up_when.append(stalled_out)
        if max_attempts is not None:
            give_up_when.append(t.c.attempts >= max_attempts)
        poison = None
        give_up = None
        if give_up_when:
            poison = sa.select(t.c.id).where(t.c.id.in_(ids), self.expired, sa.or_(*give_up_when))
            reason = sa.case(
                (stalled_out, sa.literal(GAVE_UP_NO_PROGRESS)),
                else_=sa.literal(GAVE_UP_MAX_ATTEMPTS),
            )
            # MySQL evaluates SET left to right: read the old state before changing it.
            give_up = sa.update(t).ordered_values(
                (t.c.error, reason),
                (
                    t.c.stalled_attempts,
                    t.c.stalled_attempts + sa.case((self.no_progress, 1), else_=0),
                ),
                (t.c.state, FAILED),
                (t.c.owner, None),
                (t.c.session, None),
                (t.c.expires_at, None),
                (t.c.notify, "FAILURE"),
                (t.c.finished_at, now),
            )
        # A job still queued when its wait ran out may only be waiting in a long backlog:
        # each re-publish of it doubles the wait (up to 64 times), so copies stay few.
        backoff = sa.case(*((t.c.sends == n, 2**n) for n in range(6)), else_=64)
        republish = sa.update(t).ordered_values(
            (
                t.c.stalled_attempts,
                sa.case(
                    (self.no_progress, t.c.stalled_attempts + 1),
                    (t.c.state == RUNNING, 0),
                    else_=t.c.stalled_attempts,
                ),
            ),
            (t.c.expires_at, now + grace * sa.case((t.c.state == QUEUED, backoff), else_=1)),
            (t.c.sends, sa.case((t.c.state == QUEUED, t.c.sends + 1), else_=0)),
            (t.c.state, QUEUED),
            (t.c.owner, None),
            (t.c.session, None),
        )
        return poison, give_up, republish

    def _returning_state(self, stmt: Any) -> Any:
        return stmt.returning(self.table.c.state) if self.returning else stmt

    def _returning_stop(self, stmt: Any) -> Any:
        return stmt.returning(self.table.c.stop_requested) if self.returning else stmt

    def _insert_ignore(self, values: dict[str, Any]) -> Any:
        """INSERT that does nothing when the id exists, RETURNING the id where supported; a
        second live job of a lease key is an IntegrityError (``Store.live_key_taken``).

        MySQL/MariaDB get a plain INSERT whose duplicate-key error the store reads as "exists":
        INSERT IGNORE would also turn a value the column cannot hold into a warning and a
        truncated row, and ON DUPLICATE KEY UPDATE reports 1 row either way under FOUND_ROWS.
        """
        t = self.table
        if self.dialect == "postgresql":
            insert: Any = postgresql.insert(t)
        elif self.dialect == "sqlite":
            insert = sqlite.insert(t)
        else:
            return sa.insert(t).values(values)
        # Only an existing id is "nothing to do": a second live job of a lease key must fail.
        return (
            insert.values(values).on_conflict_do_nothing(index_elements=[t.c.id]).returning(t.c.id)
        )
