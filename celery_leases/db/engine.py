"""The connection to the leases database: one engine per process, and the one retry.

Driver errors are wrapped at this boundary, once (``errors.Wrapped``, which classifies them by
kind): an unreachable or restarting server becomes :class:`StoreUnavailable`, a conflict
:class:`WriteConflict`, a value the database refuses the caller's error, anything else a
:class:`LeaseError`; a connection interrupted mid-statement is closed (``errors.interrupted``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..errors import ConfigurationError, LeaseError
from ..settings import redact
from .dbapi import Connections
from .dialects import Dialect, dialect_for
from .errors import Wrapped, cancel_statement, interrupted, rerun
from .session import Session

T = TypeVar("T")


class Database:
    """An SQLAlchemy engine for this process (a forked child makes its own) and how to run
    operations on it. Safe to share between threads."""

    def __init__(self, url: str, engine_options: dict[str, Any]) -> None:
        self.url = sa.engine.make_url(url)
        self.engine_options = engine_options
        self._engine: Engine | None = None
        self._pid = 0
        self._lock = threading.Lock()
        #: PostgreSQL: what sits between this process and the server (a pooler such as
        #: PgBouncer) when the server process that runs this connection's statements is not
        #: the one the connection was opened with; None when it is, or before the first
        #: connection.
        self.pooler: str | None = None
        self._safe_url = redact(self.url.render_as_string(hide_password=False))

    @functools.cached_property
    def dialect(self) -> Dialect:
        """The database family (``db/dialects``): everything that differs between databases.
        :class:`ConfigurationError` for one celery-leases does not support (at first use)."""
        try:
            dialect = dialect_for(self.url.get_backend_name())
        except ValueError as exc:
            raise ConfigurationError(f"cannot use leases database {self.safe_url}: {exc}") from None
        dialect.url = self.url
        return dialect

    @functools.cached_property
    def direct(self) -> Connections:
        """This process's own connections for the one-statement fast path (``dbapi.py``)."""
        return Connections(lambda: self.engine, self.dialect)

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
        options: dict[str, Any] = {"pool_pre_ping": False, **self.dialect.engine_options()}
        # The user's options win; their connect_args key by key, over the dialect's.
        connect_args = {**options.get("connect_args", {})}
        connect_args.update(self.engine_options.get("connect_args") or {})
        options.update(self.engine_options)
        if connect_args:
            options["connect_args"] = connect_args
        try:
            engine = sa.create_engine(self.url, **options)
        except (sa.exc.ArgumentError, ImportError) as exc:
            raise ConfigurationError(f"cannot use leases database {self.safe_url}: {exc}") from exc
        self.dialect.prepare_engine(engine, self)
        # Disposing of the engine closes this process's direct connections too.
        sa.event.listen(engine, "engine_disposed", lambda _: self.direct.close())
        return engine

    def release_pool(self) -> None:
        """Close the idle connections of SQLAlchemy's pool (not the direct ones): after work
        a worker process does now and then (a reaper pass), so it keeps no second connection
        open at rest."""
        if self._engine is not None and self._pid == os.getpid():
            pool = self._engine.pool
            self._engine.pool = pool.recreate()
            pool.dispose()

    def close(self) -> None:
        """Close this process's connections that are idle now: the pool's and the direct ones
        (a connection in use closes when it is given back). The next operation connects
        again. A forked child leaves its parent's connections alone."""
        if self._engine is not None and self._pid == os.getpid():
            self._engine.dispose()

    def run(
        self,
        operation: Callable[[Any], T],
        *,
        single: bool = False,
        direct: bool = False,
        refused: type[LeaseError] = LeaseError,
    ) -> T:
        """Run ``operation`` in one transaction, run again on a connection the server had
        closed or after a concurrent transaction won (``errors.rerun``). ``single``: its
        outcome rests on one statement (or on each of its fenced statements alone: a
        checkpoint that skipped a row with a stop request saves it with a second), so where
        the dialect allows it runs in autocommit.
        ``direct``: ``operation`` only executes statements and reads their rows
        (``dbapi.Direct``), so it runs on this process's direct connection, in autocommit if
        ``single``, else in a transaction. ``refused``: the error raised when the database
        refuses the write for good (``errors.Kind``)."""
        execute = self.direct.run if direct else self._execute
        # A connection the server had closed (a restart, an idle timeout) is gone, and a
        # transaction a concurrent one won was rolled back: run again, on a fresh connection.
        # Each operation is fenced (its statements test what they change), so running it
        # again is safe.
        with self.wrapped_errors(refused=refused):
            return rerun(lambda: execute(operation, single=single), self.dialect)

    def _execute(self, operation: Callable[[Any], T], *, single: bool) -> T:
        if single and self.dialect.autocommit:
            with self.engine.connect() as connection:
                connection.execution_options(isolation_level="AUTOCOMMIT")
                return operation(Guarded(connection))
        with self.engine.begin() as connection:
            return operation(Guarded(connection))

    def session(self, *, shared: bool = False) -> Session:
        """A connection of this process's own, kept open for as long as the process lives:
        the session a keeper binds its leases to. ``shared``: this process runs one task at a
        time, whose statements take turns on that connection (``Session``)."""
        return Session(self, shared=shared)

    def wrapped_errors(self, what: str = "", *, refused: type[LeaseError] = LeaseError) -> Wrapped:
        """A context manager that turns driver errors into celery-leases' (``errors.Kind``);
        ``refused``: the error of a write the database refuses for good."""
        return Wrapped(self.safe_url, what, self.dialect, refused)


class Guarded:
    """An SQLAlchemy connection whose statements, if interrupted by anything but a database
    error (a soft time limit, ``KeyboardInterrupt``), invalidate it: it is never used again
    (``errors.interrupted``). Everything else is the connection's own."""

    def __init__(self, connection: Connection) -> None:
        #: The SQLAlchemy connection itself (to inspect it, say).
        self.wrapped = connection

    def execute(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
        with interrupted(self.discard):
            return self.wrapped.execute(statement, *args, **kwargs)

    def exec_driver_sql(self, statement: str, *args: Any, **kwargs: Any) -> Any:
        with interrupted(self.discard):
            return self.wrapped.exec_driver_sql(statement, *args, **kwargs)

    def discard(self) -> None:
        """Stop the interrupted statement on the server, and invalidate the connection."""
        with contextlib.suppress(Exception):
            cancel_statement(self.wrapped.connection.dbapi_connection)
        self.wrapped.invalidate()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


__all__ = ["Database", "Guarded"]
