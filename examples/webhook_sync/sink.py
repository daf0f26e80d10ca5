"""The local copy of the upstream events: the ``synced_events`` table, and all of its SQL.

It lives in the leases database, so a page of events, the account's cursor that says "stored
up to here" and the run's checkpoint commit in one transaction (see ``store_page`` in app.py).
The event id is the primary key: an event stored twice would be an error, not a silent
duplicate.
"""

from __future__ import annotations

import json
import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

_engines: dict[tuple[str, int], Engine] = {}


def engine(url: str) -> Engine:
    """This process's engine for ``url`` (a forked worker child makes its own)."""
    key = (url, os.getpid())
    if key not in _engines:
        options: dict[str, Any] = {"pool_pre_ping": True}
        if url.startswith("sqlite"):
            # Wait for the other writers (the leases keeper, the other worker) instead of failing.
            options["connect_args"] = {"timeout": 30}
        _engines[key] = sa.create_engine(url, **options)
    return _engines[key]


def events_table(name: str = "synced_events") -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account", sa.String(64), nullable=False, index=True),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("created", sa.BigInteger, nullable=False),
        sa.Column("data", sa.Text, nullable=False),
    )


def create(engine: Engine, table: sa.Table) -> None:
    """Create the table if it is missing (two processes may try at once)."""
    try:
        table.create(engine, checkfirst=True)
    except (sa.exc.IntegrityError, sa.exc.ProgrammingError, sa.exc.OperationalError):
        table.create(engine, checkfirst=True)


def reset(engine: Engine, *tables: sa.Table | str) -> None:
    """Drop ``tables`` (tables or names) if they exist."""
    with engine.begin() as connection:
        for table in tables:
            if isinstance(table, str):
                table = sa.Table(table, sa.MetaData())
            table.drop(connection, checkfirst=True)


def insert(
    connection: Connection, table: sa.Table, account: str, events: list[dict[str, Any]]
) -> None:
    """Insert one page of events in the caller's transaction."""
    if events:
        connection.execute(
            table.insert(),
            [
                {
                    "id": e["id"],
                    "account": account,
                    "type": e["type"],
                    "created": e["created"],
                    "data": json.dumps(e["data"], separators=(",", ":")),
                }
                for e in events
            ],
        )


def stored_ids(engine: Engine, table: sa.Table, account: str) -> list[str]:
    """Every stored event id of ``account`` (one per row, so duplicates would show)."""
    with engine.connect() as connection:
        return list(connection.scalars(sa.select(table.c.id).where(table.c.account == account)))


def count(engine: Engine, table: sa.Table, account: str) -> int:
    with engine.connect() as connection:
        query = sa.select(sa.func.count()).select_from(table).where(table.c.account == account)
        return int(connection.scalar(query) or 0)
