"""Revision 0006: when the triggers waiting on a key began, and which runs started after them
by count, not by clock (schema 6).

- ``pending_since`` on ``<table>_keys``: when the first of the triggers waiting on a key came
  (``pending_at`` is the latest's). A debounced key's follow-up is due ``quiet`` seconds after
  the latest, and never later than ``max_wait`` after the first.
- ``triggers`` on ``<table>_keys``: how many triggers ever waited on the key; ``started_seq``
  on the jobs: that count as a job's first claim read it. A run serves the triggers it started
  after, told by these numbers: a database clock stepped back between a run's start and a
  trigger cannot make a run that started before a trigger serve it.

The new columns are nullable with no default: the table is not rewritten, and older workers of
a rolling deploy go on (they ignore them; a run they claim has no ``started_seq``, and its
start is told by ``started_at`` as before).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from celery_leases.db.migrations import add_column_waiting, existing, table_name

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def key_columns() -> list[sa.Column[Any]]:
    return [sa.Column("pending_since", sa.Double), sa.Column("triggers", sa.BigInteger)]


def job_columns() -> list[sa.Column[Any]]:
    return [sa.Column("started_seq", sa.BigInteger)]


def upgrade() -> None:
    name = table_name()
    inspector = existing()
    for table, columns in ((f"{name}_keys", key_columns()), (name, job_columns())):
        present = {c["name"] for c in inspector.get_columns(table)}
        for column in columns:
            if column.name not in present:
                add_column_waiting(table, column)


def downgrade() -> None:
    name = table_name()
    for table, columns in ((f"{name}_keys", key_columns()), (name, job_columns())):
        with op.batch_alter_table(table) as batch:  # SQLite rebuilds the table
            for column in columns:
                batch.drop_column(column.name)
