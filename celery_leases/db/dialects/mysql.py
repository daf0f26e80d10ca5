"""MariaDB and MySQL: no ``UPDATE ... RETURNING`` (a write's outcome is its row count, then a
read back in the same transaction), a named lock that marks a keeper's session alive, no
partial indexes (a generated column holds the live key), and no ``UPDATE ... SKIP LOCKED``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles

from ...errors import ConfigurationError
from ..functions import db_now
from .base import Dialect

#: Prefix of the named lock a keeper's session holds (``GET_LOCK``), which any user can see.
SESSION_LOCK_PREFIX = "celery_leases:"
#: Client errors of a connection the server closed (MariaDB's ``idle_write_transaction_timeout``
#: ends the session this way: 2006, 2013; MySQL 8.0.24+: 4031).
SERVER_CLOSED_CONNECTION = (2006, 2013, 4031)
#: ER_DUP_ENTRY.
DUPLICATE_ENTRY = 1062
#: A concurrent transaction won: lock wait timeout (1205), deadlock (1213), a row changed since
#: the snapshot read it (1020, MariaDB's innodb_snapshot_isolation).
CONFLICT_CODES = (1205, 1213, 1020)
LOCK_WAIT_TIMEOUT = 1205
#: A write refused for good: a packet over max_allowed_packet (1153, 1301), a value too long
#: (1406), out of range (1264), not in the column's character set (1366), NULL in a NOT NULL
#: column (1048), a row too large (1118), a constraint (1452, 3819).
REFUSED_CODES = (1153, 1301, 1406, 1264, 1366, 1048, 1118, 1452, 3819)
#: Bytes kept free in a packet for the protocol's own framing.
PACKET_MARGIN = 1024
#: Modules of the drivers whose errors carry these codes.
_DRIVERS = ("pymysql", "MySQLdb", "mariadb")


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _db_now(element: Any, compiler: Any, **kw: Any) -> str:
    # The session time zone is UTC (on_connect), so this is unambiguous around DST.
    return "UNIX_TIMESTAMP(NOW(6))"


class MySQL(Dialect):
    names: ClassVar[tuple[str, ...]] = ("mysql", "mariadb")
    returning: ClassVar[bool] = False
    autocommit: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        super().__init__(name)
        #: The server's ``max_allowed_packet``, read at each new connection (None before).
        self.max_packet: int | None = None

    # -- connecting --------------------------------------------------------------------------

    def prepare_engine(self, engine: sa.engine.Engine, database: Any) -> None:
        sa.event.listen(engine, "connect", self._on_connect)

    def _on_connect(self, dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # UTC makes UNIX_TIMESTAMP(NOW(6)) unambiguous around DST; strict mode makes a value
        # the column cannot hold an error instead of a silent truncation.
        cursor.execute(
            "SET time_zone = '+00:00', sql_mode = CONCAT(@@sql_mode, ',STRICT_ALL_TABLES')"
        )
        cursor.execute("SELECT @@max_allowed_packet")
        (self.max_packet,) = cursor.fetchone()
        cursor.close()

    def check_size(self, sql: str, parameters: Any, sa_dialect: Any) -> None:
        """A statement over ``max_allowed_packet`` is refused here, as the server's own error
        1153: sent, it would fail with that error or with the connection cut (the server drops
        it), which would read as an outage and be retried."""
        limit = self.max_packet
        if limit is None:
            return
        values = parameters.values() if isinstance(parameters, dict) else parameters
        size = len(sql) + sum(
            len(v) * 4 if isinstance(v, str) else len(v) if isinstance(v, bytes) else 16
            for v in values
        )
        if size < limit - PACKET_MARGIN:
            return
        size = len(sql.encode()) + sum(
            len(v.encode()) if isinstance(v, str) else len(v) if isinstance(v, bytes) else 16
            for v in values
        )
        if size >= limit - PACKET_MARGIN:
            raise sa_dialect.loaded_dbapi.OperationalError(
                1153,
                f"Got a packet bigger than 'max_allowed_packet' bytes (the statement is about "
                f"{size:,} bytes; the server's max_allowed_packet is {limit:,})",
            )

    # -- sessions ----------------------------------------------------------------------------

    def session_ident(self, driver: Any) -> int:
        # The session takes a named lock: the reaper reads a session as alive while it holds it.
        found = driver.query(
            "SELECT CONNECTION_ID(), GET_LOCK(CONCAT(%s, CONNECTION_ID()), 0)",
            (SESSION_LOCK_PREFIX,),
        )
        return int(found[0][0])

    def holder_session(self, pid: Any) -> Any:
        # The connection id only while that connection holds its keeper lock, which is what
        # the reaper looks for.
        lock = sa.func.concat(SESSION_LOCK_PREFIX, sa.func.connection_id())
        return sa.case(
            (sa.func.is_used_lock(lock) == sa.func.connection_id(), sa.func.connection_id()),
            else_=sa.null(),
        )

    def session_alive(self, session: Any) -> Any:
        return sa.func.is_used_lock(sa.func.concat(SESSION_LOCK_PREFIX, session)) == session

    def server_started(self) -> Any:
        # information_schema.GLOBAL_STATUS: MariaDB (MySQL 8 dropped it; there this fails,
        # and the reaper's search for dead holders with it: their jobs wait for the expiry).
        status = sa.table(
            "GLOBAL_STATUS",
            sa.column("VARIABLE_NAME"),
            sa.column("VARIABLE_VALUE"),
            schema="information_schema",
        )
        uptime = (
            sa.select(sa.type_coerce(status.c.VARIABLE_VALUE, sa.Double()))
            .where(status.c.VARIABLE_NAME == "UPTIME")
            .scalar_subquery()
        )
        return db_now() - uptime

    def session_gone(self, holders: sa.Table) -> Any:
        """The holder's lock is free, on the very server it last renewed on (the same start,
        ``Uptime`` ago): its process died, or its connection was cut; not a restart, nor a
        failover to a replica, which ended every session."""
        h = holders
        lock = sa.func.concat(SESSION_LOCK_PREFIX, h.c.session)
        # Uptime counts whole seconds: one start, read at two moments, differs by under 2 s.
        same_server = sa.func.abs(h.c.server - self.server_started()) < 2
        return sa.and_(sa.func.is_used_lock(lock).is_(None), same_server)

    # -- statement forms ---------------------------------------------------------------------

    def live_key_index(self, table_name: str, live: sa.TextClause) -> tuple[Any, ...]:
        # No partial indexes: a unique index on a generated column that holds the key while
        # the job holds it, NULL otherwise.
        return (
            sa.Column(
                "live_key",
                sa.String(255),
                sa.Computed(f"CASE WHEN {live.text} THEN lease_key END", persisted=True),
            ),
            sa.Index(f"ix_{table_name}_live_key", "live_key", unique=True),
        )

    def holds_key(self, table: sa.Table, key: Any, live_states: Any) -> Any:
        # One lookup in the generated live_key's unique index. The general condition would
        # read (and, in an UPDATE under REPEATABLE READ, lock) every live job through an
        # index merge.
        return table.c.live_key == sa.bindparam(key.key, type_=table.c.live_key.type)

    def insert_unless_exists(self, table: sa.Table, values: dict[str, Any]) -> Any:
        # A plain INSERT whose duplicate-key error ``inserted`` reads as "exists": INSERT
        # IGNORE would also turn a value the column cannot hold into a warning and a truncated
        # row, and ON DUPLICATE KEY UPDATE reports 1 row either way under FOUND_ROWS.
        return sa.insert(table).values(values)

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
        upsert = mysql.insert(table).from_select(columns, select)
        incoming = upsert.inserted
        changes = update(incoming) if update else {c: incoming[c] for c in columns if c != key}
        # MySQL evaluates the assignments left to right, each seeing the ones before: those
        # that read the row's old values come first (``update`` orders them).
        return upsert.on_duplicate_key_update(list(changes.items()))

    # -- reading a write's outcome -----------------------------------------------------------

    def written_rows(
        self, c: Any, statement: Any, params: dict[str, Any], read_back: Any
    ) -> list[tuple[Any, ...]]:
        if c.execute(statement, params).rowcount < 1:
            return []
        return list(c.execute(read_back, params).all())

    def inserted(
        self, c: Any, statement: Any, params: dict[str, Any], *, key_taken: Callable[[Any], bool]
    ) -> bool:
        try:
            c.execute(statement, params)
        except sa.exc.IntegrityError as exc:
            if self.duplicate_key(exc.orig) and not key_taken(exc):
                return False
            raise
        return True

    def upserted(self, c: Any, statement: Any, params: dict[str, Any]) -> bool:
        return bool(c.execute(statement, params).rowcount)

    # -- a caller's transaction --------------------------------------------------------------

    def bounds_idle(self, sa_dialect: Any) -> bool:
        return bool(getattr(sa_dialect, "is_mariadb", False))

    def guard_idle_writes(self, connection: Any, seconds: int) -> bool:
        """MariaDB has no transaction-local setting: the session keeps the bound while it is
        the caller's, and gets the server's default back when it returns to its pool (MySQL
        has no such setting)."""
        if not self.bounds_idle(connection.dialect):
            return False
        connection.exec_driver_sql(f"SET SESSION idle_write_transaction_timeout = {seconds}")
        return True

    def unguard_sql(self) -> str | None:
        return "SET SESSION idle_write_transaction_timeout = DEFAULT"

    # -- errors ------------------------------------------------------------------------------

    def duplicate_key(self, orig: Any) -> bool:
        return bool(_code(orig) == DUPLICATE_ENTRY)

    def error_kind(self, orig: Any) -> str | None:
        if not type(orig).__module__.startswith(_DRIVERS):
            return None
        code = _code(orig)
        if code in CONFLICT_CODES:
            return "conflict"
        if code in REFUSED_CODES:
            return "refused"
        return None

    def waited_out(self, orig: Any) -> bool:
        driver = type(orig).__module__.startswith(_DRIVERS)
        return driver and bool(_code(orig) == LOCK_WAIT_TIMEOUT)

    def ended_idle_transaction(self, orig: Any) -> bool:
        driver = type(orig).__module__.startswith(_DRIVERS)
        return driver and bool(_code(orig) in SERVER_CLOSED_CONNECTION)

    # -- migrations --------------------------------------------------------------------------

    @contextlib.contextmanager
    def migration_lock(self, connection: sa.Connection, table: str) -> Iterator[None]:
        name = f"leases_migrate:{table}"
        got = connection.execute(sa.select(sa.func.get_lock(name, 60))).scalar()
        if got != 1:
            raise ConfigurationError(f"another process has been migrating {table} for 60 s")
        try:
            yield
        finally:
            connection.execute(sa.select(sa.func.release_lock(name)))
            connection.commit()

    def add_column_sql(self, sa_dialect: Any, table: str, spec: str) -> list[str]:
        if self.bounds_idle(sa_dialect):  # MariaDB
            alter = f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {spec}"
            return [f"SET STATEMENT lock_wait_timeout=5 FOR {alter}"]
        return super().add_column_sql(sa_dialect, table, spec)


def _code(orig: Any) -> Any:
    return (getattr(orig, "args", None) or (None,))[0]


__all__ = ["SESSION_LOCK_PREFIX", "MySQL"]
