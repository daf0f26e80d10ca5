"""``tests.support.apps.leased_app`` plus the tasks of the chaos driver (``chaos/driver.py``):
what its workers run (``celery -A chaos.app worker``).

Configured from the environment like ``leased_app`` (see its ``app_env``). Both tasks run
``count`` units of ``unit_seconds``, write one unit-log row per unit (``<table>_units``,
``tests/support/unit_log.py``) and resume from ``{"next": unit}``:

- ``chaos.exactly_once(count, unit_seconds, tail_seconds=0)``: the unit row is committed in
  the transaction of its checkpoint (``self.checkpoint(..., connection=conn)``);
- ``chaos.at_least_once(count, unit_seconds, tail_seconds=0)``: the unit row is committed on
  its own, then ``self.checkpoint(state)`` (no connection) saves the checkpoint: a crash
  between the two redoes that unit.

``tail_seconds`` is a sleep after the last checkpoint, before the job finishes.

``chaos.grouped_<g>(count, unit_seconds, tail_seconds=0, group=g)`` is ``chaos.exactly_once``
in job group ``g`` (``lease_group="{group}"``), with that group's limit and rate (``GROUPS``);
:func:`install_admission_log` copies every admission (``admitted_at`` and the token's time,
``run_after``), every start of a job no admission let in (a message sent by name, created
running by its claim) and every return of an admitted job to its group's queue into
``<table>_admissions``. With ``retry_after=n`` (``--grouped-retries``) the job asks for a retry
once, after its unit ``n - 1`` (``self.retry(countdown=retry_countdown)``), as a task that met
an HTTP 429 would: the checkpoint committed with that unit says so (``{"next": n, "retry":
true}``), and the retry comes in the attempt that committed it, so at most once.

A job sent with a ``soft_time_limit`` (``--soft-limits``) gets ``SoftTimeLimitExceeded`` wherever
it is when the limit passes: often inside a statement, as the run's slow-statement trigger
(:func:`install_slow_statements`) makes every update of its row take up to
``SLOW_STATEMENT_SECONDS``. The task catches it, logs where it landed (``chaos: soft time limit
in ...``), saves a last checkpoint (at-least-once: the units committed so far; exactly-once has
nothing to add, its checkpoint is in each unit's transaction) and retries from its checkpoint,
with the same limit. The task's own connections are invalidated when anything but a database
error interrupts them (:class:`Guarded`), so a connection reused after an interrupt can only
be the library's: its errors (``REUSE_ERRORS``) in a worker log break an invariant.

``CHAOS_ISOLATION`` (``read_committed``, ``repeatable_read``, or ``mixed``: one or the other
per job, by its id) is the isolation level of the transactions of ``chaos.exactly_once`` and
``chaos.keyed`` (PostgreSQL and MariaDB; ignored on SQLite). A conflict there (a
serialization failure under snapshot isolation: ``WriteConflict``) escapes ``exactly_once``,
so the library sends the job again from its checkpoint; ``keyed`` runs its transaction again
itself (``chaos: write conflict``). At repeatable read each of those transactions pauses a
little (``TX_PAUSE``) between its first statement and its checkpoint, so triggers and
renewals land inside it.

``chaos.keyed(account, count, unit_seconds)`` is a sync of one resource (lease key
``account:<account>``): ``count`` units, each committing its unit row, the key's cursor
``{"units": <units the key's jobs committed>}`` (``self.save_cursor``) and its checkpoint in one
transaction; it returns ``count``. ``chaos.keyed_debounced`` (``lease_debounce=DEBOUNCE``,
accounts ``d<n>``) and ``chaos.keyed_newest`` (``lease_key_strategy="newest"``, accounts
``n<n>``) run the same body with a fourth argument, ``marker``: the id of the trigger that
sent those arguments, saved in every checkpoint (``{"next": n, "marker": id}``), so the
checkpoint log tells which trigger's arguments each run had. The driver's triggers (calls
of these tasks, as a webhook receiver makes them) are recorded in ``<table>_triggers``
(:class:`TriggerLog`), and :func:`install_cursor_log` copies every committed cursor write
into ``<table>_cursors``.

A transient
database error (the server restarting, a dropped connection) retries the task the way a user
would (``autoretry_for``): the lease is handed back and the next attempt resumes from the
stored checkpoint. The engines use ``pool_pre_ping``, so a restarted server costs no error.

The callbacks a chaos job is sent with record each call in ``<table>_callbacks``
(:class:`CallbackLog`):

- ``chaos.on_done(result, job_id)`` (``link``): a leased task that records ``link`` with the
  result in the transaction of its only checkpoint, so each dispatch of it is recorded
  exactly once, whatever happens to its own attempts;
- ``chaos.errback(request, exc, traceback)`` (``link_error``): Celery calls it in the process
  that stores the job's FAILURE; it records ``errback`` with the error.

:func:`install_checkpoint_log` adds a trigger that copies every checkpoint write on the jobs
table into ``<table>_checkpoints`` in the same transaction, so the chaos checks see every
checkpoint ever committed, in commit order; :func:`install_state_log` adds one that copies
every change of a job's state or token (every claim, hand-back, re-publish and end) into
``<table>_states`` (PostgreSQL and SQLite).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
import traceback
import uuid
import zlib
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import sqlalchemy as sa
from celery import Celery, Task
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy.engine import Engine

from celery_leases import LeasedTask, LeaseError, StoreUnavailable, WriteConflict
from celery_leases.db.functions import db_now
from celery_leases.errors import Stop
from chaos.check import ADMITTED, CLAIMED, RELEASED, RETRY_MARK
from chaos.fault import HOLD_DIR_ENV, hold_if_asked
from tests.support.apps.factory import table_of
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.unit_log import ProcessTable, UnitLog

#: Errors of the task's own database writes that a retry from the checkpoint cures.
TRANSIENT = (sa.exc.OperationalError, sa.exc.InterfaceError, StoreUnavailable)
#: The job groups of ``--grouped-jobs``: name -> (``lease_group_limit``, ``lease_group_rate``),
#: each with a task of its own (``GROUPED_TASK``: ``chaos.exactly_once`` with ``lease_group``
#: over its ``group`` argument, and the group's limit and rate).
GROUPS: dict[str, tuple[int | None, str | None]] = {
    "g0": (2, None),
    "g1": (1, "5/s"),
    "g2": (3, "1/s"),
}
GROUPED_TASK = "chaos.grouped_{group}"
GROUP_FORMAT = "{group}"
TASKS = (
    "chaos.exactly_once",
    "chaos.at_least_once",
    *(GROUPED_TASK.format(group=group) for group in GROUPS),
)
#: The keyed task: one run per resource (lease key ``account:<account>``).
KEYED_TASK = "chaos.keyed"
KEY_FORMAT = "account:{account}"
#: The keyed task with ``lease_debounce=DEBOUNCE`` (accounts ``d<n>``), and with
#: ``lease_key_strategy="newest"`` (accounts ``n<n>``): same body, ``marker`` argument.
DEBOUNCED_TASK = "chaos.keyed_debounced"
NEWEST_TASK = "chaos.keyed_newest"
#: (quiet, max_wait) of ``chaos.keyed_debounced``, in seconds.
DEBOUNCE = (0.5, 3.0)
#: Seconds ``chaos.errback`` keeps trying to record its call while the database is down.
ERRBACK_PATIENCE = 30.0
#: The end of the id of a job sent with a soft time limit: its row's updates are slowed.
SOFT_SUFFIX = "-s"
#: Seconds an update of a soft-limited job's row takes at most (the slow-statement trigger).
SLOW_STATEMENT_SECONDS = 0.3
#: ``CHAOS_ISOLATION``: the isolation level of the tasks' transactions.
ISOLATION_ENV = "CHAOS_ISOLATION"
ISOLATIONS = ("read_committed", "repeatable_read", "mixed")
#: Seconds (at most) a repeatable-read transaction pauses before its checkpoint.
TX_PAUSE = 0.15
#: Times ``chaos.keyed`` runs a transaction again after a write conflict before it gives up.
CONFLICT_TRIES = 20
#: What a driver error says when a connection is used again after a statement on it was
#: interrupted (psycopg, PyMySQL/mysqlclient): in a worker log, a connection was reused.
REUSE_ERRORS = (
    r"another command is already in progress",
    r"[Cc]ommands? out of sync",
    r"Packet sequence number wrong",
)

logger = logging.getLogger("chaos")


class ReconnectingUnitLog(UnitLog):
    """The unit log with ``pool_pre_ping``: a connection the server dropped is replaced."""

    pre_ping = True


def chaos_log_for(app: Celery) -> ReconnectingUnitLog:
    """The unit log of ``app`` (table ``<leases_table>_units``, as ``leased_app`` names it)."""
    return table_of(app, ReconnectingUnitLog, "units")


class CallbackLog(ProcessTable):
    """The table ``name`` in the database at ``url``: one row per callback call (``link`` or
    ``errback``) about a job. Times are epoch seconds from the database clock."""

    pre_ping = True

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, callbacks_table(name))

    def add(self, connection: sa.Connection, kind: str, job_id: str, detail: str) -> None:
        """Record one call, in the caller's transaction."""
        values = {"kind": kind, "job_id": job_id, "detail": detail, "pid": os.getpid()}
        connection.execute(sa.insert(self.table).values(values | {"at": db_now()}))

    def rows(self) -> list[tuple[str, str, str]]:
        """Every call as (job id, kind, detail), in insertion order."""
        t = self.table
        stmt = sa.select(t.c.job_id, t.c.kind, t.c.detail).order_by(t.c.id)
        with self.engine.connect() as connection:
            return [(r[0], r[1], r[2]) for r in connection.execute(stmt).all()]


def callbacks_table(name: str) -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(155), nullable=False, index=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("at", sa.Double, nullable=False),
    )


def callback_log_for(app: Celery) -> CallbackLog:
    """The callback log of ``app`` (table ``<leases_table>_callbacks``)."""
    return table_of(app, CallbackLog, "callbacks")


class TriggerLog(ProcessTable):
    """The table ``name`` in the database at ``url``: one row per trigger the driver sent (a
    call of ``chaos.keyed``, as a webhook receiver makes it): the lease key, the task id the call
    gave, the id of the job ``apply_async`` returned (NULL when the call raised), ``at``, the
    database clock read just before the call, and ``answered_at``, the database clock once it
    returned (epoch seconds)."""

    pre_ping = True

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, triggers_table(name))

    def add(
        self, key: str, trigger_id: str, served: str | None, at: float, error: str | None = None
    ) -> None:
        values = {
            "lease_key": key,
            "trigger_id": trigger_id,
            "served_id": served,
            "at": at,
            "answered_at": db_now(),
            "error": error,
        }
        with self.engine.begin() as connection:
            connection.execute(sa.insert(self.table).values(values))

    def rows(self) -> list[tuple[str, str, str | None, float, float, str | None]]:
        """Every trigger as (key, trigger id, served id, at, answered at, error), in order."""
        t = self.table
        stmt = sa.select(
            t.c.lease_key, t.c.trigger_id, t.c.served_id, t.c.at, t.c.answered_at, t.c.error
        ).order_by(t.c.id)
        with self.engine.connect() as connection:
            return [tuple(r) for r in connection.execute(stmt).all()]  # type: ignore[misc]


def triggers_table(name: str) -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("lease_key", sa.String(255), nullable=False, index=True),
        sa.Column("trigger_id", sa.String(155), nullable=False),
        sa.Column("served_id", sa.String(155)),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("answered_at", sa.Double, nullable=False),
        sa.Column("error", sa.Text),
    )


def trigger_log_for(app: Celery) -> TriggerLog:
    """The trigger log of ``app`` (table ``<leases_table>_triggers``)."""
    return table_of(app, TriggerLog, "triggers")


class Guarded:
    """``engine.begin()`` for the tasks' own writes, whose connection is invalidated (closed,
    never pooled again) when anything but a database error or a celery-leases error or stop
    interrupts it (a soft time limit inside a statement leaves it with a command in progress):
    a connection error after an interrupt in a worker log is then the library's."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.connection: sa.Connection | None = None

    def __enter__(self) -> sa.Connection:
        self.connection = self.engine.connect()
        try:
            self.connection.begin()
        except BaseException as exc:
            self._end(exc)
            raise
        return self.connection

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            try:
                assert self.connection is not None
                self.connection.commit()
            except BaseException as commit_exc:
                self._end(commit_exc)
                raise
        self._end(exc)

    def _end(self, exc: BaseException | None) -> None:
        connection, self.connection = self.connection, None
        if connection is None:
            return
        expected = isinstance(exc, sa.exc.SQLAlchemyError | LeaseError | Stop)
        if exc is not None and (not expected or soft_limit_of(exc) is not None):
            with contextlib.suppress(Exception):  # closed already: nothing to reuse
                connection.invalidate()
        with contextlib.suppress(Exception):  # invalidated, or the server is gone
            connection.close()  # rolls back what is left


def soft_limit_of(exc: BaseException) -> SoftTimeLimitExceeded | None:
    """The soft time limit behind ``exc``: itself, or one it was raised while handling (a
    driver's cleanup that failed on the interrupted connection: psycopg's pre-ping restoring
    ``autocommit`` raises ``ProgrammingError`` from it)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        if isinstance(error, SoftTimeLimitExceeded):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def isolation_of(job_id: str, setting: str | None) -> str | None:
    """The isolation level of job ``job_id``'s transactions (None: the database's default)."""
    if setting == "repeatable_read" or (setting == "mixed" and zlib.crc32(job_id.encode()) % 2):
        return "REPEATABLE READ"
    return None


def interrupt_site(tb: TracebackType | None) -> str:
    """Where an exception raised at ``tb`` landed: ``library statement`` (a database call under
    celery-leases' code), ``own statement`` (a database call of the task's own), ``library``
    (celery-leases' code, no statement), or ``task`` (the task's own code, a sleep)."""
    frames = [f.f_code.co_filename for f, _ in traceback.walk_tb(tb)]
    in_driver = any(("/psycopg" in f or "/sqlalchemy/" in f or "/pymysql/" in f) for f in frames)
    in_library = any("/celery_leases/" in f for f in frames)
    if in_driver:
        return "library statement" if in_library else "own statement"
    return "library" if in_library else "task"


def add_chaos_tasks(app: Celery) -> Celery:
    log = chaos_log_for(app)
    callbacks = callback_log_for(app)
    isolation = os.environ.get(ISOLATION_ENV) or None
    sqlite = str(app.conf.get("leases_database_url", "")).startswith("sqlite")
    options: dict[str, Any] = {
        "base": LeasedTask,
        "bind": True,
        "shared": False,
        "autoretry_for": TRANSIENT,
        "retry_backoff": 1,
        "retry_backoff_max": 8,
        "retry_jitter": True,
        "max_retries": None,
    }

    def start(task: Task, unit: int, run: str) -> int:
        """Record (and commit) that ``unit`` starts now (``UnitLog.start``, guarded)."""
        lease = task.lease
        t = log.table
        values = {
            "job_id": lease.job_id,
            "unit": unit,
            "run": run,
            "token": lease.token,
            "attempt": lease.attempt,
            "pid": os.getpid(),
            "host": task.request.hostname or "",
            "started_at": db_now(),
        }
        with Guarded(log.engine) as connection:
            found = connection.execute(sa.insert(t).values(values).returning(t.c.id))
            return int(found.scalar_one())

    def tx_engine(job_id: str) -> tuple[Engine, bool]:
        """The engine of the job's transactions, at its isolation level; and whether they
        pause before their checkpoint (repeatable read)."""
        level = None if sqlite else isolation_of(job_id, isolation)
        if level is None:
            return log.engine, False
        return log.engine.execution_options(isolation_level=level), True

    def pause(paused: bool) -> None:
        if paused:
            time.sleep(random.uniform(0.0, TX_PAUSE))

    def soft_limit(task: Task, caught: Exception, last: dict[str, Any] | None) -> Any:
        """``caught`` is, or was raised from, the soft time limit (else it is raised again):
        log where the limit landed, save ``last`` (a last checkpoint), and retry from the
        checkpoint (the retry keeps the limit)."""
        exc = soft_limit_of(caught)
        if exc is None:
            raise caught
        site = interrupt_site(exc.__traceback__)
        where = "".join(traceback.format_tb(exc.__traceback__, limit=-1)).strip().splitlines()
        logger.warning(
            "chaos: soft time limit in %s, job %s token %s (%s)%s",
            site,
            task.lease.job_id,
            task.lease.token,
            where[0].strip() if where else "?",
            "" if exc is caught else f", raised as {type(caught).__name__}",
        )
        if last is not None:
            task.checkpoint(last)
        raise task.retry(countdown=0.1, max_retries=None, exc=exc)

    hold_dir = os.environ.get(HOLD_DIR_ENV)

    def exactly_once(
        self: Task,
        count: int,
        unit_seconds: float,
        tail_seconds: float = 0.0,
        group: str | None = None,
        retry_after: int | None = None,
        retry_countdown: float = 0.0,
    ) -> int:
        run = uuid.uuid4().hex
        engine, paused = tx_engine(self.lease.job_id)
        try:
            for unit in range((self.lease.checkpoint or {}).get("next", 0), count):
                row = start(self, unit, run)
                time.sleep(unit_seconds)
                # The unit after which the job meets its HTTP 429: committed once, so asked once.
                limited = unit + 1 == retry_after
                with Guarded(engine) as connection:
                    log.end(connection, row)
                    pause(paused)
                    state: dict[str, Any] = {"next": unit + 1}
                    if limited:
                        state[RETRY_MARK] = True
                    self.checkpoint(state, connection=connection)
                    if hold_dir:  # freeze_in_transaction: the row is locked until commit
                        hold_if_asked(hold_dir, self.lease.job_id)
                if limited:
                    logger.warning(
                        "chaos: job %s rate-limited after unit %d (HTTP 429), retry in %g s",
                        self.lease.job_id,
                        unit,
                        retry_countdown,
                    )
                    raise self.retry(countdown=retry_countdown)
                self.stop_point()
            time.sleep(tail_seconds)
        except Exception as exc:
            # Nothing to add: each unit's checkpoint committed with it, or neither did.
            soft_limit(self, exc, None)
        return count

    app.task(name="chaos.exactly_once", **options)(exactly_once)
    for group, (limit, rate) in GROUPS.items():
        app.task(
            name=GROUPED_TASK.format(group=group),
            lease_group=GROUP_FORMAT,
            lease_group_limit=limit,
            lease_group_rate=rate,
            **options,
        )(exactly_once)

    @app.task(name="chaos.at_least_once", **options)  # type: ignore[untyped-decorator]
    def at_least_once(
        self: Task, count: int, unit_seconds: float, tail_seconds: float = 0.0
    ) -> int:
        run = uuid.uuid4().hex
        committed = (self.lease.checkpoint or {}).get("next", 0)
        try:
            for unit in range(committed, count):
                row = start(self, unit, run)
                time.sleep(unit_seconds)
                with Guarded(log.engine) as connection:
                    log.end(connection, row)
                committed = unit + 1
                self.checkpoint({"next": unit + 1})
            time.sleep(tail_seconds)
        except Exception as exc:
            # The units committed so far (the checkpoint of the last may not have been saved).
            soft_limit(self, exc, {"next": committed})
        return count

    def keyed_unit(
        task: Task,
        engine: Engine,
        paused: bool,
        row: int,
        unit: int,
        done: int,
        marker: str | None = None,
    ) -> None:
        """Commit ``unit`` (its row, the key's cursor, the checkpoint) in one transaction; run
        it again when it loses to a concurrent one (``WriteConflict``)."""
        lease = task.lease
        for tries in range(1, CONFLICT_TRIES + 1):
            try:
                with Guarded(engine) as connection:
                    log.end(connection, row)
                    pause(paused)
                    task.save_cursor({"units": done + 1}, connection=connection)
                    if hold_dir:  # freeze_in_transaction: the job's row and the key's locked
                        hold_if_asked(hold_dir, lease.job_id, keyed=True)
                    state: dict[str, Any] = {"next": unit + 1}
                    if marker is not None:  # the trigger whose arguments this run has
                        state["marker"] = marker
                    task.checkpoint(state, connection=connection)
                return
            except WriteConflict as exc:
                if tries == CONFLICT_TRIES:
                    raise
                logger.warning(
                    "chaos: write conflict in job %s unit %d (try %d), run again: %s",
                    lease.job_id,
                    unit,
                    tries,
                    exc,
                )
                time.sleep(random.uniform(0.0, 0.05 * tries))

    def keyed_body(
        self: Task, account: str, count: int, unit_seconds: float, marker: str | None = None
    ) -> int:
        lease = self.lease
        run = uuid.uuid4().hex
        done = int((lease.cursor or {}).get("units", 0))
        engine, paused = tx_engine(lease.job_id)
        for unit in range((lease.checkpoint or {}).get("next", 0), count):
            row = start(self, unit, run)
            time.sleep(unit_seconds)
            keyed_unit(self, engine, paused, row, unit, done, marker)
            done += 1
            self.stop_point()
        return count

    app.task(name=KEYED_TASK, lease_key=KEY_FORMAT, **options)(keyed_body)
    app.task(name=DEBOUNCED_TASK, lease_key=KEY_FORMAT, lease_debounce=DEBOUNCE, **options)(
        keyed_body
    )
    app.task(name=NEWEST_TASK, lease_key=KEY_FORMAT, lease_key_strategy="newest", **options)(
        keyed_body
    )

    @app.task(name="chaos.on_done", **options)  # type: ignore[untyped-decorator]
    def on_done(self: Task, result: Any, job_id: str) -> str:
        if not (self.lease.checkpoint or {}).get("recorded"):
            with callbacks.engine.begin() as connection:
                callbacks.add(connection, "link", job_id, json.dumps(result))
                self.checkpoint({"recorded": True}, connection=connection)
        return job_id

    @app.task(name="chaos.errback", shared=False)  # type: ignore[untyped-decorator]
    def errback(request: Any, exc: BaseException, traceback: Any) -> None:
        detail = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        deadline = time.monotonic() + ERRBACK_PATIENCE
        while True:
            try:
                with callbacks.engine.begin() as connection:
                    callbacks.add(connection, "errback", request.id, detail)
                return
            except TRANSIENT:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    return app


# -- checkpoint log --------------------------------------------------------------------------


def checkpoints_table(jobs_table: str) -> sa.Table:
    return sa.Table(
        f"{jobs_table}_checkpoints",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(155), nullable=False, index=True),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("checkpoint", sa.Text),
        sa.Column("at", sa.Double, nullable=False),
    )


def _trigger_name(jobs_table: str) -> str:
    return f"{jobs_table}_ckpt"


def install_checkpoint_log(engine: Engine, jobs_table: str) -> sa.Table:
    """Create ``<jobs_table>_checkpoints`` and a trigger that fills it on every checkpoint."""
    log = checkpoints_table(jobs_table)
    log.create(engine, checkfirst=True)
    trigger = _trigger_name(jobs_table)
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(
                sa.text(
                    f"CREATE OR REPLACE FUNCTION {trigger}() RETURNS trigger AS $$ BEGIN "
                    f"IF NEW.checkpoint_at IS DISTINCT FROM OLD.checkpoint_at THEN "
                    f"INSERT INTO {log.name} (job_id, token, checkpoint, at) VALUES "
                    f"(NEW.id, NEW.token, NEW.checkpoint, "
                    f"EXTRACT(EPOCH FROM clock_timestamp())); "
                    f"END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger} ON {jobs_table}"))
            connection.execute(
                sa.text(
                    f"CREATE TRIGGER {trigger} AFTER UPDATE ON {jobs_table} "
                    f"FOR EACH ROW EXECUTE FUNCTION {trigger}()"
                )
            )
        elif engine.dialect.name == "sqlite":
            connection.execute(
                sa.text(
                    f"CREATE TRIGGER IF NOT EXISTS {trigger} AFTER UPDATE ON {jobs_table} "
                    f"FOR EACH ROW WHEN NEW.checkpoint_at IS NOT OLD.checkpoint_at BEGIN "
                    f"INSERT INTO {log.name} (job_id, token, checkpoint, at) VALUES "
                    f"(NEW.id, NEW.token, NEW.checkpoint, "
                    f"(julianday('now') - 2440587.5) * 86400.0); END"
                )
            )
        else:
            raise NotImplementedError(f"no checkpoint log on {engine.dialect.name}")
    return log


def remove_checkpoint_log(engine: Engine, jobs_table: str) -> None:
    """Drop the trigger (and its PostgreSQL function); the tables are left to their owner."""
    trigger = _trigger_name(jobs_table)
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(sa.text(f"DROP FUNCTION IF EXISTS {trigger}() CASCADE"))
        elif engine.dialect.name == "sqlite":
            connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger}"))


# -- cursor log ------------------------------------------------------------------------------


def cursors_table(jobs_table: str) -> sa.Table:
    return sa.Table(
        f"{jobs_table}_cursors",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("lease_key", sa.String(255), nullable=False, index=True),
        sa.Column("job_id", sa.String(155)),
        sa.Column("token", sa.BigInteger),
        sa.Column("cursor_state", sa.Text),
        sa.Column("at", sa.Double, nullable=False),
    )


def install_cursor_log(engine: Engine, jobs_table: str) -> sa.Table:
    """Create ``<jobs_table>_cursors`` and triggers on the keys table (``<jobs_table>_keys``)
    that add a row (key, the writer's job and token, the cursor, database time) for every
    cursor write (a write sets ``cursor_at``; the triggers waiting on a key, kept on the same
    row, are not cursor writes), in the writer's transaction: the log holds exactly the
    committed writes, in commit order (PostgreSQL and SQLite)."""
    log = cursors_table(jobs_table)
    log.create(engine, checkfirst=True)
    keys = f"{jobs_table}_keys"
    trigger = f"{jobs_table}_cur"
    values = (
        f"INSERT INTO {log.name} (lease_key, job_id, token, cursor_state, at) VALUES "
        f"(NEW.lease_key, NEW.job_id, NEW.token, NEW.cursor_state, "
    )
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(
                sa.text(
                    f"CREATE OR REPLACE FUNCTION {trigger}() RETURNS trigger AS $$ BEGIN "
                    f"IF (TG_OP = 'INSERT' AND NEW.cursor_at IS NOT NULL) OR (TG_OP = 'UPDATE' "
                    f"AND NEW.cursor_at IS DISTINCT FROM OLD.cursor_at) THEN "
                    f"{values}EXTRACT(EPOCH FROM clock_timestamp())); "
                    f"END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger} ON {keys}"))
            connection.execute(
                sa.text(
                    f"CREATE TRIGGER {trigger} AFTER INSERT OR UPDATE ON {keys} "
                    f"FOR EACH ROW EXECUTE FUNCTION {trigger}()"
                )
            )
        elif engine.dialect.name == "sqlite":
            now = "(julianday('now') - 2440587.5) * 86400.0"
            for event, suffix, when in (
                ("INSERT", "i", "NEW.cursor_at IS NOT NULL"),
                ("UPDATE", "u", "NEW.cursor_at IS NOT OLD.cursor_at"),
            ):
                connection.execute(
                    sa.text(
                        f"CREATE TRIGGER IF NOT EXISTS {trigger}_{suffix} AFTER {event} ON "
                        f"{keys} FOR EACH ROW WHEN {when} BEGIN {values}{now}); END"
                    )
                )
        else:
            raise NotImplementedError(f"no cursor log on {engine.dialect.name}")
    return log


def remove_cursor_log(engine: Engine, jobs_table: str) -> None:
    """Drop the triggers of :func:`install_cursor_log`; the table is left to its owner."""
    _drop_log_triggers(engine, f"{jobs_table}_cur")


def _drop_log_triggers(
    engine: Engine, trigger: str, suffixes: tuple[str, ...] = ("i", "u")
) -> None:
    """Drop a log's triggers named ``trigger`` (PostgreSQL: its function, and with it the
    trigger; SQLite: its triggers ``<trigger>_<suffix>``, by default the insert and update
    triggers ``_i`` and ``_u``)."""
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(sa.text(f"DROP FUNCTION IF EXISTS {trigger}() CASCADE"))
        elif engine.dialect.name == "sqlite":
            for suffix in suffixes:
                connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger}_{suffix}"))


# -- slow statements ---------------------------------------------------------------------------


def install_slow_statements(engine: Engine, jobs_table: str) -> bool:
    """A trigger that makes every update of the row of a job sent with a soft time limit (its
    id ends with ``SOFT_SUFFIX``) take up to ``SLOW_STATEMENT_SECONDS``: its claims, checkpoints,
    ends and hand-backs, so the limit often lands inside one of them. PostgreSQL only (False
    elsewhere: nothing installed)."""
    if engine.dialect.name != "postgresql":
        return False
    trigger = f"{jobs_table}_slow"
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                f"CREATE OR REPLACE FUNCTION {trigger}() RETURNS trigger AS $$ BEGIN "
                f"IF NEW.id LIKE '%{SOFT_SUFFIX}' THEN "
                f"PERFORM pg_sleep(random() * {SLOW_STATEMENT_SECONDS}); "
                f"END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
            )
        )
        connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger} ON {jobs_table}"))
        connection.execute(
            sa.text(
                f"CREATE TRIGGER {trigger} BEFORE UPDATE ON {jobs_table} "
                f"FOR EACH ROW EXECUTE FUNCTION {trigger}()"
            )
        )
    return True


def remove_slow_statements(engine: Engine, jobs_table: str) -> None:
    if engine.dialect.name == "postgresql":
        with engine.begin() as connection:
            connection.execute(sa.text(f"DROP FUNCTION IF EXISTS {jobs_table}_slow() CASCADE"))


# -- state log -------------------------------------------------------------------------------


def states_table(jobs_table: str) -> sa.Table:
    return sa.Table(
        f"{jobs_table}_states",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(155), nullable=False, index=True),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("at", sa.Double, nullable=False),
    )


def install_state_log(engine: Engine, jobs_table: str) -> sa.Table:
    """Create ``<jobs_table>_states`` and triggers that add a row (job, token, state, database
    time in epoch seconds) for every job inserted and every update that changes a job's state
    or token: every claim, hand-back, re-publish and end, in commit order per job."""
    log = states_table(jobs_table)
    log.create(engine, checkfirst=True)
    trigger = f"{jobs_table}_st"
    values = f"INSERT INTO {log.name} (job_id, token, state, at) VALUES (NEW.id, NEW.token, "
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(
                sa.text(
                    f"CREATE OR REPLACE FUNCTION {trigger}() RETURNS trigger AS $$ BEGIN "
                    f"IF TG_OP = 'INSERT' OR NEW.state IS DISTINCT FROM OLD.state "
                    f"OR NEW.token IS DISTINCT FROM OLD.token THEN "
                    f"{values}NEW.state, EXTRACT(EPOCH FROM clock_timestamp())); "
                    f"END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger} ON {jobs_table}"))
            connection.execute(
                sa.text(
                    f"CREATE TRIGGER {trigger} AFTER INSERT OR UPDATE ON {jobs_table} "
                    f"FOR EACH ROW EXECUTE FUNCTION {trigger}()"
                )
            )
        elif engine.dialect.name == "sqlite":
            now = "(julianday('now') - 2440587.5) * 86400.0"
            connection.execute(
                sa.text(
                    f"CREATE TRIGGER IF NOT EXISTS {trigger}_i AFTER INSERT ON {jobs_table} "
                    f"FOR EACH ROW BEGIN {values}NEW.state, {now}); END"
                )
            )
            connection.execute(
                sa.text(
                    f"CREATE TRIGGER IF NOT EXISTS {trigger}_u AFTER UPDATE ON {jobs_table} "
                    f"FOR EACH ROW WHEN NEW.state IS NOT OLD.state OR NEW.token IS NOT OLD.token "
                    f"BEGIN {values}NEW.state, {now}); END"
                )
            )
        else:
            raise NotImplementedError(f"no state log on {engine.dialect.name}")
    return log


def remove_state_log(engine: Engine, jobs_table: str) -> None:
    """Drop the triggers of :func:`install_state_log`; the table is left to its owner."""
    trigger = f"{jobs_table}_st"
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(sa.text(f"DROP FUNCTION IF EXISTS {trigger}() CASCADE"))
        elif engine.dialect.name == "sqlite":
            connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger}_i"))
            connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger}_u"))


def admissions_table(jobs_table: str) -> sa.Table:
    return sa.Table(
        f"{jobs_table}_admissions",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(155), nullable=False, index=True),
        sa.Column("lease_group", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("run_after", sa.Double),
    )


def install_admission_log(engine: Engine, jobs_table: str) -> sa.Table:
    """Create ``<jobs_table>_admissions`` and triggers that add a row (job, group, ``kind``,
    ``at``, ``run_after``) each time a job of a group gets an ``admitted_at`` it did not have:
    ``admitted`` (the job is queued: an admission; ``at`` its ``admitted_at``, ``run_after``
    the not-before time it wrote, its token's time) or ``claimed`` (the job is running: a
    claim created it, a message no client recorded, which runs at once counted in its group);
    and one each time an admitted job that has not ended loses its ``admitted_at``:
    ``released`` (back in its group's queue, ``at`` the database clock), in the writer's
    transaction (PostgreSQL and SQLite)."""
    log = admissions_table(jobs_table)
    log.create(engine, checkfirst=True)
    trigger = f"{jobs_table}_ad"
    columns = f"INSERT INTO {log.name} (job_id, lease_group, kind, at, run_after) VALUES "
    kind = f"CASE WHEN NEW.state = 'running' THEN '{CLAIMED}' ELSE '{ADMITTED}' END"
    admission = f"{columns}(NEW.id, NEW.lease_group, {kind}, NEW.admitted_at, NEW.run_after)"
    admitted = "NEW.lease_group IS NOT NULL AND NEW.admitted_at IS NOT NULL"
    released = (
        "NEW.lease_group IS NOT NULL AND OLD.state IN ('queued', 'running') "
        "AND OLD.admitted_at IS NOT NULL AND NEW.admitted_at IS NULL"
    )

    def release(now: str) -> str:
        return f"{columns}(NEW.id, NEW.lease_group, '{RELEASED}', {now}, NULL)"

    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(
                sa.text(
                    f"CREATE OR REPLACE FUNCTION {trigger}() RETURNS trigger AS $$ BEGIN "
                    f"IF {admitted} AND (TG_OP = 'INSERT' "
                    f"OR NEW.admitted_at IS DISTINCT FROM OLD.admitted_at) THEN {admission}; "
                    f"ELSIF TG_OP = 'UPDATE' AND {released} THEN "
                    f"{release('EXTRACT(EPOCH FROM clock_timestamp())')}; "
                    f"END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {trigger} ON {jobs_table}"))
            connection.execute(
                sa.text(
                    f"CREATE TRIGGER {trigger} AFTER INSERT OR UPDATE ON {jobs_table} "
                    f"FOR EACH ROW EXECUTE FUNCTION {trigger}()"
                )
            )
        elif engine.dialect.name == "sqlite":
            now = "(julianday('now') - 2440587.5) * 86400.0"
            for event, suffix, when, values in (
                ("INSERT", "i", admitted, admission),
                (
                    "UPDATE",
                    "u",
                    f"{admitted} AND NEW.admitted_at IS NOT OLD.admitted_at",
                    admission,
                ),
                ("UPDATE", "r", released, release(now)),
            ):
                connection.execute(
                    sa.text(
                        f"CREATE TRIGGER IF NOT EXISTS {trigger}_{suffix} AFTER {event} ON "
                        f"{jobs_table} FOR EACH ROW WHEN {when} BEGIN {values}; END"
                    )
                )
        else:
            raise NotImplementedError(f"no admission log on {engine.dialect.name}")
    return log


def remove_admission_log(engine: Engine, jobs_table: str) -> None:
    """Drop the triggers of :func:`install_admission_log`; the table is left to its owner."""
    _drop_log_triggers(engine, f"{jobs_table}_ad", ("i", "u", "r"))


def make_app(environ: Mapping[str, str] | None = None, *, name: str = "chaos_app") -> Celery:
    return add_chaos_tasks(make_leased_app(environ, name=name, current=True))


app = make_app(os.environ)
