"""What the storage wing asks of a database family. One module per family answers it
(``postgresql``, ``mysql``, ``sqlite``); ``dialects/__init__.py`` registers them by the names
SQLAlchemy gives their backends. A new database is one new module and one registration line.

The statements (``db/statements``) and the store (``db/store/``) never test a dialect's name:
where databases differ they call the methods here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import sqlalchemy as sa


class Dialect:
    """A database family: how to connect, bind a lease to a session, write the statement forms
    that differ, read a statement's outcome, and tell its errors apart."""

    #: SQLAlchemy backend names this module serves (``url.get_backend_name()``).
    names: ClassVar[tuple[str, ...]] = ()
    #: ``UPDATE ... RETURNING`` exists: the rows it returns tell a write's outcome.
    returning: ClassVar[bool] = True
    #: A one-statement operation runs in autocommit (no BEGIN/COMMIT round trips).
    autocommit: ClassVar[bool] = True
    #: The database is a file on this machine (no server, no sessions of its own).
    file_based: ClassVar[bool] = False
    #: How a transaction of more than one statement starts on a connection of the store's.
    begin_sql: ClassVar[str] = "BEGIN"

    def __init__(self, name: str) -> None:
        #: The backend name (``mariadb`` and ``mysql`` share a module).
        self.name = name
        #: The database's URL, once a ``Database`` uses this dialect (None before).
        self.url: sa.engine.URL | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} dialect {self.name!r}>"

    # -- connecting --------------------------------------------------------------------------

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments of ``create_engine`` (the user's ``leases_engine_options`` win)."""
        return {}

    def prepare_engine(self, engine: sa.engine.Engine, database: Any) -> None:
        """Hook what each new connection needs onto a new engine (time zone, pragmas)."""

    def set_autocommit(self, dbapi_connection: Any, on: bool) -> None:
        """Turn the driver's autocommit on or off on a DBAPI connection of the store's own."""
        dbapi_connection.autocommit(on)

    def execute_options(self, statement: Any, sa_dialect: Any) -> dict[str, Any]:
        """Keyword arguments of the driver's ``cursor.execute`` for ``statement``."""
        return {}

    def check_size(self, sql: str, parameters: Any, sa_dialect: Any) -> None:
        """Refuse, before sending it, a statement the server would refuse for its size (and
        drop the connection with it), as the driver's own error: nothing by default."""

    # -- sessions: a lease bound to its holder's connection ----------------------------------

    def connectionless_ident(self) -> int | None:
        """A keeper session's id when no connection is needed to know it (SQLite: the
        process), else None."""
        return None

    def session_ident(self, driver: Any) -> int:
        """The id of the session of ``driver``, a keeper's new connection (taking what marks
        it alive, where the database needs something taken)."""
        raise NotImplementedError

    def holder_session(self, pid: Any) -> Any:
        """SQL for the id of the session running the statement, which a keeper's renewal binds
        its leases to (``pid``: the process id bound as a parameter)."""
        raise NotImplementedError

    def session_alive(self, session: Any) -> Any:
        """SQL true while the session ``session`` (a column or a parameter) is alive."""
        return sa.true()

    def server_started(self) -> Any:
        """SQL for when the database server started (epoch seconds), which a restart or a
        failover to another server changes; None where the database cannot say."""
        return None

    def session_gone(self, holders: sa.Table) -> Any:
        """SQL true for a holder (a row of ``holders``) whose session has ended, and not in a
        reset that ended every session (a restart: those holders bind again). None where the
        database cannot tell: :meth:`holder_gone` then judges each holder."""
        return None

    def mark_alive(self, holder: str) -> None:
        """Leave a mark that tells, from outside this process, that the holder ``holder`` of
        this process lives (a database with no sessions in SQL: :meth:`holder_gone` reads
        it)."""

    def forget_alive(self, holder: str) -> None:
        """Take away :meth:`mark_alive`'s mark (the holder stops, its process lives on)."""

    def holder_gone(self, holder: str) -> bool:
        """For a database with no sessions in SQL: whether the holder ``holder`` is gone for
        sure (False when it cannot tell: its lease's expiry decides then)."""
        return False

    # -- statement forms ---------------------------------------------------------------------

    def live_key_index(self, table_name: str, live: sa.TextClause) -> tuple[Any, ...]:
        """The schema items that let at most one job hold each lease key (``live``: SQL true
        for a job that holds its key): a partial unique index where the database has them."""
        return (
            sa.Index(
                f"ix_{table_name}_live_key",
                "lease_key",
                unique=True,
                postgresql_where=live,
                sqlite_where=live,
            ),
        )

    def id_prefix_index(self, table_name: str) -> tuple[sa.Index, ...]:
        """An index that serves :meth:`id_prefix` where the primary key cannot (none: it
        can)."""
        return ()

    def live_expiry_index(self, table_name: str, live: sa.TextClause) -> tuple[sa.Index, ...]:
        """An index of the live jobs (``live``: SQL true for one) by the end of their lease
        or wait, where the reaper's search for expired ones needs one besides
        ``ix_<table>_expiry`` (state, expires_at), which serves it here (none)."""
        return ()

    def id_prefix(self, column: Any, pattern: Any) -> Any:
        """SQL true for an id matching ``pattern`` (a value of :meth:`prefix_pattern`), in a
        form the primary key or :meth:`id_prefix_index` serves. It may match ids in another
        case too (a case-insensitive collation); the caller keeps the exact ones."""
        return column.like(pattern, escape="\\")

    def prefix_pattern(self, prefix: str) -> str:
        """The pattern :meth:`id_prefix` matches ids starting with ``prefix`` by."""
        return like_prefix(prefix)

    def holds_key(self, table: sa.Table, key: Any, live_states: Sequence[str]) -> Any:
        """SQL true for the job that holds the lease key ``key`` (a parameter): one index
        lookup. The states are literals in the text, as in the partial index's predicate: a
        plan made for any key (a prepared statement's generic plan; SQLite always) may use
        that index only if the query's condition is the predicate, values included."""
        t = table
        live: Any = sa.bindparam(
            "live_states", list(live_states), expanding=True, literal_execute=True
        )
        return sa.and_(
            t.c.lease_key == key, sa.or_(t.c.state.in_(live), t.c.followup_id.is_not(None))
        )

    def arrival_order(self, table: sa.Table) -> tuple[Any, ...]:
        """What orders ``table``'s jobs by when they were recorded (first in, first out):
        the database clock at their insert, and their id where two share a clock reading
        (microseconds apart here: calls that close are concurrent, no order to keep)."""
        return (table.c.created_at, table.c.id)

    def locking_candidates(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``select`` (the reaper's orphan candidates) in the form that locks what it returns,
        where the database locks only the rows it returns."""
        return select

    def with_idle_guard(self, statement: Any, name: str) -> Any:
        """``statement`` (a write in the caller's transaction), made to bound how long that
        transaction may sit idle after it (parameter ``b_idle_ms``), where a statement can."""
        return statement

    def insert_unless_exists(self, table: sa.Table, values: dict[str, Any]) -> Any:
        """An INSERT that does nothing when the id exists (:meth:`inserted` tells which); a
        second live job of a lease key is an IntegrityError."""
        raise NotImplementedError

    def unflushed(self, value: Any) -> Any:
        """``value`` as an SQL expression whose evaluation makes the statement's commit
        asynchronous (it returns before its WAL is flushed), or None where a statement cannot
        ask that for its own transaction."""
        return None

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
        """An INSERT of the row ``select`` gives (``columns``) that, when a row with that
        ``key`` exists, updates it instead: every other column to the new row's value, or
        ``update(incoming)`` (``incoming[c]``: the new row's column ``c``). It returns
        ``returning`` (the key by default) where the database can (:meth:`upserted` tells
        if it wrote)."""
        raise NotImplementedError

    def with_returning(self, statement: Any, *columns: Any) -> Any:
        """``statement`` returning ``columns`` where the database can (else :meth:`rows` reads
        them back)."""
        return statement.returning(*columns) if self.returning else statement

    # -- reading a write's outcome -----------------------------------------------------------

    def rows(
        self,
        c: Any,
        statement: Any,
        params: dict[str, Any],
        *,
        read_back: Any = None,
        first_try: tuple[Any, tuple[Any, ...]] | None = None,
    ) -> list[tuple[Any, ...]]:
        """The rows of a conditional write made :meth:`with_returning`: its returned rows, or,
        where there is no RETURNING, the rows of ``read_back`` (a SELECT of the same columns)
        when it changed any. ``first_try``: (a narrower write returning nothing, the row it
        stands for), tried first: one statement and no rows to read in the usual case."""
        if first_try is not None:
            narrower, row = first_try
            if c.execute(narrower, params).rowcount == 1:
                return [row]
        return self.written_rows(c, statement, params, read_back)

    def written_rows(
        self, c: Any, statement: Any, params: dict[str, Any], read_back: Any
    ) -> list[tuple[Any, ...]]:
        """The rows of :meth:`rows`' write itself (no narrower one)."""
        return list(c.execute(statement, params).all())

    def inserted(
        self, c: Any, statement: Any, params: dict[str, Any], *, key_taken: Callable[[Any], bool]
    ) -> bool:
        """Run an :meth:`insert_unless_exists`; True when it inserted. ``key_taken(exc)``:
        whether an IntegrityError is the lease key's unique index (then it is raised)."""
        return c.execute(statement, params).first() is not None

    def upserted(self, c: Any, statement: Any, params: dict[str, Any]) -> bool:
        """Run an :meth:`upsert`; True when it wrote."""
        return c.execute(statement, params).first() is not None

    # -- a caller's transaction ----------------------------------------------------------------

    def bounds_idle(self, sa_dialect: Any) -> bool:
        """Whether a write in a caller's transaction on a connection of ``sa_dialect`` bounds
        how long that transaction may sit idle (:meth:`with_idle_guard` or
        :meth:`guard_idle_writes`)."""
        return False

    def guard_idle_writes(self, connection: Any, seconds: int) -> bool:
        """Bound how long ``connection``'s transaction may sit idle after writing, by a
        setting of the session; True when one was set (and must be given back)."""
        return False

    def unguard_sql(self) -> str | None:
        """SQL giving a session the server's default idle-write bound back, if any."""
        return None

    # -- errors --------------------------------------------------------------------------------

    def duplicate_key(self, orig: Any) -> bool:
        """Whether the driver's error ``orig`` is a unique key refusing a row."""
        return False

    def error_kind(self, orig: Any) -> str | None:
        """What the driver's error ``orig`` means (``db.errors.Kind``'s values: ``conflict``,
        ``refused``, ``gone``), when this dialect knows it; None otherwise."""
        return None

    def waited_out(self, orig: Any) -> bool:
        """Whether the driver's error ``orig``, a ``conflict``, came after the statement
        waited as long as the database lets it for a lock (a lock timeout, SQLite's busy
        timeout): running it again at once may wait as long again. A deadlock or a
        serialization failure is told at once, and the other transaction goes on."""
        return False

    def ended_idle_transaction(self, orig: Any) -> bool:
        """Whether the driver's error ``orig`` is the database ending a transaction that sat
        idle too long."""
        return False

    # -- migrations ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def migration_lock(self, connection: sa.Connection, table: str) -> Iterator[None]:
        """Hold the database's lock for migrating ``table`` during the block, in the
        transaction of ``connection`` (one migrator at a time; a second one then finds the
        first one's work)."""
        yield

    def add_column_sql(self, sa_dialect: Any, table: str, spec: str) -> list[str]:
        """The statements of an ``ALTER TABLE ... ADD COLUMN`` that waits at most 5 s for the
        table's lock, idempotent where the database can say so (a concurrent start)."""
        return [f"ALTER TABLE {table} ADD COLUMN {spec}"]


def like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``\\``) matching values that start with ``prefix``."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def insert_unless_id_exists(insert: Any, table: sa.Table, values: dict[str, Any]) -> Any:
    """:meth:`Dialect.insert_unless_exists` where ``INSERT ... ON CONFLICT`` exists (``insert``:
    the dialect's). Only an existing id is "nothing to do": a second live job of a lease key
    must fail."""
    statement = insert(table).values(values)
    return statement.on_conflict_do_nothing(index_elements=[table.c.id]).returning(table.c.id)


def upsert_on_conflict(
    insert: Any,
    table: sa.Table,
    select: Any,
    columns: list[str],
    key: str,
    *,
    update: Callable[[Any], dict[str, Any]] | None = None,
    returning: tuple[Any, ...] = (),
) -> Any:
    """:meth:`Dialect.upsert` where ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` exists
    (``insert``: the dialect's). RETURNING tells it wrote: an INSERT's row count is not
    reliable on every driver."""
    statement = insert(table).from_select(columns, select)
    incoming = statement.excluded
    changes = update(incoming) if update else {c: incoming[c] for c in columns if c != key}
    return statement.on_conflict_do_update(index_elements=[table.c[key]], set_=changes).returning(
        *(returning or (table.c[key],))
    )


__all__ = ["Dialect", "insert_unless_id_exists", "upsert_on_conflict"]
