"""What a store sends its database, seen at the driver: every statement of its direct
connection (``celery_leases/direct.py``), not what SQLAlchemy's events see."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from celery_leases.store import Store

#: Transaction control, not a statement of the operation.
CONTROL = ("BEGIN", "COMMIT", "ROLLBACK")


@contextlib.contextmanager
def sent(store: Store) -> Iterator[list[str]]:
    """The statements ``store`` sends on its direct connection during the block, transaction
    control left out (on PostgreSQL, whose trace has no text for a prepared statement, one
    entry per round trip). The store must have run an operation before (its connection)."""
    idle = store.db.direct._idle
    assert len(idle) == 1, "the store has no direct connection yet, or several"
    connection = idle[0].connection
    seen: list[str] = []
    dialect = store.db.dialect
    if dialect == "postgresql":
        with tempfile.TemporaryFile("w+") as trace:
            connection.pgconn.trace(os.dup(trace.fileno()))  # libpq keeps a FILE on it
            try:
                yield seen
            finally:
                connection.pgconn.untrace()
                trace.seek(0)
                seen += [line for line in trace if "ReadyForQuery" in line]
        return
    if dialect == "sqlite":
        connection.set_trace_callback(seen.append)
        try:
            yield seen
        finally:
            connection.set_trace_callback(None)
            seen[:] = [s for s in seen if not s.strip().upper().startswith(CONTROL)]
        return
    cls: Any = type(connection)
    original = cls._execute_command

    def spy(self: Any, command: int, sql: Any) -> Any:
        if self is connection:
            text = sql.decode() if isinstance(sql, bytes) else str(sql)
            if not text.strip().upper().startswith(CONTROL):
                seen.append(text)
        return original(self, command, sql)

    cls._execute_command = spy
    try:
        yield seen
    finally:
        cls._execute_command = original
