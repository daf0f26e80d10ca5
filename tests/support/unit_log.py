"""The unit log: one row per unit of work a test task starts, in the leases database.

A row is inserted (and committed) when a unit starts; its ``ended_at`` is set in the same
transaction as the checkpoint that follows the unit (``self.checkpoint(..., connection=...)``),
so a unit counts as *committed* exactly when its checkpoint was saved. A stale attempt whose
checkpoint raises ``LeaseLost`` leaves its row with ``ended_at`` NULL: it ran, but wrote
nothing. Times are epoch seconds from the database clock.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from celery_leases.db.functions import db_now

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self: Python 3.11
from tests.support.service import PGBOUNCER_URL


@dataclass(frozen=True)
class Unit:
    """One started unit. ``run`` identifies one execution of the task body (an attempt);
    ``token`` and ``attempt`` are the lease's (None for a plain Celery task)."""

    job_id: str
    unit: int
    run: str
    token: int | None
    attempt: int | None
    pid: int
    host: str
    started_at: float
    ended_at: float | None

    @property
    def committed(self) -> bool:
        return self.ended_at is not None


def units_table(name: str) -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(155), nullable=False, index=True),
        sa.Column("unit", sa.Integer, nullable=False),
        sa.Column("run", sa.String(32), nullable=False),
        sa.Column("token", sa.BigInteger),
        sa.Column("attempt", sa.Integer),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("started_at", sa.Double, nullable=False),
        sa.Column("ended_at", sa.Double),
    )


class ProcessTable:
    """A table of the test's own in the database at ``url``, reached through one engine per
    process (a forked pool process makes its own; SQLite waits for locks, in WAL mode)."""

    #: Check each pooled connection before use (a table written while the database restarts).
    pre_ping = False

    def __init__(self, url: str, table: sa.Table) -> None:
        self.url = url
        self.table = table
        self._engine: Engine | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        if self._engine is None or self._pid != os.getpid():
            with self._lock:
                if self._engine is None or self._pid != os.getpid():
                    if self._engine is not None:
                        self._engine.dispose(close=False)
                    sqlite = self.url.startswith("sqlite")
                    options: dict[str, Any] = {"pool_pre_ping": self.pre_ping}
                    if sqlite:
                        options["connect_args"] = {"timeout": 30}
                    elif self.url == PGBOUNCER_URL:
                        # Transaction mode: each transaction may run on another server
                        # connection, where psycopg's prepared statements do not exist.
                        options["connect_args"] = {"prepare_threshold": None}
                    self._engine = sa.create_engine(self.url, **options)
                    if sqlite:
                        sa.event.listen(self._engine, "connect", _sqlite_on_connect)
                    self._pid = os.getpid()
        return self._engine

    def create(self) -> Self:
        self.table.create(self.engine, checkfirst=True)
        return self

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


class UnitLog(ProcessTable):
    """The unit log table ``name`` in the database at ``url`` (one engine per process)."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, units_table(name))

    def start(
        self,
        job_id: str,
        unit: int,
        *,
        run: str,
        token: int | None,
        attempt: int | None,
        host: str,
    ) -> int:
        """Record (and commit) that ``unit`` of ``job_id`` starts now; return the row id."""
        t = self.table
        stmt = (
            sa.insert(t)
            .values(
                job_id=job_id,
                unit=unit,
                run=run,
                token=token,
                attempt=attempt,
                pid=os.getpid(),
                host=host,
                started_at=db_now(),
            )
            .returning(t.c.id)
        )
        with self.engine.begin() as connection:
            return int(connection.execute(stmt).scalar_one())

    def end(self, connection: Connection, row_id: int) -> None:
        """Mark the unit ended, in the caller's transaction (the one saving the checkpoint)."""
        t = self.table
        connection.execute(sa.update(t).where(t.c.id == row_id).values(ended_at=db_now()))

    def now(self) -> float:
        """The database clock (epoch seconds), the clock of ``started_at`` and ``ended_at``."""
        with self.engine.connect() as connection:
            return float(connection.execute(sa.select(db_now())).scalar_one())

    def rows(self, job_id: str | None = None) -> list[Unit]:
        """Every started unit (of ``job_id``, or of every job), in start order."""
        t = self.table
        stmt = sa.select(
            t.c.job_id,
            t.c.unit,
            t.c.run,
            t.c.token,
            t.c.attempt,
            t.c.pid,
            t.c.host,
            t.c.started_at,
            t.c.ended_at,
        ).order_by(t.c.started_at, t.c.id)
        if job_id is not None:
            stmt = stmt.where(t.c.job_id == job_id)
        with self.engine.connect() as connection:
            return [Unit(*row) for row in connection.execute(stmt).all()]


def _sqlite_on_connect(dbapi_connection: object, record: object) -> None:
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
