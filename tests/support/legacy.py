"""Tables as a celery-leases older than the migrations made them at first use."""

from __future__ import annotations

import sqlalchemy as sa

from celery_leases.db.schema import jobs_table


def make_schema_3_table(engine: sa.Engine, table: str) -> None:
    """Create ``table`` as schema 3 had it (0.1, before lease keys), with no version table."""
    jobs_table(sa.MetaData(), table).create(engine)
    drop_holders(engine, table)
    drop_lease_keys(engine, table)


def drop_holders(engine: sa.Engine, table: str) -> None:
    """Take what schema 5 added to the jobs table (holders, key starts) off ``table``."""
    mysql = engine.dialect.name in ("mysql", "mariadb")
    on = f" ON {table}" if mysql else ""
    with engine.begin() as connection:
        for index in ("holder", "key_started"):
            connection.execute(sa.text(f"DROP INDEX ix_{table}_{index}{on}"))
        for column in ("holder", "started_at", "served_by"):
            connection.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN {column}"))


def drop_lease_keys(engine: sa.Engine, table: str) -> None:
    """Take what schema 4 added (lease keys) off ``table``: schema 3, its rows kept."""
    mysql = engine.dialect.name in ("mysql", "mariadb")
    on = f" ON {table}" if mysql else ""
    with engine.begin() as connection:
        for index in ("live_key", "followup", "notify"):
            connection.execute(sa.text(f"DROP INDEX ix_{table}_{index}{on}"))
        for column in ("lease_key", "followup", "followup_id"):
            connection.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN {column}"))
