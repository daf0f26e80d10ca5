"""Per-operation cost of the store against a raw baseline on the same DBAPI connection.

Claim, renew (one lease), checkpoint (100 B, 10 KB, 1 MB) and finish, timed as the library
calls them, alternate in blocks with the same work sent by hand through the same DBAPI
connection (the store's direct connection, ``celery_leases/direct.py``), as many statements
and round trips as the library sends (counted at the driver): on PostgreSQL and SQLite ONE
single-row autocommit UPDATE; on MariaDB, for claim and renew (no RETURNING there: they read
their row back), BEGIN, UPDATE, SELECT by primary key, COMMIT. Medians and p90 in ms.
This module is the one place in bench/ that calls the Store ("store calls" below).

    python -m bench.operations [--quick] [--database postgresql mariadb sqlite]
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from bench.common import (
    available,
    interleaved,
    median_ms,
    p90_ms,
    parser,
    report,
    row,
    scratch,
    steady,
)
from celery_leases import migrations
from celery_leases.config import DEFAULTS, validate
from celery_leases.store import Store
from tests.support.driver import direct_connection, is_control, traced
from tests.support.message import job_message

Call = Callable[[int], Any]
Statements = Callable[[int], list[tuple[str, tuple[Any, ...]]]]

# -- store calls: the only place in bench/ that calls the Store ----------------------------

OWNER, TASK = "bench@host/1", "bench.noop"


def open_store(url: str, table: str, **settings: Any) -> Store:
    """A Store of its own for ``table`` in ``url``, schema created; ``settings`` override."""
    store = Store(validate(DEFAULTS | {"database_url": url, "table": table} | settings))
    migrations.upgrade(store)
    return store


def engine(store: Store) -> sa.engine.Engine:
    return store.engine


_messages: dict[str, Any] = {}


def register(store: Store, job_id: str) -> None:
    """Record a job the way a client publishing it would (a protocol-2 message)."""
    _messages[job_id] = job_message(job_id, TASK)
    store.register(_messages[job_id])


def claim(store: Store, job_id: str) -> int:
    """Claim a registered job, delivered as recorded, for the store's lease duration; the
    fencing token."""
    outcome = store.claim(_messages[job_id], owner=OWNER, duration=store.settings.duration)
    token = getattr(outcome, "token", None)
    if token is None:
        raise RuntimeError(f"claim of {job_id} refused: {outcome}")
    return int(token)


def renew(store: Store, leases: list[tuple[str, int]]) -> None:
    """One renew tick of ``leases`` (job id, token), every one still held."""
    if len(store.renew(leases).held) != len(leases):
        raise RuntimeError("a renewed lease was lost")


def checkpoint(store: Store, job_id: str, token: int, state: str) -> None:
    if not store.checkpoint(job_id, token, state)[0]:
        raise RuntimeError(f"checkpoint of {job_id} refused")


def finish(store: Store, job_id: str, token: int) -> None:
    if not store.finish(job_id, token, result="null"):
        raise RuntimeError(f"finish of {job_id} refused")


# -- the measurement ----------------------------------------------------------------------

#: The baseline's rows: one for checkpoints (its text grows as the library's does), one for
#: the rest (SQLite rewrites a whole record, so a 1 MB checkpoint would weigh on later UPDATEs).
RAW_ROWS = ("raw-row", "raw-checkpoint")
SIZES = {"100 B": 100, "10 KB": 10 * 1024, "1 MB": 1024 * 1024 - 64}
COLUMNS = "database operation calls library_ms raw_ms library/raw library_p90_ms raw_p90_ms"
COLUMNS += " round_trips_library round_trips_raw"


def state_text(size: int) -> str:
    """A JSON checkpoint of ``size`` bytes (random hex: little for compression to gain)."""
    return '{"cursor":"' + os.urandom(size // 2).hex()[: size - 13] + '"}'


@contextlib.contextmanager
def raw(conn: Any, sent: Statements, transaction: bool) -> Iterator[Call]:
    """A call that sends ``sent(i)`` through ``conn``'s cursor (in autocommit, as the store's
    direct connection is), between BEGIN and COMMIT if the store's operation is a
    transaction."""

    def call(i: int) -> None:
        cursor = conn.cursor()
        if transaction:
            cursor.execute("BEGIN")
        for sql, params in sent(i):
            cursor.execute(sql, params)
            if cursor.description is not None:
                cursor.fetchall()
        if transaction:
            cursor.execute("COMMIT")
        cursor.close()

    yield call


def shape(store: Store, call: Callable[[], Any]) -> tuple[int, bool]:
    """How many statements ``call`` sends on the store's direct connection, and whether in
    a transaction (seen at the driver)."""
    with traced(store) as seen:
        call()
    statements = [s for s in seen if not is_control(s)]
    return len(statements), len(statements) < len(seen)


def round_trips(db: str, conn: Any, call: Callable[[], Any]) -> int:
    """Round trips ``call`` makes on ``conn``, counted at the driver: ReadyForQuery messages
    in libpq's trace, PyMySQL's commands, statements SQLite's trace callback sees."""
    if db == "postgresql":
        with tempfile.TemporaryFile("w+") as trace:
            conn.pgconn.trace(os.dup(trace.fileno()))  # libpq keeps a FILE on the descriptor
            try:
                call()
            finally:
                conn.pgconn.untrace()
            trace.seek(0)
            return sum("ReadyForQuery" in line for line in trace)
    seen: list[Any] = []
    with contextlib.ExitStack() as undo:
        if db == "sqlite":
            conn.set_trace_callback(seen.append)
            undo.callback(conn.set_trace_callback, None)
        else:
            cls = type(conn)
            original = cls._execute_command

            def spy(self: Any, command: int, sql: Any) -> Any:
                seen.append(command)
                return original(self, command, sql)

            cls._execute_command = spy
            undo.callback(setattr, cls, "_execute_command", original)
        call()
    return len(seen)


def measure(db: str, url: str, *, calls: int, block: int, big_calls: int) -> list[dict[str, Any]]:
    """One row per operation on the database at ``url`` (``db``: its name)."""
    rows = []
    with scratch(url, "ops") as table:
        store = open_store(url, table)
        ids = [f"job-{i}" for i in range(calls + 2)]  # the last two: shape and round trips
        for job_id in [*ids, "held", *RAW_ROWS]:
            register(store, job_id)
        held = ("held", claim(store, "held"))
        for job_id in RAW_ROWS:
            claim(store, job_id)
        conn = direct_connection(store)
        p = "?" if db == "sqlite" else "%s"

        def compare(name: str, library: Call, state: str | None = None) -> None:
            statements, transaction = shape(store, lambda: library(calls))
            raw_row = RAW_ROWS[state is not None]
            sets = f"renewed_at = {p}" + ("" if state is None else f", checkpoint = {p}")
            update = f"UPDATE {table} SET {sets} WHERE id = {p}"
            select = (f"SELECT token FROM {table} WHERE id = {p}", (raw_row,))

            def sent(i: int) -> list[tuple[str, tuple[Any, ...]]]:
                values = (float(i),) if state is None else (float(i), state)
                return [(update, (*values, raw_row)), *[select] * (statements - 1)]

            def baseline() -> contextlib.AbstractContextManager[Call]:
                return raw(conn, sent, transaction)

            library_trips = round_trips(db, conn, lambda: library(calls + 1))
            with baseline() as call:
                raw_trips = round_trips(db, conn, lambda: call(calls + 1))
            n = big_calls if state and len(state) > 100_000 else calls
            times = interleaved(
                {"library": steady(library), "raw": baseline}, calls=n, block=min(block, n // 4)
            )
            lib, base = median_ms(times["library"]), median_ms(times["raw"])
            print(f"  {db} {name}: {lib:.3f} vs {base:.3f} ms", flush=True)
            p90 = p90_ms(times["library"]), p90_ms(times["raw"])
            values = (db, name, n, lib, base, lib / base, *p90, library_trips, raw_trips)
            rows.append(row(COLUMNS, *values))

        tokens: dict[int, int] = {}
        compare("claim", lambda i: tokens.__setitem__(i, claim(store, ids[i])))
        compare("renew", lambda i: renew(store, [held]))
        for label, size in SIZES.items():
            text = state_text(size)

            def write(i: int, text: str = text) -> None:
                checkpoint(store, *held, text)

            compare(f"checkpoint {label}", write, text)
        compare("finish", lambda i: finish(store, ids[i], tokens[i]))
        engine(store).dispose()
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    command = parser(__doc__)
    command.add_argument(
        "--database",
        nargs="+",
        choices=("postgresql", "mariadb", "sqlite"),
        default=("postgresql", "mariadb", "sqlite"),
    )
    args = command.parse_args(argv)
    calls, block, big = (200, 25, 20) if args.quick else (1000, 50, 100)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-operations-") as folder:
        sqlite = f"sqlite:///{folder}/leases.sqlite3"
        urls = {"postgresql": available("postgres"), "mariadb": available("mariadb")}
        for db, url in (urls | {"sqlite": sqlite}).items():
            if url and db in args.database:
                print(f"{db}: {calls} calls per operation and side (1 MB: {big})...", flush=True)
                rows += measure(db, url, calls=calls, block=block, big_calls=big)
    title = "Store operations vs the raw baseline on the same connection (median ms)"
    report("operations", rows, quick=args.quick, title=title, block=block)


if __name__ == "__main__":
    main()
