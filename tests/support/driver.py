"""What a store sends its database, seen at the driver: every statement of its direct
connection (``celery_leases/db/dbapi.py``), not what SQLAlchemy's events see."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from celery_leases.db import dbapi
from celery_leases.db.store import Store

#: Transaction control, not a statement of the operation.
CONTROL = ("BEGIN", "COMMIT", "ROLLBACK")


def direct_connection(store: Store) -> Any:
    """The store's one direct DBAPI connection (it must have run an operation, and only one
    at a time)."""
    idle = store.db.direct._idle
    assert len(idle) == 1, "the store has no direct connection yet, or several"
    return idle[0].connection


@contextlib.contextmanager
def traced(store: Store) -> Iterator[list[str]]:
    """Every statement text ``store``'s direct connection sends during the block (on
    PostgreSQL, from the libpq trace: simple-protocol queries by their text, each execution
    of the extended protocol as ``EXECUTE``)."""
    conn, db = direct_connection(store), store.db.dialect.name
    seen: list[str] = []
    if db == "postgresql":
        with tempfile.TemporaryFile("w+") as trace:
            conn.pgconn.trace(os.dup(trace.fileno()))  # libpq keeps a FILE on it
            try:
                yield seen
            finally:
                conn.pgconn.untrace()
                trace.seek(0)
                for line in trace:
                    if "\tF\t" not in line:
                        continue
                    if "\tQuery\t" in line:
                        seen.append(line.split("\tQuery\t", 1)[1].split('"')[1])
                    elif "\tExecute\t" in line:
                        seen.append("EXECUTE")
        return
    if db == "sqlite":
        conn.set_trace_callback(seen.append)
        try:
            yield seen
        finally:
            conn.set_trace_callback(None)
        return
    cls = type(conn)
    original = cls._execute_command

    def spy(self: Any, command: int, sql: Any) -> Any:
        if self is conn:
            seen.append(sql.decode() if isinstance(sql, bytes) else str(sql))
        return original(self, command, sql)

    cls._execute_command = spy
    try:
        yield seen
    finally:
        cls._execute_command = original


def is_control(statement: str) -> bool:
    return statement.strip().upper().startswith(CONTROL)


@contextlib.contextmanager
def sent(store: Store) -> Iterator[list[str]]:
    """The statements ``store`` sends on its direct connection during the block, transaction
    control (BEGIN, COMMIT) left out."""
    with traced(store) as seen:
        statements: list[str] = []
        yield statements
    statements += [s for s in seen if not is_control(s)]


@contextlib.contextmanager
def executed() -> Iterator[list[tuple[Any, Any, dict[str, Any]]]]:
    """(DBAPI connection, compiled statement, parameters) of each statement any store of this
    process runs on a direct connection during the block: what to send again by hand
    (``compiled.parameters(params)`` gives the driver's SQL and parameters)."""
    seen: list[tuple[Any, Any, dict[str, Any]]] = []
    execute = dbapi.Driver.execute

    def spy(self: dbapi.Driver, statement: Any, params: dict[str, Any] | None = None) -> Any:
        result = execute(self, statement, params)
        seen.append((self._dbapi_connection, self._compiled[statement], dict(params or {})))
        return result

    dbapi.Driver.execute = spy  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        dbapi.Driver.execute = execute  # type: ignore[method-assign]
