"""SQLite: a file on this machine, one writer at a time (``BEGIN IMMEDIATE``), no row locks,
no sessions. A holder marks itself alive with a lock file beside the database
(``<database>.holders/<holder>.lock``, held with ``flock`` for as long as its process lives): the
reaper takes a holder for gone only when it can take that lock itself, which it can from any
process of the machine, in any PID namespace (two containers sharing the volume), and which a
new process reusing a dead one's pid cannot hold.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.ext.compiler import compiles

from ..functions import db_now, greatest, least
from .base import Dialect, insert_unless_id_exists, upsert_on_conflict


@compiles(db_now, "sqlite")
def _db_now(element: Any, compiler: Any, **kw: Any) -> str:
    # CURRENT_TIMESTAMP has whole seconds on SQLite; julianday('now') has milliseconds.
    return "((julianday('now') - 2440587.5) * 86400.0)"


#: This process's marks (holder -> the descriptor holding its lock file).
_marks: dict[str, int] = {}
_marks_lock = threading.Lock()


def _forget_inherited_marks() -> None:
    """A forked child holds its parent's lock files' descriptors: close them (the parent's
    locks stay the parent's), so a dead parent's mark is free once it is gone."""
    for fd in _marks.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _marks.clear()


os.register_at_fork(after_in_child=_forget_inherited_marks)


@compiles(greatest, "sqlite")
def _greatest(element: Any, compiler: Any, **kw: Any) -> str:
    return f"max({compiler.process(element.clauses, **kw)})"


@compiles(least, "sqlite")
def _least(element: Any, compiler: Any, **kw: Any) -> str:
    return f"min({compiler.process(element.clauses, **kw)})"


#: Seconds a connection waits for a lock another holds (``busy_timeout``).
BUSY_TIMEOUT = 30.0


def _on_connect(dbapi_connection: Any, record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT * 1000)}")
    _wal(cursor)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _wal(cursor: Any) -> None:
    """Put the file in WAL mode (it stays so: later connections find it there). Switching
    needs the file to itself and SQLite answers "database is locked" at once, without its busy
    wait, when another connection holds it: processes starting together on a new file (a
    worker and beat) wait their turn here instead of failing."""
    deadline = time.monotonic() + BUSY_TIMEOUT
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


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

    def id_prefix(self, column: Any, pattern: Any) -> Any:
        # LIKE ignores case here, so its prefix cannot use the primary key's index (of the
        # BINARY collation); GLOB is case-sensitive and can.
        return column.op("GLOB")(pattern)

    def prefix_pattern(self, prefix: str) -> str:
        special = {"*": "[*]", "?": "[?]", "[": "[[]"}
        return "".join(special.get(char, char) for char in prefix) + "*"

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

    def mark_alive(self, holder: str) -> None:
        folder = self._holders_folder()
        if folder is None:
            return
        folder.mkdir(exist_ok=True)
        fd = os.open(folder / f"{holder}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file of its own: never taken
        with _marks_lock:
            _marks[holder] = fd

    def forget_alive(self, holder: str) -> None:
        with _marks_lock:
            fd = _marks.pop(holder, None)
        folder = self._holders_folder()
        if fd is None or folder is None:
            return
        with contextlib.suppress(OSError):
            (folder / f"{holder}.lock").unlink()
        os.close(fd)

    def holder_gone(self, holder: str) -> bool:
        folder = self._holders_folder()
        if folder is None or holder in _marks:
            return False
        path = folder / f"{holder}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False  # no mark: it cannot tell
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its process holds it: alive
        else:
            with contextlib.suppress(OSError):
                path.unlink()  # gone: its mark goes with it
            return True
        finally:
            os.close(fd)

    def _holders_folder(self) -> Path | None:
        """``<database>.holders`` beside the database file (None for one in memory)."""
        database = self.url.database if self.url is not None else None
        if not database or database == ":memory:" or database.startswith("file:"):
            return None
        return Path(os.path.abspath(database) + ".holders")

    # -- statement forms ---------------------------------------------------------------------

    def arrival_order(self, table: sa.Table) -> tuple[Any, ...]:
        # julianday('now') ticks in milliseconds: a loop of .delay() records several jobs in
        # one tick, and their random ids would order them at random. SQLite inserts one at
        # a time and gives each new row a rowid above every other, and every index of the
        # table ends with the rowid, so ordering by it adds no sort. (The statement reads
        # this one table: the bare name "rowid" is its rowid.)
        return (table.c.created_at, sa.literal_column("rowid"))

    def insert_unless_exists(self, table: sa.Table, values: dict[str, Any]) -> Any:
        return insert_unless_id_exists(sqlite.insert, table, values)

    def upsert(
        self,
        table: sa.Table,
        select: Any,
        columns: list[str],
        key: str,
        *,
        update: Callable[[Any], dict[str, Any]] | None = None,
        returning: tuple[Any, ...] = (),
    ) -> Any:
        return upsert_on_conflict(
            sqlite.insert, table, select, columns, key, update=update, returning=returning
        )

    # -- errors ------------------------------------------------------------------------------

    def error_kind(self, orig: Any) -> str | None:
        if not isinstance(orig, sqlite3.Error):
            return None
        text = str(orig)
        if "database is locked" in text or "database table is locked" in text:
            return "conflict"  # the busy timeout ran out behind another writer
        if isinstance(orig, sqlite3.IntegrityError) or "too big" in text:
            return "refused"
        return None

    def waited_out(self, orig: Any) -> bool:
        return self.error_kind(orig) == "conflict"  # the busy timeout ran out

    # -- migrations --------------------------------------------------------------------------

    @contextlib.contextmanager
    def migration_lock(self, connection: sa.Connection, table: str) -> Iterator[None]:
        # The engine begins each transaction with BEGIN IMMEDIATE (pysqlite would open none
        # for DDL): take the write lock first, so a second process waits here (busy timeout)
        # and then finds the table migrated.
        connection.exec_driver_sql("SELECT 1")
        yield


__all__ = ["SQLite"]
