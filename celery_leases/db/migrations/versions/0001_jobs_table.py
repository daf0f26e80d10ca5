"""Revision 0001: the jobs table of celery-leases 0.1 (schema 3). On PostgreSQL also a view
of it with ``timestamptz`` times and ``jsonb`` values (docs/benchmarks.md section 7 says why
the table itself keeps epoch seconds and JSON text).

A table that an older celery-leases created at first use (schema 2 or 3, no version table) is
adopted: schema 2 gets the nullable ``session`` column in place, its jobs kept. A schema-1
table (0.1's first form, args and routing only) is refused, naming the columns it lacks.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from celery_leases.db.migrations import add_column_waiting, existing, table_name, where
from celery_leases.errors import ConfigurationError

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

#: Times the view shows as timestamptz (stored: epoch seconds of the database clock).
TIMES = (
    "expires_at", "run_after", "created_at", "claimed_at", "renewed_at", "checkpoint_at",
    "finished_at",
)  # fmt: skip
#: JSON text the view shows as jsonb.
JSON = ("message", "checkpoint", "result")


def columns() -> list[sa.Column[Any]]:
    """The columns of schema 3, as this revision creates them (frozen: later revisions alter
    the table, this list never changes)."""
    text = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
    return [
        sa.Column("id", sa.String(155), primary_key=True),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("version", sa.String(64)),
        sa.Column("message", text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(255)),
        sa.Column("session", sa.BigInteger),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("duration", sa.Double),
        sa.Column("expires_at", sa.Double),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("stalled_attempts", sa.Integer, nullable=False),
        sa.Column("sends", sa.Integer, nullable=False),
        sa.Column("checkpoint", text),
        sa.Column("progress_done", sa.BigInteger),
        sa.Column("progress_total", sa.BigInteger),
        sa.Column("result", text),
        sa.Column("error", text),
        sa.Column("stop_requested", sa.String(16)),
        sa.Column("notify", sa.String(16)),
        sa.Column("run_after", sa.Double),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("claimed_at", sa.Double),
        sa.Column("renewed_at", sa.Double),
        sa.Column("checkpoint_at", sa.Double),
        sa.Column("finished_at", sa.Double),
        sa.Column("schema_version", sa.Integer, nullable=False),
    ]


def upgrade() -> None:
    name = table_name()
    bind = op.get_bind()
    if existing().has_table(name):
        _adopt(bind, name)
    else:
        op.create_table(name, *columns())
        op.create_index(f"ix_{name}_expiry", name, ["state", "expires_at"])
        op.create_index(f"ix_{name}_finished", name, ["finished_at"])
    if bind.dialect.name == "postgresql":
        _create_view(name)


def downgrade() -> None:
    name = table_name()
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP VIEW IF EXISTS {name}_view")
        op.execute(f"DROP FUNCTION IF EXISTS {name}_jsonb(text)")
    op.drop_table(name)


def _adopt(bind: sa.Connection, name: str) -> None:
    """Bring a table made at first use by an older celery-leases to schema 3."""
    present = {c["name"] for c in sa.inspect(bind).get_columns(name)}
    missing = [c for c in columns() if c.name not in present]
    if any(not c.nullable for c in missing):
        raise ConfigurationError(
            f"table {name!r} in {where()} was created by another schema (missing columns: "
            f"{', '.join(c.name for c in missing)}); celery-leases can adopt tables of its "
            f"schema 2 or 3 only: drain it and drop it, or set leases_table to a new name"
        )
    for column in missing:  # schema 2: session
        add_column_waiting(name, column)


def _create_view(name: str) -> None:
    """``<table>_view``: every column, times as timestamptz, JSON as jsonb (NULL for a value
    that is not JSON, so one damaged row never breaks a query over the view)."""
    op.execute(
        f"CREATE OR REPLACE FUNCTION {name}_jsonb(value text) RETURNS jsonb "
        "LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN RETURN value::jsonb; "
        "EXCEPTION WHEN others THEN RETURN NULL; END $$"
    )
    shown = []
    for column in columns():
        if column.name in TIMES:
            shown.append(f"to_timestamp({column.name}) AS {column.name}")
        elif column.name in JSON:
            shown.append(f"{name}_jsonb({column.name}) AS {column.name}")
        else:
            shown.append(column.name)
    op.execute(f"CREATE OR REPLACE VIEW {name}_view AS SELECT {', '.join(shown)} FROM {name}")
