"""The jobs table and the database clock.

Every time in the table is a float of epoch seconds read from the database clock, so lease
arithmetic never compares a worker's clock with a stored time and keeps sub-second resolution
on every backend.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

SCHEMA_VERSION = 1

#: Job states. ``queued`` and ``running`` are live; the others are finished.
QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
STATES = (QUEUED, RUNNING, DONE, FAILED, CANCELLED)
LIVE_STATES = (QUEUED, RUNNING)
FINISHED_STATES = (DONE, FAILED, CANCELLED)


class db_now(FunctionElement[float]):
    """The database's wall clock as epoch seconds with sub-second resolution."""

    type = sa.Double()
    inherit_cache = True


@compiles(db_now)
def _db_now_default(element: Any, compiler: Any, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) AS DOUBLE PRECISION)"


@compiles(db_now, "postgresql")
def _db_now_postgresql(element: Any, compiler: Any, **kw: Any) -> str:
    # now() is the transaction start; clock_timestamp() is the time the statement runs.
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    # CURRENT_TIMESTAMP has whole seconds on SQLite; julianday('now') has milliseconds.
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _db_now_mysql(element: Any, compiler: Any, **kw: Any) -> str:
    # The store sets the session time zone to UTC, so this is unambiguous around DST.
    return "UNIX_TIMESTAMP(NOW(6))"


def jobs_table(metadata: sa.MetaData, name: str = "celery_leases_jobs") -> sa.Table:
    """Define the jobs table called ``name`` on ``metadata`` (or return the one already there)."""
    if name in metadata.tables:
        return metadata.tables[name]
    text = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.String(155), primary_key=True),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("args", text, nullable=False),
        sa.Column("kwargs", text, nullable=False),
        sa.Column("options", text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(255)),
        sa.Column("token", sa.BigInteger, nullable=False, default=0),
        sa.Column("duration", sa.Double),
        sa.Column("expires_at", sa.Double),
        sa.Column("attempts", sa.Integer, nullable=False, default=0),
        sa.Column("stalled_attempts", sa.Integer, nullable=False, default=0),
        sa.Column("checkpoint", text),
        sa.Column("progress_done", sa.BigInteger),
        sa.Column("progress_total", sa.BigInteger),
        sa.Column("result", text),
        sa.Column("error", text),
        sa.Column("stop_requested", sa.String(16)),
        sa.Column("run_after", sa.Double),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("claimed_at", sa.Double),
        sa.Column("renewed_at", sa.Double),
        sa.Column("checkpoint_at", sa.Double),
        sa.Column("finished_at", sa.Double),
        sa.Column("schema_version", sa.Integer, nullable=False, default=SCHEMA_VERSION),
        sa.Index(f"ix_{name}_expiry", "state", "expires_at"),
        sa.Index(f"ix_{name}_finished", "finished_at"),
    )


#: Metadata holding the jobs table under its default name, for Alembic ``target_metadata``.
metadata = sa.MetaData()
jobs_table(metadata)
