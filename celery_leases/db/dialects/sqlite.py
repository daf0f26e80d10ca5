"""SQLite: a file on this machine, one writer at a time (``BEGIN IMMEDIATE``), no row locks,
no sessions: a lease is bound to its holder's process, which the reaper checks itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.ext.compiler import compiles

from ...process import local_process_gone
from ..clock import db_now
from .base import Dialect, insert_unless_id_exists, upsert_on_conflict


@compiles(db_now, "sqlite")
def _db_now(element: Any, compiler: Any, **kw: Any) -> str:
    # CURRENT_TIMESTAMP has whole seconds on SQLite; julianday('now') has milliseconds.
    return "((julianday('now') - 2440587.5) * 86400.0)"


def _on_connect(dbapi_connection: Any, record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _begin(connection: sa.Connection) -> None:
    """An SQLAlchemy transaction takes the write lock at once (``BEGIN IMMEDIATE``), as the
    direct path's do. Python's sqlite3 would begin one only at the first write, so the reads
    before it ran outside any transaction: two reaper passes could both take the same job's
    notice (one read the row after the other had cleared it)."""
    if connection.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
        connection.exec_driver_sql("BEGIN IMMEDIATE")


class SQLite(Dialect):
    names: ClassVar[tuple[str, ...]] = ("sqlite",)
    file_based: ClassVar[bool] = True
    # A transaction that reads, then writes, would otherwise fail (database is locked) when
    # another did the same meanwhile.
    begin_sql: ClassVar[str] = "BEGIN IMMEDIATE"

    # -- connecting --------------------------------------------------------------------------

    def engine_options(self) -> dict[str, Any]:
        return {"connect_args": {"timeout": 30}}

    def prepare_engine(self, engine: sa.engine.Engine, database: Any) -> None:
        sa.event.listen(engine, "connect", _on_connect)
        sa.event.listen(engine, "begin", _begin)

    def set_autocommit(self, dbapi_connection: Any, on: bool) -> None:
        dbapi_connection.isolation_level = None if on else ""

    # -- sessions: the holder's process ------------------------------------------------------

    def connectionless_ident(self) -> int | None:
        return os.getpid()

    def session_ident(self, driver: Any) -> int:
        return os.getpid()

    def holder_session(self, pid: Any) -> Any:
        return pid

    def holder_gone(self, owner: str | None, session: int | None) -> bool:
        return local_process_gone(owner, session)

    # -- statement forms ---------------------------------------------------------------------

    def update_unlocked(self, table: sa.Table, ids: sa.Select[Any]) -> sa.Update:
        # No row locks: the writer holds the database's lock.
        where: Any = ids.whereclause
        return sa.update(table).where(where)

    def insert_unless_exists(self, table: sa.Table, values: dict[str, Any]) -> Any:
        return insert_unless_id_exists(sqlite.insert, table, values)

    def upsert(self, table: sa.Table, select: Any, columns: list[str], key: str) -> Any:
        return upsert_on_conflict(sqlite.insert, table, select, columns, key)

    # -- migrations --------------------------------------------------------------------------

    @contextlib.contextmanager
    def migration_lock(self, connection: sa.Connection, table: str) -> Iterator[None]:
        # The engine begins each transaction with BEGIN IMMEDIATE (pysqlite would open none
        # for DDL): take the write lock first, so a second process waits here (busy timeout)
        # and then finds the table migrated.
        connection.exec_driver_sql("SELECT 1")
        yield


__all__ = ["SQLite"]
