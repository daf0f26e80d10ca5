"""PostgreSQL: RETURNING, backend pids as sessions (and the server's start time, to tell a
restart from a death), ``SKIP LOCKED``, a transaction-local idle bound, SQLSTATEs as error
kinds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles

from ..functions import db_now
from .base import Dialect, insert_unless_id_exists, upsert_on_conflict

#: PostgreSQL's SQLSTATE for a session its ``idle_in_transaction_session_timeout`` ended, and
#: the server's message for it (all psycopg 3.1 keeps of it).
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
IDLE_IN_TRANSACTION_MESSAGE = "terminating connection due to idle-in-transaction timeout"
#: SQLSTATEs of a concurrent transaction winning: serialization failure, deadlock, lock not
#: available (lock_timeout, NOWAIT).
CONFLICT_STATES = ("40001", "40P01", "55P03")
LOCK_NOT_AVAILABLE = "55P03"
#: SQLSTATE classes of a write refused for good: data exceptions (a value too long, out of
#: range, not in the encoding) and integrity constraints; and a program limit exceeded (an
#: index row too large).
REFUSED_CLASSES = ("22", "23")
REFUSED_STATES = ("54000",)
#: Execution option of a statement the driver must never prepare (False).
NOT_PREPARED = "leases_prepare"
#: libpq's socket options on every connection (``leases_engine_options``' ``connect_args``
#: override each): a network that drops packets without an error (a partition) ends a
#: connection instead of holding a renewal, a checkpoint and the pool slot until it heals.
#: Data unacknowledged for 10 s, or a silent peer for 10 s + 3 x 5 s of keepalive probes,
#: ends it; a long statement on a live server is not affected (its kernel answers).
SOCKET_OPTIONS = {
    "connect_timeout": 10,
    "tcp_user_timeout": 10_000,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


@compiles(db_now, "postgresql")
def _db_now(element: Any, compiler: Any, **kw: Any) -> str:
    # now() is the transaction start; clock_timestamp() is the time the statement runs.
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


class PostgreSQL(Dialect):
    names: ClassVar[tuple[str, ...]] = ("postgresql",)

    def live_expiry_index(self, table_name: str, live: sa.TextClause) -> tuple[sa.Index, ...]:
        # The search's estimate of "expires_at <= (the clock)" is a third of the live jobs,
        # so beside (state, created_at) PostgreSQL read every live job through a bitmap and
        # sorted them (44 ms a pass at 100,000); a partial index read in order stops at the
        # batch.
        return (sa.Index(f"ix_{table_name}_live_expiry", "expires_at", postgresql_where=live),)

    def id_prefix_index(self, table_name: str) -> tuple[sa.Index, ...]:
        # The primary key's btree serves LIKE only under the "C" collation; an index with
        # the pattern operator class does under any (it compares bytes).
        return (
            sa.Index(
                f"ix_{table_name}_id_prefix",
                "id",
                postgresql_ops={"id": "varchar_pattern_ops"},
            ),
        )

    # -- connecting --------------------------------------------------------------------------

    def engine_options(self) -> dict[str, Any]:
        return {"connect_args": dict(SOCKET_OPTIONS)}

    def prepare_engine(self, engine: sa.engine.Engine, database: Any) -> None:
        database.pooler = None

        def find_pooler(dbapi_connection: Any, record: Any) -> None:
            """Compare the backend pid the server reports running this connection's
            statements with the one the connection was given when it opened (once per
            process): a pooler hands its clients keys of its own, and behind one in
            transaction mode a session is not this process's and a prepared statement may be
            gone at the next transaction. A proxy that forwards the protocol as it is (NAT, a
            TCP proxy) changes neither."""
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("SELECT pg_backend_pid()")
                (running,) = cursor.fetchone()
            finally:
                cursor.close()
                dbapi_connection.rollback()
            database.pooler = pooler_between(dbapi_connection, running)

        def on_connect(dbapi_connection: Any, record: Any) -> None:
            if database.pooler is not None and hasattr(dbapi_connection, "prepare_threshold"):
                dbapi_connection.prepare_threshold = None  # psycopg 3: never prepare

        sa.event.listen(engine, "first_connect", find_pooler)
        sa.event.listen(engine, "connect", on_connect)

    def set_autocommit(self, dbapi_connection: Any, on: bool) -> None:
        dbapi_connection.autocommit = on

    def execute_options(self, statement: Any, sa_dialect: Any) -> dict[str, Any]:
        # psycopg prepares a statement run often on a connection; PostgreSQL then plans it
        # once for any values, which a statement over arrays of any length must not get.
        prepared = statement.get_execution_options().get(NOT_PREPARED, True)
        return {"prepare": False} if not prepared and sa_dialect.driver == "psycopg" else {}

    # -- sessions ----------------------------------------------------------------------------

    def session_ident(self, driver: Any) -> int:
        return int(driver.query("SELECT pg_backend_pid()")[0][0])

    def holder_session(self, pid: Any) -> Any:
        return sa.func.pg_backend_pid()

    def session_alive(self, session: Any) -> Any:
        return sa.exists().select_from(sa.func.pg_stat_get_activity(sa.cast(session, sa.Integer)))

    def server_started(self) -> Any:
        return sa.cast(sa.extract("epoch", sa.func.pg_postmaster_start_time()), sa.Double())

    def session_gone(self, holders: sa.Table) -> Any:
        """The holder's backend is gone, on the very server it last renewed on (the same
        ``pg_postmaster_start_time()``): its process died, or its connection was cut; not a
        restart, nor a failover to a replica, which ended every session (its holders bind
        again at their next renewal). A crash recovery keeps the start time: its holders
        count as gone (their jobs move, a live attempt is then fenced out)."""
        h = holders
        return sa.and_(~self.session_alive(h.c.session), h.c.server == self.server_started())

    # -- statement forms ---------------------------------------------------------------------

    def locking_candidates(self, select: sa.Select[Any]) -> sa.Select[Any]:
        # PostgreSQL locks only the rows it returns.
        return select.with_for_update(skip_locked=True)

    def with_idle_guard(self, statement: Any, name: str) -> Any:
        # The statement itself bounds the transaction's idle time (transaction-local): a
        # worker frozen before its commit cannot hold the row's lock for longer than that.
        guard = sa.select(
            sa.func.set_config(
                "idle_in_transaction_session_timeout",
                sa.bindparam("b_idle_ms", type_=sa.String()),
                True,
            ).label("v")
        ).cte(name)
        return statement.where(sa.exists(sa.select(guard.c.v))).add_cte(guard)

    def insert_unless_exists(self, table: sa.Table, values: dict[str, Any]) -> Any:
        return insert_unless_id_exists(postgresql.insert, table, values)

    def unflushed(self, value: Any) -> Any:
        # set_config(..., true) lasts to the end of the statement's own transaction, and a
        # commit follows the setting in effect when it commits; volatile, so never folded.
        asked = sa.func.set_config("synchronous_commit", "off", True)
        return sa.case((asked.is_(None), value), else_=value)

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
            postgresql.insert, table, select, columns, key, update=update, returning=returning
        )

    # -- a caller's transaction --------------------------------------------------------------

    def bounds_idle(self, sa_dialect: Any) -> bool:
        return True

    # -- errors ------------------------------------------------------------------------------

    def duplicate_key(self, orig: Any) -> bool:
        return getattr(orig, "sqlstate", None) == "23505"

    def error_kind(self, orig: Any) -> str | None:
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if not isinstance(state, str):
            return None
        if state in CONFLICT_STATES:
            return "conflict"
        if state[:2] in REFUSED_CLASSES or state in REFUSED_STATES:
            return "refused"
        return None

    def waited_out(self, orig: Any) -> bool:
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        return bool(state == LOCK_NOT_AVAILABLE)

    def ended_idle_transaction(self, orig: Any) -> bool:
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if state == IDLE_IN_TRANSACTION_TIMEOUT:
            return True
        # psycopg 3.1 reports the server closing the connection without its SQLSTATE.
        return state is None and IDLE_IN_TRANSACTION_MESSAGE in str(orig)

    # -- migrations --------------------------------------------------------------------------

    @contextlib.contextmanager
    def migration_lock(self, connection: sa.Connection, table: str) -> Iterator[None]:
        name = f"leases_migrate:{table}"
        connection.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(name))))
        yield

    def add_column_sql(self, sa_dialect: Any, table: str, spec: str) -> list[str]:
        return [
            "SET LOCAL lock_timeout = '5s'",
            f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {spec}",
        ]


def pooler_between(dbapi_connection: Any, running: int) -> str | None:
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


__all__ = ["PostgreSQL"]
