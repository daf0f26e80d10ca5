"""The lease store: every SQL statement of celery-leases lives here.

The store speaks in operations (register, claim, renew, checkpoint, finish, fail, release,
reap, ...). Each worker operation is one conditional statement whose row count or RETURNING
tells the outcome, and every time is computed by the database clock inside the SQL.
MariaDB/MySQL have no ``UPDATE ... RETURNING``: there a claim reads its row back in the same
transaction, and a renew tick that misses rows asks which ones.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from .config import Settings
from .errors import ConfigurationError, CorruptJob, JobNotFound, LeaseError, StoreUnavailable
from .schema import (
    CANCELLED,
    DONE,
    FAILED,
    FINISHED_STATES,
    LIVE_STATES,
    QUEUED,
    RUNNING,
    SCHEMA_VERSION,
    db_now,
    jobs_table,
)

T = TypeVar("T")

GAVE_UP_NO_PROGRESS = (
    "gave up: its last attempts ended (crashed, killed or lost) without saving a checkpoint "
    "(leases_max_attempts_without_progress)"
)
GAVE_UP_MAX_ATTEMPTS = "gave up: reached leases_max_attempts"
GAVE_UP_CORRUPT = "gave up: its stored args, options or checkpoint are not JSON"


@dataclass(frozen=True)
class Claimed:
    """A successful claim: this attempt now holds the lease under ``token``."""

    token: int
    attempt: int
    checkpoint: Any
    checkpoint_age: float | None
    created: bool


@dataclass(frozen=True)
class Refused:
    """A refused claim. ``reason`` is the job's state, or ``held`` when a live lease holds it."""

    reason: str
    owner: str | None
    expires_in: float | None


@dataclass(frozen=True)
class Renewal:
    """Outcome of one renew tick: the jobs still held, and stop requests seen on them."""

    held: frozenset[str]
    stops: dict[str, str]


@dataclass(frozen=True)
class Job:
    """A job as recorded in the leases table. Ages and ``expires_in`` are seconds, DB clock."""

    id: str
    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    state: str
    owner: str | None
    token: int
    attempts: int
    stalled_attempts: int
    checkpoint: Any
    progress_done: int | None
    progress_total: int | None
    result: Any
    error: str | None
    stop_requested: str | None
    expires_in: float | None
    checkpoint_age: float | None
    age: float
    created_at: float
    claimed_at: float | None
    renewed_at: float | None
    checkpoint_at: float | None
    finished_at: float | None


@dataclass(frozen=True)
class Reaped:
    """What one reaper batch did: jobs to re-publish, and jobs given up as failed."""

    republish: list[Job]
    gave_up: list[Job]
    #: The owner each expired lease had before the reaper cleared it.
    previous_owners: dict[str, str | None] = field(default_factory=dict)


def _loads(text: str | None, job_id: str = "?", column: str = "?") -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CorruptJob(
            f"job {job_id}: column {column} holds text that is not JSON ({exc}); "
            f"celery-leases reads JSON only"
        ) from exc


class Store:
    """Operations on the jobs table of one database. Safe to share between threads."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.table = jobs_table(sa.MetaData(), settings.table)
        self._engine: Engine | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._schema_ready = False
        self._url = sa.engine.make_url(settings.database_url)
        self._statements: dict[str, Any] = {}

    @property
    def safe_url(self) -> str:
        """The database URL with its password hidden."""
        return self._url.render_as_string(hide_password=True)

    @property
    def engine(self) -> Engine:
        """This process's engine (a forked child gets its own connections)."""
        if self._engine is None or self._pid != os.getpid():
            with self._lock:
                if self._engine is None or self._pid != os.getpid():
                    if self._engine is not None:
                        self._engine.dispose(close=False)
                    self._engine = self._create_engine()
                    self._pid = os.getpid()
        return self._engine

    @property
    def dialect(self) -> str:
        return self._url.get_backend_name()

    @property
    def _returning(self) -> bool:
        return self.dialect not in ("mysql", "mariadb")

    def _create_engine(self) -> Engine:
        # No pre-ping: _run retries once on a connection the server closed, which saves a
        # round trip on every operation (docs/benchmarks.md).
        options: dict[str, Any] = {"pool_pre_ping": False}
        if self.dialect == "sqlite":
            options["connect_args"] = {"timeout": 30}
        options.update(self.settings.engine_options)
        try:
            engine = sa.create_engine(self._url, **options)
        except (sa.exc.ArgumentError, ImportError) as exc:
            raise ConfigurationError(f"cannot use leases database {self.safe_url}: {exc}") from exc
        if self.dialect == "sqlite":
            sa.event.listen(engine, "connect", _sqlite_on_connect)
        elif self.dialect in ("mysql", "mariadb"):
            sa.event.listen(engine, "connect", _mysql_on_connect)
        return engine

    def _statement(self, key: str, build: Callable[[], Any]) -> Any:
        """The statement ``key`` of the hot path, built once with bind parameters.

        Building an UPDATE and its SQLAlchemy cache key on every call cost more CPU than the
        database spends on it (see docs/benchmarks.md); a statement object built once keeps
        its cache key, and each call only binds values.
        """
        stmt = self._statements.get(key)
        if stmt is None:
            stmt = self._statements[key] = build()
        return stmt

    def _run(
        self, operation: Callable[[Connection], T], *, ensure: bool = True, single: bool = False
    ) -> T:
        """Run ``operation`` in one transaction, wrapping driver errors once.

        ``single``: the operation's outcome rests on one statement, so on PostgreSQL and SQLite
        it runs in autocommit mode: no BEGIN and COMMIT round trips around it.
        """
        try:
            if ensure and not self._schema_ready:
                self.ensure_schema()
            try:
                return self._execute(operation, single=single)
            except sa.exc.DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
            # A pooled connection the server had closed (a restart, an idle timeout): the pool
            # is now invalidated, so run once more on a fresh connection. This replaces a
            # pre-ping round trip on every operation.
            return self._execute(operation, single=single)
        except (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError) as exc:
            raise StoreUnavailable(
                f"leases database {self.safe_url} is unavailable: {_first_line(exc)}"
            ) from exc
        except sa.exc.SQLAlchemyError as exc:
            raise LeaseError(f"leases database {self.safe_url} error: {_first_line(exc)}") from exc

    def _execute(self, operation: Callable[[Connection], T], *, single: bool) -> T:
        if single and self.dialect in ("postgresql", "sqlite"):
            with self.engine.connect() as connection:
                connection.execution_options(isolation_level="AUTOCOMMIT")
                return operation(connection)
        with self.engine.begin() as connection:
            return operation(connection)

    def ensure_schema(self) -> None:
        """Create the jobs table if missing; refuse a table from an older schema."""

        def create(connection: Connection) -> None:
            self.table.create(connection, checkfirst=True)
            present = {c["name"] for c in sa.inspect(connection).get_columns(self.table.name)}
            missing = [c.name for c in self.table.columns if c.name not in present]
            if missing:
                raise ConfigurationError(
                    f"table {self.table.name!r} in {self.safe_url} was created by another "
                    f"schema (missing columns: {', '.join(missing)}); this celery-leases "
                    f"needs schema version {SCHEMA_VERSION}: migrate it with "
                    f"celery_leases.metadata, or set leases_table to a new name"
                )

        try:
            self._run(create, ensure=False)
        except LeaseError as exc:
            if not isinstance(exc.__cause__, sa.exc.IntegrityError | sa.exc.ProgrammingError):
                raise
            # Another process created the table at the same moment: check what it made.
            self._run(create, ensure=False)
        self._schema_ready = True

    # -- writes of the client -------------------------------------------------------------

    def register(
        self,
        job_id: str,
        *,
        task: str,
        args: str,
        kwargs: str,
        options: str,
        countdown: float | None = None,
        queued_timeout: float | None = None,
    ) -> bool:
        """Record a queued job (JSON texts given); False if the id is already recorded."""
        now = db_now()
        run_after = now + countdown if countdown else None
        expires = None
        if queued_timeout is not None:
            expires = now + (countdown or 0.0) + queued_timeout
        values = {
            "id": job_id,
            "task": task,
            "args": args,
            "kwargs": kwargs,
            "options": options,
            "state": QUEUED,
            "token": 0,
            "attempts": 0,
            "stalled_attempts": 0,
            "run_after": run_after,
            "expires_at": expires,
            "created_at": now,
            "schema_version": SCHEMA_VERSION,
        }
        return self._run(lambda c: self._inserted(c, values), single=True)

    def _inserted(self, c: Connection, values: dict[str, Any]) -> bool:
        """Insert unless the id exists; True when inserted."""
        stmt = self._insert_ignore(self.table, values)
        if self._returning:
            # INSERT's rowcount is not reliable on every driver here; RETURNING is.
            return c.execute(stmt.returning(self.table.c.id)).first() is not None
        return bool(c.execute(stmt).rowcount == 1)

    def _insert_ignore(self, t: sa.Table, values: dict[str, Any]) -> Any:
        if self.dialect == "postgresql":
            return postgresql.insert(t).values(values).on_conflict_do_nothing()
        if self.dialect == "sqlite":
            return sqlite.insert(t).values(values).on_conflict_do_nothing()
        if self.dialect in ("mysql", "mariadb"):
            return mysql.insert(t).values(values).prefix_with("IGNORE")
        return sa.insert(t).values(values)

    def give_up(self, job_id: str, *, error: str) -> bool:
        """Fail a live job whatever its lease (its stored values cannot be read)."""
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.id == job_id, t.c.state.in_(LIVE_STATES))
            .values(state=FAILED, owner=None, expires_at=None, error=error, finished_at=db_now())
        )
        return self._run(lambda c: c.execute(stmt).rowcount == 1)

    def forget(self, job_id: str) -> bool:
        """Delete a job registered but never published (its publish failed)."""
        t = self.table
        stmt = sa.delete(t).where(t.c.id == job_id, t.c.state == QUEUED, t.c.token == 0)
        return self._run(lambda c: c.execute(stmt).rowcount == 1)

    # -- writes of a worker: one statement each --------------------------------------------

    def claim(
        self,
        job_id: str,
        *,
        owner: str,
        duration: float,
        task: str,
        args: str,
        kwargs: str,
        options: str = "{}",
    ) -> Claimed | Refused:
        """Take the lease if the job is queued or its lease expired; bump the token."""
        t = self.table
        now = db_now()
        read = [t.c.token, t.c.attempts, t.c.checkpoint, (now - t.c.checkpoint_at)]

        def build() -> Any:
            seconds: Any = sa.bindparam("b_duration", type_=sa.Double())
            state = _unindexed(t.c.state)
            claimable = sa.and_(
                t.c.id == sa.bindparam("b_id"),
                sa.or_(state == QUEUED, sa.and_(state == RUNNING, t.c.expires_at <= now)),
            )
            stmt = (
                sa.update(t)
                .where(claimable)
                .values(
                    token=t.c.token + 1,
                    attempts=t.c.attempts + 1,
                    state=RUNNING,
                    owner=sa.bindparam("b_owner", type_=t.c.owner.type),
                    duration=seconds,
                    expires_at=now + seconds,
                    claimed_at=now,
                    renewed_at=now,
                    # A preemption was for the attempt that saw it; a cancel stands.
                    stop_requested=sa.case(
                        (t.c.stop_requested == "cancel", "cancel"), else_=sa.null()
                    ),
                )
            )
            return stmt.returning(*read) if self._returning else stmt

        stmt = self._statement("claim", build)
        params = {"b_id": job_id, "b_owner": owner, "b_duration": duration}

        def run(c: Connection) -> Claimed | Refused | None:
            if self._returning:
                row = c.execute(stmt, params).first()
            else:
                row = None
                if c.execute(stmt, params).rowcount == 1:
                    row = c.execute(sa.select(*read).where(t.c.id == job_id)).first()
            if row is not None:
                return Claimed(
                    row[0], row[1], _loads(row[2], job_id, "checkpoint"), row[3], created=False
                )
            found = c.execute(
                sa.select(t.c.state, t.c.owner, t.c.expires_at - now).where(t.c.id == job_id)
            ).first()
            if found is not None:
                state, holder, expires_in = found
                return Refused("held" if state == RUNNING else state, holder, expires_in)
            return None

        outcome = self._run(run, single=True)
        if outcome is not None:
            return outcome
        # A message with no row (sent by name from elsewhere): create the job already claimed.
        values = {
            "id": job_id,
            "task": task,
            "args": args,
            "kwargs": kwargs,
            "options": options,
            "state": RUNNING,
            "owner": owner,
            "token": 1,
            "attempts": 1,
            "stalled_attempts": 0,
            "duration": duration,
            "expires_at": now + duration,
            "created_at": now,
            "claimed_at": now,
            "renewed_at": now,
            "schema_version": SCHEMA_VERSION,
        }
        if self._run(lambda c: self._inserted(c, values)):
            return Claimed(1, 1, None, None, created=True)
        return self.claim(
            job_id,
            owner=owner,
            duration=duration,
            task=task,
            args=args,
            kwargs=kwargs,
            options=options,
        )

    def renew(self, leases: Sequence[tuple[str, int]]) -> Renewal:
        """Extend every lease still held under its token, in one statement."""
        if not leases:
            return Renewal(frozenset(), {})
        t = self.table

        def build() -> tuple[Any, Any]:
            now = db_now()
            held_by_token = sa.and_(
                # The plain id list lets every database find the rows by primary key.
                t.c.id.in_(sa.bindparam("b_ids", expanding=True)),
                sa.tuple_(t.c.id, t.c.token).in_(sa.bindparam("b_leases", expanding=True)),
                _unindexed(t.c.state) == RUNNING,
            )
            stmt = (
                sa.update(t)
                .where(held_by_token)
                .values(expires_at=now + t.c.duration, renewed_at=now)
            )
            if self._returning:
                return stmt.returning(t.c.id, t.c.stop_requested), None
            return stmt, sa.select(t.c.id, t.c.stop_requested).where(held_by_token)

        stmt, select = self._statement("renew", build)
        params = {"b_ids": [i for i, _ in leases], "b_leases": [(i, k) for i, k in leases]}

        def run(c: Connection) -> Renewal:
            if select is None:
                rows = c.execute(stmt, params).all()
            else:
                c.execute(stmt, params)
                rows = c.execute(select, params).all()
            return Renewal(
                frozenset(r[0] for r in rows), {r[0]: r[1] for r in rows if r[1] is not None}
            )

        return self._run(run, single=True)

    def checkpoint(
        self,
        job_id: str,
        token: int,
        state: str,
        *,
        progress: tuple[int, int | None] | None = None,
        connection: Connection | None = None,
    ) -> tuple[bool, str | None]:
        """Save a checkpoint (JSON text) and renew, fenced by ``token``.

        Returns (saved, stop request). With ``connection`` the statement joins the caller's
        transaction, so the caller's own writes and the checkpoint commit or roll back together.
        """
        t = self.table

        def build() -> Any:
            now = db_now()
            values: dict[str, Any] = {
                "checkpoint": sa.bindparam("b_checkpoint", type_=t.c.checkpoint.type),
                "checkpoint_at": now,
                "renewed_at": now,
                "expires_at": now + t.c.duration,
            }
            if progress is not None:
                values["progress_done"] = sa.bindparam("b_done", type_=sa.BigInteger())
                values["progress_total"] = sa.bindparam("b_total", type_=sa.BigInteger())
            stmt = (
                sa.update(t)
                .where(
                    t.c.id == sa.bindparam("b_id"),
                    t.c.token == sa.bindparam("b_token"),
                    _unindexed(t.c.state) == RUNNING,
                )
                .values(values)
            )
            return stmt.returning(t.c.stop_requested) if self._returning else stmt

        stmt = self._statement("checkpoint" if progress is None else "checkpoint+progress", build)
        params: dict[str, Any] = {"b_id": job_id, "b_token": token, "b_checkpoint": state}
        if progress is not None:
            params["b_done"], params["b_total"] = progress

        def run(c: Connection) -> tuple[bool, str | None]:
            if self._returning:
                row = c.execute(stmt, params).first()
                return (row is not None, row[0] if row is not None else None)
            # No RETURNING on MariaDB: the stop request reaches the attempt at the keeper's
            # next renew tick instead, to keep the checkpoint one statement.
            return (c.execute(stmt, params).rowcount == 1, None)

        if connection is not None:
            try:
                return run(connection)
            except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
                # As in _run: a dropped connection is StoreUnavailable, so a task can retry.
                raise StoreUnavailable(
                    f"checkpoint failed, leases database {self.safe_url} is unavailable: "
                    f"{_first_line(exc)}"
                ) from exc
            except sa.exc.SQLAlchemyError as exc:
                raise LeaseError(f"checkpoint failed: {_first_line(exc)}") from exc
        return self._run(run, single=True)

    def _end(
        self,
        key: str,
        job_id: str,
        token: int,
        values: Callable[[], dict[str, Any]],
        **params: Any,
    ) -> bool:
        """End the attempt with ``values`` (built once per ``key``), fenced by ``token``."""
        t = self.table

        def build() -> Any:
            return (
                sa.update(t)
                .where(
                    t.c.id == sa.bindparam("b_id"),
                    t.c.token == sa.bindparam("b_token"),
                    _unindexed(t.c.state) == RUNNING,
                )
                .values(values())
            )

        stmt = self._statement(key, build)
        params.update(b_id=job_id, b_token=token)
        return self._run(lambda c: c.execute(stmt, params).rowcount == 1, single=True)

    def finish(self, job_id: str, token: int, *, result: str | None) -> bool:
        """Mark the job done, fenced by ``token``. False if this attempt lost the lease."""
        return self._end(
            "finish",
            job_id,
            token,
            lambda: {
                "state": DONE,
                "owner": None,
                "expires_at": None,
                "result": sa.bindparam("b_result", type_=self.table.c.result.type),
                "stop_requested": None,
                "finished_at": db_now(),
            },
            b_result=result,
        )

    def fail(self, job_id: str, token: int, *, error: str, state: str = FAILED) -> bool:
        """Mark the job failed (or cancelled), keeping its checkpoint; fenced by ``token``."""
        return self._end(
            "fail",
            job_id,
            token,
            lambda: {
                "state": sa.bindparam("b_state", type_=self.table.c.state.type),
                "owner": None,
                "expires_at": None,
                "error": sa.bindparam("b_error", type_=self.table.c.error.type),
                "stop_requested": None,
                "finished_at": db_now(),
            },
            b_state=state,
            b_error=error,
        )

    def release(self, job_id: str, token: int, *, reap_in: float | None) -> bool:
        """Give the lease back, fenced by ``token``.

        ``reap_in`` seconds from now the reaper re-publishes the job; None when a message for
        it is already on its way (a Celery retry).
        """
        # With reap_in None the bound NULL makes expires_at NULL: one statement for both.
        return self._end(
            "release",
            job_id,
            token,
            lambda: {
                "state": QUEUED,
                "owner": None,
                "stop_requested": None,
                "expires_at": db_now() + sa.bindparam("b_reap_in", type_=sa.Double()),
            },
            b_reap_in=reap_in,
        )

    # -- operators and the reaper ----------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        """The job recorded under ``job_id``, or None."""
        rows = self._select(self.table.c.id == job_id, limit=1)
        return rows[0] if rows else None

    def list_jobs(
        self, *, states: Iterable[str] = (), task: str | None = None, limit: int = 50
    ) -> list[Job]:
        """Jobs, newest first, filtered by state and task name."""
        t = self.table
        where: list[sa.ColumnElement[bool]] = []
        if states:
            where.append(t.c.state.in_(list(states)))
        if task:
            where.append(t.c.task == task)
        return self._select(*where, limit=limit, order=t.c.created_at.desc())

    def _select(self, *where: Any, limit: int, order: Any = None) -> list[Job]:
        t = self.table
        now = db_now()
        cols = [c for c in t.columns if c.name not in ("duration", "schema_version")]
        stmt = (
            sa.select(
                *cols,
                (t.c.expires_at - now).label("expires_in"),
                (now - t.c.checkpoint_at).label("checkpoint_age"),
                (now - t.c.created_at).label("age"),
            )
            .where(*where)
            .limit(limit)
        )
        if order is not None:
            stmt = stmt.order_by(order)
        return [_job(row._mapping) for row in self._run(lambda c: c.execute(stmt).all())]

    def request_stop(self, job_ids: Sequence[str], kind: str) -> int:
        """Ask running attempts to stop at their next checkpoint (``cancel`` or ``preempt``)."""
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.id.in_(list(job_ids)), t.c.state == RUNNING)
            .values(stop_requested=kind)
        )
        return self._run(lambda c: c.execute(stmt).rowcount)

    def request_stop_owned_by(self, owner_prefix: str, kind: str) -> int:
        """Ask every running attempt whose owner starts with ``owner_prefix`` to stop."""
        t = self.table
        escaped = owner_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        stmt = (
            sa.update(t)
            .where(t.c.state == RUNNING, t.c.owner.like(escaped + "%", escape="\\"))
            .values(stop_requested=kind)
        )
        return self._run(lambda c: c.execute(stmt).rowcount)

    def cancel_queued(self, job_id: str) -> bool:
        """Cancel a job that no worker holds; its message will be dropped by the claim."""
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.id == job_id, t.c.state == QUEUED)
            .values(
                state=CANCELLED,
                expires_at=None,
                error="cancelled by an operator",
                finished_at=db_now(),
            )
        )
        return self._run(lambda c: c.execute(stmt).rowcount == 1)

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
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.id == job_id, t.c.state.in_(list(from_states)))
            .values(
                state=QUEUED,
                owner=None,
                expires_at=None if queued_timeout is None else db_now() + queued_timeout,
                error=None,
                finished_at=None,
                stalled_attempts=0,
                stop_requested=None,
            )
        )
        if not self._run(lambda c: c.execute(stmt).rowcount == 1):
            job = self.get(job_id)
            if job is None:
                raise JobNotFound(f"no job {job_id!r} in {self.table.name}")
            from .errors import InvalidJobState

            raise InvalidJobState(
                f"job {job_id} is {job.state}; only {' or '.join(from_states)} jobs can be retried"
            )
        job = self.get(job_id)
        assert job is not None
        return job

    def expire(self, job_id: str) -> bool:
        """Expire a running job's lease now, so the next reaper pass re-publishes it."""
        t = self.table
        stmt = (
            sa.update(t).where(t.c.id == job_id, t.c.state == RUNNING).values(expires_at=db_now())
        )
        return self._run(lambda c: c.execute(stmt).rowcount == 1)

    def reap(
        self,
        *,
        batch: int,
        grace: float,
        max_stalled: int | None,
        max_attempts: int | None,
    ) -> Reaped:
        """Mark one batch of expired live jobs: re-publish them, or give up on poison ones.

        Each expired lease is marked by a conditional update that pushes its expiry ``grace``
        seconds forward, so concurrent reapers re-publish it once.
        """
        t = self.table
        now = db_now()
        expired = sa.and_(t.c.state.in_(LIVE_STATES), t.c.expires_at <= now)
        # Read the clock once per statement (an InitPlan on PostgreSQL), so the search on
        # (state, expires_at) is an index range and not a filter.
        candidates = sa.and_(
            t.c.state.in_(LIVE_STATES), t.c.expires_at <= sa.select(db_now()).scalar_subquery()
        )
        no_progress = sa.and_(
            t.c.state == RUNNING,
            sa.or_(t.c.checkpoint_at.is_(None), t.c.checkpoint_at < t.c.claimed_at),
        )
        give_up_when = []
        stalled_out: Any = sa.false()
        if max_stalled is not None:
            stalled_out = sa.and_(no_progress, t.c.stalled_attempts + 1 >= max_stalled)
            give_up_when.append(stalled_out)
        if max_attempts is not None:
            give_up_when.append(t.c.attempts >= max_attempts)

        def run(c: Connection) -> Reaped:
            found = {
                r[0]: r[1]
                for r in c.execute(
                    sa.select(t.c.id, t.c.owner)
                    .where(candidates)
                    .order_by(t.c.expires_at)
                    .limit(batch)
                    .with_for_update(skip_locked=True)
                ).all()
            }
            ids = list(found)
            if not ids:
                return Reaped([], [])
            gave_up: list[str] = []
            if give_up_when:
                poison = sa.and_(t.c.id.in_(ids), expired, sa.or_(*give_up_when))
                gave_up = [r[0] for r in c.execute(sa.select(t.c.id).where(poison)).all()]
                if gave_up:
                    reason = sa.case(
                        (stalled_out, sa.literal(GAVE_UP_NO_PROGRESS)),
                        else_=sa.literal(GAVE_UP_MAX_ATTEMPTS),
                    )
                    # MySQL evaluates SET left to right: read the old state before changing it.
                    c.execute(
                        sa.update(t)
                        .where(t.c.id.in_(gave_up), expired)
                        .ordered_values(
                            (t.c.error, reason),
                            (
                                t.c.stalled_attempts,
                                t.c.stalled_attempts + sa.case((no_progress, 1), else_=0),
                            ),
                            (t.c.state, FAILED),
                            (t.c.owner, None),
                            (t.c.expires_at, None),
                            (t.c.finished_at, now),
                        )
                    )
            live = [i for i in ids if i not in set(gave_up)]
            marked: list[str] = []
            if live:
                stmt = (
                    sa.update(t)
                    .where(t.c.id.in_(live), expired)
                    .ordered_values(
                        (
                            t.c.stalled_attempts,
                            sa.case(
                                (no_progress, t.c.stalled_attempts + 1),
                                (t.c.state == RUNNING, 0),
                                else_=t.c.stalled_attempts,
                            ),
                        ),
                        (t.c.state, QUEUED),
                        (t.c.owner, None),
                        (t.c.expires_at, now + grace),
                    )
                )
                if self._returning:
                    marked = [r[0] for r in c.execute(stmt.returning(t.c.id)).all()]
                else:
                    c.execute(stmt)
                    marked = live  # the select above locked these rows for this transaction
            republish, corrupt = self._parse_jobs(c, marked)
            if corrupt:
                c.execute(
                    sa.update(t)
                    .where(t.c.id.in_(list(corrupt)))
                    .values(
                        state=FAILED,
                        owner=None,
                        expires_at=None,
                        finished_at=now,
                        error=GAVE_UP_CORRUPT,
                    )
                )
            failed, _ = self._parse_jobs(c, gave_up + list(corrupt))
            return Reaped(republish, failed, found)

        return self._run(run)

    def _parse_jobs(self, c: Connection, ids: list[str]) -> tuple[list[Job], dict[str, str]]:
        """The jobs ``ids``, and the ids whose stored values are not JSON (with the error)."""
        try:
            return self._jobs(c, ids), {}
        except CorruptJob:
            pass  # find which rows, one by one
        jobs: list[Job] = []
        corrupt: dict[str, str] = {}
        for job_id in ids:
            try:
                jobs.extend(self._jobs(c, [job_id]))
            except CorruptJob as exc:
                corrupt[job_id] = str(exc)
        if corrupt:
            jobs = [job for job in jobs if job.id not in corrupt]
        return jobs, corrupt

    def _jobs(self, c: Connection, ids: list[str]) -> list[Job]:
        if not ids:
            return []
        t = self.table
        now = db_now()
        cols = [col for col in t.columns if col.name not in ("duration", "schema_version")]
        stmt = sa.select(
            *cols,
            (t.c.expires_at - now).label("expires_in"),
            (now - t.c.checkpoint_at).label("checkpoint_age"),
            (now - t.c.created_at).label("age"),
        ).where(t.c.id.in_(ids))
        return [_job(row._mapping) for row in c.execute(stmt).all()]

    def purge(self, *, older_than: float, batch: int) -> int:
        """Delete up to ``batch`` jobs finished more than ``older_than`` seconds ago."""
        t = self.table
        cutoff = sa.select(db_now() - older_than).scalar_subquery()
        old = sa.and_(t.c.state.in_(FINISHED_STATES), t.c.finished_at <= cutoff)

        def run(c: Connection) -> int:
            # Oldest first: the order makes the planner walk the finished_at index, where a bare
            # LIMIT seq-scans the whole table when nothing is old enough (every idle pass).
            oldest = sa.select(t.c.id).where(old).order_by(t.c.finished_at).limit(batch)
            ids = [r[0] for r in c.execute(oldest).all()]
            if not ids:
                return 0
            return c.execute(sa.delete(t).where(t.c.id.in_(ids), old)).rowcount

        return self._run(run)

    def now(self) -> float:
        """The database clock, in epoch seconds."""
        return float(self._run(lambda c: c.execute(sa.select(db_now())).scalar_one()))

    def ids_starting_with(self, prefix: str, *, limit: int) -> list[str]:
        """Ids of up to ``limit`` jobs whose id starts with ``prefix`` (case-sensitive)."""
        t = self.table
        stmt = (
            sa.select(t.c.id)
            .where(t.c.id.startswith(prefix, autoescape=True))
            .order_by(t.c.id)
            .limit(limit)
        )
        # LIKE ignores case on SQLite and MySQL's default collations.
        ids = self._run(lambda c: c.execute(stmt).scalars().all())
        return [i for i in ids if i.startswith(prefix)]

    def count_by_state(self) -> dict[str, int]:
        """How many jobs the table holds in each state."""
        t = self.table
        stmt = sa.select(t.c.state, sa.func.count()).group_by(t.c.state)
        return {state: count for state, count in self._run(lambda c: c.execute(stmt).all())}


def _unindexed(column: Any) -> Any:
    """``column`` in a form no index serves, for a row found by primary key.

    Statistics taken while few jobs ran (a burst after a quiet spell) make PostgreSQL prefer
    the (state, expires_at) index for ``state = 'running'`` and walk every running job on
    each write; SQLite does so without statistics. See docs/benchmarks.md.
    """
    return sa.func.coalesce(column, "")


def _job(m: Any) -> Job:
    job_id = m["id"]
    return Job(
        id=m["id"],
        task=m["task"],
        args=_loads(m["args"], job_id, "args") or [],
        kwargs=_loads(m["kwargs"], job_id, "kwargs") or {},
        options=_loads(m["options"], job_id, "options") or {},
        state=m["state"],
        owner=m["owner"],
        token=m["token"],
        attempts=m["attempts"],
        stalled_attempts=m["stalled_attempts"],
        checkpoint=_loads(m["checkpoint"], job_id, "checkpoint"),
        progress_done=m["progress_done"],
        progress_total=m["progress_total"],
        result=_loads(m["result"], job_id, "result"),
        error=m["error"],
        stop_requested=m["stop_requested"],
        expires_in=m["expires_in"],
        checkpoint_age=m["checkpoint_age"],
        age=m["age"],
        created_at=m["created_at"],
        claimed_at=m["claimed_at"],
        renewed_at=m["renewed_at"],
        checkpoint_at=m["checkpoint_at"],
        finished_at=m["finished_at"],
    )


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return text[0] if text else type(orig).__name__


def _sqlite_on_connect(dbapi_connection: Any, record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _mysql_on_connect(dbapi_connection: Any, record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("SET time_zone = '+00:00'")
    cursor.close()


_stores: dict[tuple[str, str, str], Store] = {}
_stores_lock = threading.Lock()


def store_for(settings: Settings) -> Store:
    """The shared Store of these settings (one engine per process and database)."""
    key = (
        settings.database_url,
        settings.table,
        json.dumps(settings.engine_options, sort_keys=True, default=repr),
    )
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = Store(settings)
        return store
