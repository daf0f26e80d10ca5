"""The DBAPI fast path: the store's one-statement operations run straight on a DBAPI connection.

A call through SQLAlchemy's ``Connection.execute`` costs this process ~0.15-0.3 ms of Python
(pool checkout and reset, the execution context, the result object), about what the database
spends on a checkpoint (docs/benchmarks.md). Here each statement is compiled once to the
driver's SQL, its parameters are put in order with no other work, and it runs on a DBAPI
connection of this process's own, kept in autocommit outside the pool. Driver errors are raised
as SQLAlchemy's (``DBAPIError.instance``), so callers handle them as before.

Compiling uses SQLAlchemy's public API but for one function, ``_process_parameters_for_postcompile``
(an ``IN`` list expanded into its placeholders, as SQLAlchemy's own execution does), which is
why pyproject bounds SQLAlchemy below its next minor release and CI's matrix runs its newest.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .dialects import Dialect
from .errors import cancel_statement, interrupted

T = TypeVar("T")

#: Compiled statements kept per connection kind; a store has a few dozen.
MAX_COMPILED = 512
#: The most rows, and characters or bytes of text in its parameters and rows, a statement
#: may have for its cursor to be kept for the next (``Driver``): a kept cursor holds both
#: until then (psycopg its result and encoded parameters, PyMySQL its rows and SQL text).
KEPT_ROWS = 64
KEPT_TEXT = 64 * 1024


class Compiled:
    """A statement in the driver's SQL, and how to order its parameters."""

    __slots__ = (
        "compiled", "defaults", "execute_options", "expanding", "keys", "names", "positional",
        "processors", "sql",
    )  # fmt: skip

    def __init__(self, statement: Any, dialect: Any, family: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self.compiled = compiled
        self.sql: str = compiled.string
        self.positional = bool(compiled.positional)
        self.processors = _bind_processors(compiled, dialect)
        required = {name for name, bind in compiled.binds.items() if bind.required}
        # Values the statement carries itself (literals SQLAlchemy binds: '' in coalesce, ...).
        given = compiled.params
        names = compiled.positiontup if self.positional else list(compiled.bind_names.values())
        expanding = compiled.post_compile_params | compiled.literal_execute_params
        self.expanding = any(bind.required for bind in expanding)
        if expanding and not self.expanding:
            # Lists the statement gives itself (``state IN ('running', 'done')``): expanded
            # once here, not at every call.
            state = compiled._process_parameters_for_postcompile(given)
            self.sql, given = state.statement, dict(state.parameters)
            self.processors.update(state.processors)
            names = state.positiontup if self.positional else list(given)
        self.defaults = {name: value for name, value in given.items() if name not in required}
        self.names: Sequence[str] = tuple(names or ())
        #: Names of the columns it returns (a SELECT, or RETURNING).
        selected = getattr(statement, "selected_columns", None)
        self.keys: Sequence[str] = tuple(selected.keys()) if selected is not None else ()
        self.execute_options = family.execute_options(statement, dialect)

    def parameters(self, params: dict[str, Any]) -> tuple[str, Any]:
        """(SQL, parameters) to send for ``params`` (the statement's ``b_*`` values)."""
        merged = {**self.defaults, **params} if self.defaults else params
        if self.expanding:
            state = self.compiled._process_parameters_for_postcompile(
                self.compiled.construct_params(merged, _check=False)
            )
            processors = {**self.processors, **state.processors}
            expanded = state.parameters
            if self.positional:
                return state.statement, tuple(
                    _processed(processors, key, expanded[key]) for key in state.positiontup
                )
            return state.statement, {
                key: _processed(processors, key, value) for key, value in expanded.items()
            }
        processors = self.processors
        if self.positional:
            if processors:
                return self.sql, tuple(_processed(processors, k, merged[k]) for k in self.names)
            return self.sql, tuple(merged[k] for k in self.names)
        if processors:
            return self.sql, {k: _processed(processors, k, merged[k]) for k in self.names}
        return self.sql, {k: merged[k] for k in self.names}


def _bind_processors(compiled: Any, dialect: Any) -> dict[str, Callable[[Any], Any]]:
    """Each bound value's conversion to what the driver takes (a type's ``bind_processor``)."""
    found: dict[str, Any] = {}
    for bind, name in compiled.bind_names.items():
        if bind in compiled.literal_execute_params or isinstance(bind.type, sa.types.TupleType):
            continue  # rendered as literals, or expanded (with its own processors) at each call
        processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if processor is not None:
            found[name] = processor
    return found


def _small(parameters: Any, rows: list[tuple[Any, ...]]) -> bool:
    """Whether a statement that ran with ``parameters`` and read ``rows`` may leave them on a
    kept cursor: KEPT_ROWS rows at most, KEPT_TEXT of text in all."""
    if len(rows) > KEPT_ROWS:
        return False
    size = 0
    for value in parameters.values() if isinstance(parameters, dict) else parameters:
        if isinstance(value, (str, bytes)):
            size += len(value)
    for row in rows:
        for value in row:
            if isinstance(value, (str, bytes)):
                size += len(value)
    return size <= KEPT_TEXT


def _processed(processors: dict[str, Callable[[Any], Any]], key: str, value: Any) -> Any:
    processor = processors.get(key)
    return value if processor is None else processor(value)


class Result:
    """What a statement gave back: its rows (read at once), their column names and its row
    count."""

    __slots__ = ("keys", "rowcount", "rows")

    def __init__(
        self, rows: list[tuple[Any, ...]], rowcount: int, keys: Sequence[str] = ()
    ) -> None:
        self.rows = rows
        self.rowcount = rowcount
        self.keys = keys

    def mappings(self) -> list[dict[str, Any]]:
        """The rows as dicts of column name to value."""
        return [dict(zip(self.keys, row, strict=True)) for row in self.rows]

    def first(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None

    def all(self) -> list[tuple[Any, ...]]:
        return self.rows

    def scalar(self) -> Any:
        return self.rows[0][0] if self.rows else None

    def scalar_one(self) -> Any:
        if len(self.rows) != 1:
            raise sa.exc.NoResultFound(f"expected one row, got {len(self.rows)}")
        return self.rows[0][0]


class Driver:
    """Statements run on one DBAPI connection, compiled once (``Compiled``), with the shape of
    SQLAlchemy's ``Connection.execute`` for what the store's operations use of it."""

    def __init__(
        self, dbapi_connection: Any, dialect: Any, family: Dialect, compiled: dict[Any, Compiled]
    ) -> None:
        #: SQLAlchemy's dialect (the driver's), and the database family's (``db/dialects``).
        self.dialect = dialect
        self.family = family
        self._dbapi_connection = dbapi_connection
        self._compiled = compiled
        self.broken = False
        #: Called (no arguments) when a statement's interruption discards the connection.
        self.on_discard: Callable[[], None] | None = None
        #: Called (no arguments) when a statement finds the connection lost.
        self.on_lost: Callable[[], None] | None = None
        #: The cursor kept for the next statement, with the connection it is of (``Direct``).
        self._kept: tuple[Any, Any] | None = None

    #: Whether a cursor is kept from one statement to the next, not made and closed at each:
    #: on a connection of the store's own (``Direct``), where making one costs psycopg
    #: ~15 us, an eighth of a checkpoint's own Python. A connection of another library's is
    #: its owner's: nothing of the store's stays open on it.
    keeps_cursor = False

    def execute(self, statement: Any, params: dict[str, Any] | None = None) -> Result:
        compiled = self._compiled.get(statement)
        if compiled is None:
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.clear()
            compiled = self._compiled[statement] = Compiled(statement, self.dialect, self.family)
        sql, parameters = compiled.parameters(params or {})
        cursor = None  # taken inside: a connection that died refuses even a cursor
        keep = False
        try:
            with interrupted(self.discard, (self.dialect.loaded_dbapi.Error,)):
                self.family.check_size(sql, parameters, self.dialect)
                cursor = self._cursor()
                cursor.execute(sql, parameters, **compiled.execute_options)
                if cursor.description is None:
                    result = Result([], cursor.rowcount)
                else:
                    rows = [tuple(r) for r in cursor.fetchall()]
                    result = Result(rows, cursor.rowcount, compiled.keys)
                keep = self.keeps_cursor and _small(parameters, result.rows)
                return result
        except self.dialect.loaded_dbapi.Error as exc:
            raise self._wrapped(exc, sql, parameters, cursor) from exc
        finally:
            if cursor is not None and not keep:
                self._kept = None
                # Not contextlib.suppress (an object made at each call): every statement of
                # the hot path comes here. A closed connection's cursor has nothing to free.
                try:  # noqa: SIM105
                    cursor.close()
                except Exception:
                    pass

    def _cursor(self) -> Any:
        """The kept cursor of this connection, or a new one (kept if ``keeps_cursor``)."""
        kept = self._kept
        connection = self._dbapi_connection
        if kept is not None and kept[0] is connection:
            return kept[1]
        cursor = connection.cursor()
        if self.keeps_cursor:
            self._kept = (connection, cursor)
        return cursor

    def query(self, sql: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of ``sql`` (the driver's SQL and parameters), for statements of no table."""
        cursor = None
        keep = False
        try:
            with interrupted(self.discard, (self.dialect.loaded_dbapi.Error,)):
                cursor = self._cursor()
                cursor.execute(sql, parameters)
                rows = [tuple(r) for r in cursor.fetchall()] if cursor.description else []
                keep = self.keeps_cursor and _small(parameters, rows)
                return rows
        except self.dialect.loaded_dbapi.Error as exc:
            raise self._wrapped(exc, sql, parameters, cursor) from exc
        finally:
            if cursor is not None and not keep:
                self._kept = None
                with contextlib.suppress(Exception):
                    cursor.close()

    def discard(self) -> None:
        """A statement was interrupted (``errors.interrupted``): the connection is in an
        unknown state (a command may still be in progress on it), so it is closed and never
        used again. A connection of another library's (``Foreign``) is closed too: its owner
        sees a closed connection and drops it."""
        self.broken = True
        cancel_statement(self._dbapi_connection)
        self._dbapi_connection.close()
        if self.on_discard is not None:
            self.on_discard()

    def exec_driver_sql(self, sql: str) -> Result:
        """Run one SQL string as it is (no parameters)."""
        return Result(self.query(sql), -1)

    def _wrapped(self, exc: Any, sql: str, parameters: Any, cursor: Any) -> Any:
        """``exc`` as SQLAlchemy's error (a ``DBAPIError``), noting a lost connection."""
        lost = self.dialect.is_disconnect(exc, self._dbapi_connection, cursor)
        self.broken = self.broken or lost
        if lost and self.on_lost is not None:
            with contextlib.suppress(Exception):
                self.on_lost()
        return sa.exc.DBAPIError.instance(
            sql,
            parameters,
            exc,
            self.dialect.loaded_dbapi.Error,
            hide_parameters=True,
            connection_invalidated=lost,
            dialect=self.dialect,
        )


class Direct(Driver):
    """One DBAPI connection of this process's own, in autocommit, outside the pool. Used by
    one thread at a time (``Connections`` lends it out)."""

    keeps_cursor = True

    def __init__(self, engine: Engine, family: Dialect, compiled: dict[Any, Compiled]) -> None:
        fairy = engine.raw_connection()  # the engine's connect hooks run (time zone, pragmas)
        self.connection: Any = fairy.driver_connection
        super().__init__(fairy.dbapi_connection, engine.dialect, family, compiled)
        fairy.detach()  # its own now: never reset or handed out by the pool
        self._fairy = fairy
        self.pid = os.getpid()
        self.in_transaction = False
        family.set_autocommit(self.connection, True)

    def begin(self) -> None:
        """Open a transaction (for an operation of more than one statement)."""
        self.query(self.family.begin_sql)
        self.in_transaction = True

    def commit(self) -> None:
        self.in_transaction = False
        self.query("COMMIT")

    def rollback(self) -> None:
        self.in_transaction = False
        if not self.broken:
            try:
                self.query("ROLLBACK")
            except sa.exc.DBAPIError:
                self.broken = True

    def close(self) -> None:
        """Close the connection, unless it is a forked parent's (its socket is the parent's)."""
        if self.pid == os.getpid():
            with contextlib.suppress(self.dialect.loaded_dbapi.Error):
                self._dbapi_connection.close()


class Foreign(Driver):
    """A DBAPI connection another library holds open in a transaction of its own (Django's,
    inside ``transaction.atomic()``), on which the store runs its statements: nothing here
    begins, commits or rolls back, so they commit or roll back with that transaction.
    ``info`` lives as long as the foreign connection (the store keeps its MariaDB idle-write
    bound there)."""

    def __init__(
        self,
        dbapi_connection: Any,
        dialect: Any,
        family: Dialect,
        compiled: dict[Any, Compiled],
        info: Any,
    ) -> None:
        super().__init__(dbapi_connection, dialect, family, compiled)
        self.info: dict[str, Any] = info


class Connections:
    """This process's direct connections, lent to one operation at a time: one per thread
    that is running an operation, kept for the next.

    A process that runs one task at a time (a prefork pool process) lends the connection of
    its keeper's session (``share``) before any other: its task's statements and the keeper's
    renewals then take turns on one connection, the only one the process keeps open."""

    #: Seconds an operation waits for the shared connection (a renewal under way) before it
    #: runs on a connection of its own.
    SHARED_WAIT = 1.0

    def __init__(self, engine: Callable[[], Engine], family: Dialect, *, keep: int = 5) -> None:
        self._engine = engine
        self.family = family
        self._keep = keep
        self._lock = threading.Lock()
        self._idle: list[Direct] = []
        self._compiled: dict[Any, Compiled] = {}
        self._pid = os.getpid()
        self._shared: tuple[Direct, threading.Lock] | None = None

    def compile(self, statement: Any) -> None:
        """Compile ``statement`` now, for every connection of this process (and of the
        processes it forks, which share the result until they change it)."""
        if statement not in self._compiled:
            self._compiled[statement] = Compiled(statement, self._engine().dialect, self.family)

    def share(self, direct: Direct | None, lock: threading.Lock) -> None:
        """Lend ``direct`` (None: stop), whose owner holds ``lock`` while it uses it."""
        self._shared = None if direct is None else (direct, lock)

    def run(self, operation: Callable[[Direct], T], *, single: bool) -> T:
        """Run ``operation`` on a direct connection: in autocommit if it is ``single`` (one
        statement), else in a transaction committed at its end."""
        direct = self._take()
        try:
            if single:
                return operation(direct)
            direct.begin()
            result = operation(direct)
            direct.commit()
            return result
        except BaseException:
            if direct.in_transaction:
                direct.rollback()
            raise
        finally:
            self._give_back(direct)

    def foreign(self, dbapi_connection: Any, info: dict[str, Any]) -> Foreign:
        """The store's statements on ``dbapi_connection``, a connection of another library's
        in a transaction of its own (:class:`Foreign`)."""
        return Foreign(dbapi_connection, self._engine().dialect, self.family, self._compiled, info)

    def open(self) -> Direct:
        """A direct connection of the caller's own, not lent by this pool (a keeper's
        session): the caller closes it."""
        engine = self._engine()
        dbapi = engine.dialect.loaded_dbapi
        try:
            return Direct(engine, self.family, self._compiled)
        except dbapi.Error as exc:  # cannot connect: the same error SQLAlchemy would raise
            raise sa.exc.DBAPIError.instance(
                None, None, exc, dbapi.Error, hide_parameters=True, dialect=engine.dialect
            ) from exc

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for direct in idle:
            direct.close()

    def _take(self) -> Direct:
        shared = self._shared
        if shared is not None:
            direct, lock = shared
            usable = not direct.broken and direct.pid == os.getpid()
            if usable and lock.acquire(timeout=self.SHARED_WAIT):
                if self._shared is shared and not direct.broken:
                    return direct
                lock.release()
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's connections are its own
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        return self.open()

    def _give_back(self, direct: Direct) -> None:
        shared = self._shared
        if shared is not None and shared[0] is direct:
            shared[1].release()  # its owner closes it, broken or not
            return
        if shared is not None or direct.broken or direct.pid != os.getpid():
            # (A process that shares its session's connection keeps no second one: this
            # one served while a renewal held that connection for long.)
            direct.close()
            return
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(direct)
                return
        direct.close()
