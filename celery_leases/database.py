"""The connection to the leases database: one engine per process, dialect hooks, the one retry.

Driver errors are wrapped here, once: an unreachable or restarting server becomes
:class:`StoreUnavailable`, anything else a :class:`LeaseError`, each ``from`` the driver's error.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .config import redact
from .direct import Connections, Direct
from .errors import ConfigurationError, LeaseError, StoreUnavailable
from .schema import SESSION_LOCK_PREFIX

T = TypeVar("T")
logger = logging.getLogger("celery_leases.database")

#: Dialects without ``UPDATE ... RETURNING``.
NO_RETURNING = ("mysql", "mariadb")
#: Dialects where a one-statement operation runs in autocommit (no BEGIN/COMMIT round trips).
AUTOCOMMIT = ("postgresql", "sqlite")


class Database:
    """An SQLAlchemy engine for this process (a forked child makes its own) and how to run
    operations on it. Safe to share between threads."""

    def __init__(self, url: str, engine_options: dict[str, Any]) -> None:
        self.url = sa.engine.make_url(url)
        self.engine_options = engine_options
        self.dialect = self.url.get_backend_name()
        self.returning = self.dialect not in NO_RETURNING
        self._engine: Engine | None = None
        self._pid = 0
        self._lock = threading.Lock()
        #: PostgreSQL: what sits between this process and the server (a pooler such as
        #: PgBouncer) when the server process that runs this connection's statements is not
        #: the one the connection was opened with; None when it is, or before the first
        #: connection.
        self.pooler: str | None = None
        #: This process's own connections for the one-statement hot path (``direct.py``).
        self.direct = Connections(lambda: self.engine)
        self._safe_url = redact(self.url.render_as_string(hide_password=False))

    @property
    def safe_url(self) -> str:
        """The database URL with its password hidden."""
        return self._safe_url

    @property
    def engine(self) -> Engine:
        """This process's engine."""
        if self._engine is None or self._pid != os.getpid():
            with self._lock:
                if self._engine is None or self._pid != os.getpid():
                    if self._engine is not None:
                        self._engine.dispose(close=False)  # the parent's connections stay its own
                    self._engine = self._create_engine()
                    self._pid = os.getpid()
        return self._engine

    def _create_engine(self) -> Engine:
        # No pre-ping: run() retries once on a connection the server closed, which saves a
        # round trip on every operation (docs/benchmarks.md).
        options: dict[str, Any] = {"pool_pre_ping": False}
        if self.dialect == "sqlite":
            options["connect_args"] = {"timeout": 30}
        options.update(self.engine_options)
        try:
            engine = sa.create_engine(self.url, **options)
        except (sa.exc.ArgumentError, ImportError) as exc:
            raise ConfigurationError(f"cannot use leases database {self.safe_url}: {exc}") from exc
        hook = _ON_CONNECT.get(self.dialect)
        if hook is not None:
            sa.event.listen(engine, "connect", hook)
        if self.dialect == "sqlite":
            sa.event.listen(engine, "begin", _sqlite_begin)
        # Disposing of the engine closes this process's direct connections too.
        sa.event.listen(engine, "engine_disposed", lambda _: self.direct.close())
        if self.dialect == "postgresql":
            self.pooler = None
            sa.event.listen(engine, "first_connect", self._find_pooler)
            sa.event.listen(engine, "connect", self._postgres_on_connect)
        return engine

    def _find_pooler(self, dbapi_connection: Any, record: Any) -> None:
        """Compare the backend pid the server reports running this connection's statements
        with the one the connection was given when it opened (once per process): a pooler
        hands its clients keys of its own, and behind one in transaction mode a session is
        not this process's and a prepared statement may be gone at the next transaction. A
        proxy that forwards the protocol as it is (NAT, a TCP proxy) changes neither."""
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SELECT pg_backend_pid()")
            (running,) = cursor.fetchone()
        finally:
            cursor.close()
            dbapi_connection.rollback()
        self.pooler = _pooler_between(dbapi_connection, running)

    def _postgres_on_connect(self, dbapi_connection: Any, record: Any) -> None:
        if self.pooler is not None and hasattr(dbapi_connection, "prepare_threshold"):
            dbapi_connection.prepare_threshold = None  # psycopg 3: never prepare

    def release_pool(self) -> None:
        """Close the idle connections of SQLAlchemy's pool (not the direct ones): after work
        a worker process does now and then (a reaper pass), so it keeps no second connection
        open at rest."""
        if self._engine is not None and self._pid == os.getpid():
            pool = self._engine.pool
            self._engine.pool = pool.recreate()
            pool.dispose()

    def run(
        self, operation: Callable[[Any], T], *, single: bool = False, direct: bool = False
    ) -> T:
        """Run ``operation`` in one transaction, retrying once on a connection the server had
        closed. ``single``: its outcome rests on one statement, so where the dialect allows it
        runs in autocommit. ``direct``: ``operation`` only executes statements and reads their
        rows (``direct.Direct``), so it runs on this process's direct connection, in
        autocommit if ``single``, else in a transaction."""
        execute = self.direct.run if direct else self._execute
        with self.wrapped_errors():
            try:
                return execute(operation, single=single)
            except sa.exc.DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
            # A connection the server had closed (a restart, an idle timeout): it is gone,
            # so run once more on a fresh connection.
            return execute(operation, single=single)

    def _execute(self, operation: Callable[[Connection], T], *, single: bool) -> T:
        if single and self.dialect in AUTOCOMMIT:
            with self.engine.connect() as connection:
                connection.execution_options(isolation_level="AUTOCOMMIT")
                return operation(connection)
        with self.engine.begin() as connection:
            return operation(connection)

    def session(self) -> Session:
        """A connection of this process's own, kept open for as long as the process lives:
        the session a keeper binds its leases to (``Session``)."""
        return Session(self)

    def wrapped_errors(self, what: str = "") -> _Wrapped:
        """A context manager that turns driver errors into LeaseError / StoreUnavailable."""
        return _Wrapped(self.safe_url, what)


class Session:
    """One connection held open by a keeper, outside the pool's reach, for its renewals.

    While the process lives its session does: the reaper takes a job whose holder's session
    ended (the process died, a host went away) as abandoned at once, instead of waiting for
    the lease to expire. On MariaDB/MySQL the session also holds a named lock, which any user
    can see. Thread safe: the keeper renews on it while attempts read its ``ident``."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._direct: Direct | None = None
        self._ident: int | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._warned = False

    def ident(self) -> int | None:
        """The session's id as the reaper sees it (PostgreSQL backend pid, MariaDB connection
        id, SQLite: the process id), connecting first if needed. None behind a connection
        pooler (``Database.pooler``): there the session is not this process's, so nothing is
        bound to it and leases end at their expiry."""
        if self.db.dialect == "sqlite":
            return os.getpid()
        with self._lock, self.db.wrapped_errors():
            if self.db.pooler is None:
                self._open()
            if self.db.pooler is None:
                return self._ident
            self._close()
            if not self._warned:
                self._warned = True
                logger.warning(
                    "celery-leases: %s sits between this process and PostgreSQL (%s): leases "
                    "are not bound to database sessions, so a dead worker's jobs wait for "
                    "their lease to expire (set leases_bind_session = False to say so)",
                    self.db.pooler,
                    self.db.safe_url,
                )
            return None

    def run(self, operation: Callable[[Any], T]) -> T:
        """Run ``operation`` on the session's connection (``direct.Direct``): in autocommit
        where one statement tells its outcome (PostgreSQL, SQLite), else in a transaction;
        reconnecting once if the server had closed it."""
        with self._lock, self.db.wrapped_errors():
            try:
                return self._execute(operation)
            except sa.exc.DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise  # a lock or statement timeout, say: the session lives on
                self._close()
            return self._execute(operation)

    def _execute(self, operation: Callable[[Any], T]) -> T:
        direct = self._open()
        if self.db.returning:
            return operation(direct)
        direct.begin()
        try:
            result = operation(direct)
            direct.commit()
            return result
        except BaseException:
            direct.rollback()
            raise

    def _open(self) -> Direct:
        if self._direct is not None and self._pid == os.getpid():
            return self._direct
        self._pid = os.getpid()
        direct = self.db.direct.open()
        try:
            if self.db.dialect in ("mysql", "mariadb"):
                self._ident = direct.query(
                    "SELECT CONNECTION_ID(), GET_LOCK(CONCAT(%s, CONNECTION_ID()), 0)",
                    (SESSION_LOCK_PREFIX,),
                )[0][0]
            elif self.db.dialect == "postgresql":
                self._ident = direct.query("SELECT pg_backend_pid()")[0][0]
            else:
                self._ident = os.getpid()
        except BaseException:
            direct.close()
            raise
        self._direct = direct
        if one_task_at_a_time():
            self.db.direct.share(direct, self._lock)
        return direct

    def close(self) -> None:
        """Give the connection up (the session, and the lock, end with it)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            self.db.direct.share(None, self._lock)
            direct.close()  # never back to a pool: its lock must go too


def one_task_at_a_time() -> bool:
    """True in a prefork pool process: it runs one task at a time (so its one lease, if any,
    is the running task's, and ending the process frees one pool slot only)."""
    try:
        from billiard.process import current_process
    except ImportError:
        return False
    return bool(current_process().name.startswith("ForkPoolWorker"))


def local_process_gone(owner: str | None, pid: int | None) -> bool:
    """True if ``owner`` ("node@host/pid") runs on this host and its process ``pid`` is gone
    (a zombie counts as gone): SQLite's stand-in for a session that ended."""
    if not owner or not pid:
        return False
    node = owner.rsplit("/", 1)[0]
    if node.rpartition("@")[2] != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (owned by another user)
        return False
    try:
        return proc_stat(pid)[0] == "Z"
    except OSError:
        return False


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent pid, ...
    (Linux; OSError where there is no such process or no /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()


class _Wrapped:
    def __init__(self, safe_url: str, what: str) -> None:
        self.prefix = f"{what}, " if what else ""
        self.safe_url = safe_url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError | sa.exc.TimeoutError):
            raise StoreUnavailable(
                f"{self.prefix}leases database {self.safe_url} is unavailable: {first_line(exc)}"
            ) from exc
        if isinstance(exc, sa.exc.SQLAlchemyError):
            raise LeaseError(
                f"{self.prefix}leases database {self.safe_url} error: {first_line(exc)}"
            ) from exc


#: PostgreSQL's SQLSTATE for a session its ``idle_in_transaction_session_timeout`` ended, and
#: the server's message for it (all psycopg 3.1 keeps of it).
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
IDLE_IN_TRANSACTION_MESSAGE = "terminating connection due to idle-in-transaction timeout"
#: MySQL/MariaDB client errors of a connection the server closed (MariaDB's
#: ``idle_write_transaction_timeout`` ends the session this way: 2006, 2013; MySQL 8.0.24+: 4031).
SERVER_CLOSED_CONNECTION = (2006, 2013, 4031)


def ended_idle_transaction(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from: SQLAlchemy's, the driver's, Django's)
    is the database ending a transaction that sat idle too long: PostgreSQL's
    idle-in-transaction timeout, or a MySQL/MariaDB connection the server closed (MariaDB's
    idle-write timeout looks no different)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:  # the error and what raised it
        seen.add(id(error))
        # SQLAlchemy's error wraps the driver's; another library's (Django's) is raised from it.
        orig = error.orig if isinstance(error, sa.exc.DBAPIError) else error
        if orig is not None:
            state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
            if state == IDLE_IN_TRANSACTION_TIMEOUT:
                return True
            # psycopg 3.1 reports the server closing the connection without its SQLSTATE.
            if state is None and IDLE_IN_TRANSACTION_MESSAGE in str(orig):
                return True
            code = (getattr(orig, "args", None) or (None,))[0]
            mysql = type(orig).__module__.startswith(("pymysql", "MySQLdb", "mariadb"))
            if mysql and code in SERVER_CLOSED_CONNECTION:
                return True
        error = error.__cause__
    return False


def _pooler_between(dbapi_connection: Any, running: int) -> str | None:
    """What sits between this connection and the server whose process ``running`` runs its
    statements: None when that is the process the connection was opened with (or the driver
    does not say which)."""
    info = getattr(dbapi_connection, "info", None)  # psycopg 3
    opened = getattr(info, "backend_pid", None)
    if opened is None and hasattr(dbapi_connection, "get_backend_pid"):
        opened = dbapi_connection.get_backend_pid()  # psycopg2
    if opened is None or opened == running:
        return None
    return (
        f"a connection pooler (this connection was opened with server process {opened}, "
        f"its statements run in {running})"
    )


def first_line(exc: BaseException) -> str:
    """The first line of a driver error's own message."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return text[0] if text else type(orig).__name__


def _sqlite_on_connect(dbapi_connection: Any, record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(connection: Connection) -> None:
    """An SQLAlchemy transaction on SQLite takes the write lock at once (``BEGIN IMMEDIATE``),
    as the direct path's do. Python's sqlite3 would begin one only at the first write, so the
    reads before it ran outside any transaction: two reaper passes could both take the same
    job's notice (one read the row after the other had cleared it)."""
    if connection.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _mysql_on_connect(dbapi_connection: Any, record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # UTC makes UNIX_TIMESTAMP(NOW(6)) unambiguous around DST; strict mode makes a value the
    # column cannot hold an error instead of a silent truncation.
    cursor.execute("SET time_zone = '+00:00', sql_mode = CONCAT(@@sql_mode, ',STRICT_ALL_TABLES')")
    cursor.close()


_ON_CONNECT = {
    "sqlite": _sqlite_on_connect,
    "mysql": _mysql_on_connect,
    "mariadb": _mysql_on_connect,
}
