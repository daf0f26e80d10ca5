"""Revision 0003: holders, and the triggers of a key kept on the key (schema 5).

- ``<table>_holders``: one row per keeper, which its renewals keep fresh; a running job bound to
  one (``holder``) lasts while it renews: renewals no longer write the jobs' rows.
- ``holder`` (indexed), ``started_at`` (with ``lease_key``, indexed: the runs of a key by
  start), ``served_by``: on the jobs.
- ``pending_id``, ``pending``, ``pending_at`` on ``<table>_keys``: the triggers of a key not
  served yet, which survive any end of the job that held the key.

Every new column is nullable with no default: the table is not rewritten, and older workers of
a rolling deploy go on (they ignore the columns; the jobs newer workers hold have no
``expires_at``, so older reapers leave them alone).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from celery_leases.db.migrations import add_column_waiting, existing, table_name

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

#: What the view shows of the new columns (PostgreSQL), after 0002's.
VIEW_COLUMNS = ("lease_key", "followup_id", "holder", "started_at", "served_by")


def job_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("holder", sa.String(64)),
        sa.Column("started_at", sa.Double),
        sa.Column("served_by", sa.String(155)),
    ]


def key_columns() -> list[sa.Column[Any]]:
    text = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
    return [
        sa.Column("pending_id", sa.String(155)),
        sa.Column("pending", text),
        sa.Column("pending_at", sa.Double),
    ]


def upgrade() -> None:
    name = table_name()
    bind = op.get_bind()
    inspector = existing()
    present = {c["name"] for c in inspector.get_columns(name)}
    for column in job_columns():
        if column.name not in present:
            add_column_waiting(name, column)
    keys = f"{name}_keys"
    present = {c["name"] for c in inspector.get_columns(keys)}
    for column in key_columns():
        if column.name not in present:
            add_column_waiting(keys, column)
    if not inspector.has_table(f"{name}_holders"):
        op.create_table(
            f"{name}_holders",
            sa.Column("id", sa.String(64), primary_key=True),
            sa.Column("owner", sa.String(255), nullable=False),
            sa.Column("session", sa.BigInteger),
            sa.Column("renewed_at", sa.Double, nullable=False),
            sa.Column("expires_at", sa.Double, nullable=False),
            sa.Column("created_at", sa.Double, nullable=False),
            sa.Column("server", sa.Double),
        )
    op.create_index(
        f"ix_{name}_holder",
        name,
        ["holder"],
        postgresql_where=sa.text("holder IS NOT NULL"),
        sqlite_where=sa.text("holder IS NOT NULL"),
    )
    op.create_index(
        f"ix_{name}_key_started",
        name,
        ["lease_key", "started_at"],
        postgresql_where=sa.text("lease_key IS NOT NULL"),
        sqlite_where=sa.text("lease_key IS NOT NULL"),
    )
    op.create_index(
        f"ix_{keys}_pending",
        keys,
        ["pending_at"],
        postgresql_where=sa.text("pending_id IS NOT NULL"),
        sqlite_where=sa.text("pending_id IS NOT NULL"),
    )
    if bind.dialect.name == "postgresql":
        _view(name, VIEW_COLUMNS)


def downgrade() -> None:
    name = table_name()
    bind = op.get_bind()
    keys = f"{name}_keys"
    if bind.dialect.name == "postgresql":
        _view(name, VIEW_COLUMNS[:2])  # 0002's view: it must not use a column dropped below
    op.drop_index(f"ix_{keys}_pending", table_name=keys)
    op.drop_index(f"ix_{name}_key_started", table_name=name)
    op.drop_index(f"ix_{name}_holder", table_name=name)
    op.drop_table(f"{name}_holders")
    with op.batch_alter_table(keys) as batch:  # SQLite rebuilds the table
        for column in key_columns():
            batch.drop_column(column.name)
    with op.batch_alter_table(name) as batch:
        for column in job_columns():
            batch.drop_column(column.name)


def _view(name: str, extra: tuple[str, ...]) -> None:
    from importlib import import_module

    keys = import_module("celery_leases.db.migrations.versions.0002_lease_keys")
    keys._extend_view(name, extra)
