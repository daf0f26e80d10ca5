"""Revision 0005: job groups with a concurrency limit and a rate limit (schema 5).

- ``lease_group`` and ``admitted_at`` on the jobs: the group a job is admitted in, and when it
  was (NULL while it waits in the database for its admission).
- ``ix_<table>_group_waiting`` (``lease_group``, ``state``, ``admitted_at``, ``created_at``;
  partial on PostgreSQL and SQLite): a group's oldest waiting jobs, and its live admitted ones.
- ``<table>_groups``: a row per group, locked by each admission (its limit, rate and token
  bucket).

The new columns are nullable with no default: the table is not rewritten, and older workers
of a rolling deploy go on (a waiting job has no ``expires_at``: older reapers leave it alone).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from celery_leases.db.migrations import add_column_waiting, existing, table_name

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

#: What the view shows of the new columns (PostgreSQL), after 0003's.
VIEW_COLUMNS = ("lease_key", "followup_id", "holder", "started_at", "served_by", "lease_group")


def job_columns() -> list[sa.Column[Any]]:
    return [sa.Column("lease_group", sa.String(255)), sa.Column("admitted_at", sa.Double)]


def upgrade() -> None:
    name = table_name()
    bind = op.get_bind()
    inspector = existing()
    present = {c["name"] for c in inspector.get_columns(name)}
    for column in job_columns():
        if column.name not in present:
            add_column_waiting(name, column)
    if not inspector.has_table(f"{name}_groups"):
        op.create_table(
            f"{name}_groups",
            sa.Column("name", sa.String(255), primary_key=True),
            sa.Column("group_limit", sa.Integer),
            sa.Column("rate", sa.Double),
            sa.Column("tokens", sa.Double, nullable=False),
            sa.Column("refilled_at", sa.Double, nullable=False),
            sa.Column("admitted_at", sa.Double),
            sa.Column("created_at", sa.Double, nullable=False),
        )
    indexes = {index["name"] for index in inspector.get_indexes(name)}
    if f"ix_{name}_group_waiting" not in indexes:
        op.create_index(
            f"ix_{name}_group_waiting",
            name,
            ["lease_group", "state", "admitted_at", "created_at"],
            postgresql_where=sa.text("lease_group IS NOT NULL"),
            sqlite_where=sa.text("lease_group IS NOT NULL"),
        )
    if bind.dialect.name == "postgresql":
        _view(name, VIEW_COLUMNS)


def downgrade() -> None:
    name = table_name()
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        _view(name, VIEW_COLUMNS[:-1])  # 0003's view: it must not use a column dropped below
    op.drop_index(f"ix_{name}_group_waiting", table_name=name)
    op.drop_table(f"{name}_groups")
    with op.batch_alter_table(name) as batch:  # SQLite rebuilds the table
        for column in job_columns():
            batch.drop_column(column.name)


def _view(name: str, extra: tuple[str, ...]) -> None:
    from importlib import import_module

    keys = import_module("celery_leases.db.migrations.versions.0002_lease_keys")
    keys._extend_view(name, extra)
