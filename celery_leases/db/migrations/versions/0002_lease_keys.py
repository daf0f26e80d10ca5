"""Revision 0002: lease keys (schema 4). One live job per key, a trigger waiting for a run to
end, and the cursor of each key.

- ``lease_key``: the resource the job works on; a unique index over the keys of the jobs
  that hold theirs: the live ones, and an ended one until it has handed its key to its
  follow-up (PostgreSQL and SQLite: partial; MariaDB, which has none: on a generated
  ``live_key``).
- ``followup`` and ``followup_id``: the first trigger of the key that came while the job ran
  (its whole message), started when the job ends; indexed by id for the reaper's sweep.
- ``<table>_keys``: the cursor of each key, which outlives the key's jobs.
- an index of the jobs whose end the result backend has not been told (``notify``), which
  every reaper pass looks for.

Every new column is nullable with no default: the table is not rewritten, and older workers
of a rolling deploy go on (they ignore the columns).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from celery_leases.db.migrations import add_column_waiting, existing, table_name

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

#: What the view of 0001 shows of the new columns (PostgreSQL).
VIEW_COLUMNS = ("lease_key", "followup_id")
#: A job that holds its key: live, or ended with a follow-up to hand the key to (frozen
#: here: schema.KEY_HELD may change in a later revision, this one never does).
LIVE = "state IN ('queued', 'running') OR followup_id IS NOT NULL"


def columns() -> list[sa.Column[Any]]:
    text = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
    return [
        sa.Column("lease_key", sa.String(255)),
        sa.Column("followup", text),
        sa.Column("followup_id", sa.String(155)),
    ]


def upgrade() -> None:
    name = table_name()
    bind = op.get_bind()
    present = {c["name"] for c in existing().get_columns(name)}
    for column in columns():
        if column.name not in present:
            add_column_waiting(name, column)
    if bind.dialect.name in ("mysql", "mariadb"):
        if "live_key" not in present:
            add_column_waiting(
                name,
                sa.Column(
                    "live_key",
                    sa.String(255),
                    sa.Computed(f"CASE WHEN {LIVE} THEN lease_key END", persisted=True),
                ),
            )
        op.create_index(f"ix_{name}_live_key", name, ["live_key"], unique=True)
    else:
        op.create_index(
            f"ix_{name}_live_key",
            name,
            ["lease_key"],
            unique=True,
            postgresql_where=sa.text(LIVE),
            sqlite_where=sa.text(LIVE),
        )
    op.create_index(f"ix_{name}_followup", name, ["followup_id"])
    # The jobs whose end the backend has not been told, found by each reaper pass: it read
    # the whole table before (33 ms at 200,000 jobs; docs/benchmarks.md section 5).
    op.create_index(
        f"ix_{name}_notify",
        name,
        ["notify"],
        postgresql_where=sa.text("notify IS NOT NULL"),
        sqlite_where=sa.text("notify IS NOT NULL"),
    )
    text = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
    op.create_table(
        f"{name}_keys",
        sa.Column("lease_key", sa.String(255), primary_key=True),
        sa.Column("cursor_state", text),
        sa.Column("job_id", sa.String(155)),
        sa.Column("token", sa.BigInteger),
        sa.Column("cursor_at", sa.Double),
    )
    if bind.dialect.name == "postgresql":
        _extend_view(name, VIEW_COLUMNS)


def downgrade() -> None:
    name = table_name()
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        _extend_view(name, ())  # 0001's view: it must not use a column dropped below
    op.drop_table(f"{name}_keys")
    op.drop_index(f"ix_{name}_notify", table_name=name)
    op.drop_index(f"ix_{name}_followup", table_name=name)
    op.drop_index(f"ix_{name}_live_key", table_name=name)
    dropped = [c.name for c in columns()]
    if bind.dialect.name in ("mysql", "mariadb"):
        dropped.insert(0, "live_key")
    with op.batch_alter_table(name) as batch:  # SQLite rebuilds the table
        for column in dropped:
            batch.drop_column(column)


def _extend_view(name: str, extra: tuple[str, ...]) -> None:
    """Make ``<table>_view`` 0001's view plus the columns ``extra``."""
    from importlib import import_module

    first = import_module("celery_leases.db.migrations.versions.0001_jobs_table")
    shown = []
    for column in first.columns():
        if column.name in first.TIMES:
            shown.append(f"to_timestamp({column.name}) AS {column.name}")
        elif column.name in first.JSON:
            shown.append(f"{name}_jsonb({column.name}) AS {column.name}")
        else:
            shown.append(column.name)
    shown += extra
    # CREATE OR REPLACE may only add columns at the end; dropping them needs a new view.
    op.execute(f"DROP VIEW IF EXISTS {name}_view")
    op.execute(f"CREATE VIEW {name}_view AS SELECT {', '.join(shown)} FROM {name}")
