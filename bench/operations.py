"""Per-operation cost of the store against a raw baseline on the same DBAPI connection.

Claim, renew (one lease), checkpoint (100 B, 10 KB, 1 MB) and finish, timed as the library
calls them, alternate in blocks with the same work sent by hand through the same DBAPI
connection (the store's direct connection, ``celery_leases/db/dbapi.py``), as many statements
and round trips as the library sends (counted at the driver): on PostgreSQL and SQLite ONE
single-row autocommit UPDATE; on MariaDB, for claim and renew (no RETURNING there: they read
their row back), BEGIN, UPDATE, SELECT by primary key, COMMIT. Medians and p90 in ms.

A third variant, ``same``, sends the library's own statements (their text and parameters, read
at the driver during one library call, for rows of its own) by hand on the same connection:
``library/same`` is the library's Python around its statements, ``same/raw`` what the
statement itself costs the database more than the one-column baseline (the floor).
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
from celery_leases.db import migrations
from celery_leases.db.store import Store
from celery_leases.settings import DEFAULTS, validate
from tests.support.driver import direct_connection, executed, is_control, traced
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
COLUMNS += " same_ms library/same same/raw round_trips_library round_trips_raw"


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


def same_statements(
    store: Store, once: Callable[[], Any], calls: int, rows: Callable[[int], dict[str, Any]]
) -> Callable[[int], list[tuple[str, Any]]]:
    """What one library call (``once``) sent, made ready by hand for ``calls`` calls, the
    i-th with the parameters ``rows(i)`` changes (its own row): each call's SQL and driver
    parameters, built before the timing."""
    with executed() as seen:
        once()
    ready = [
        [compiled.parameters({**params, **rows(i)}) for _, compiled, params in seen]
        for i in range(calls)
    ]
    return lambda i: ready[i]


def same_rows(store: Store, table: str, column: str) -> dict[str, Any]:
    """``column`` of each row of the ``same`` variant, by id."""
    with store.engine.connect() as connection:
        query = f"SELECT id, {column} FROM {table} WHERE id LIKE 'same-%'"
        return dict(connection.execute(sa.text(query)).tuples().all())


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

        def compare(
            name: str, library: Call, state: str | None = None, *, same: Statements
        ) -> None:
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

            n = big_calls if state and len(state) > 100_000 else calls
            variants = {
                "library": steady(library),
                "raw": baseline,
                "same": lambda: raw(conn, same, transaction),
            }
            times = interleaved(variants, calls=n, block=min(block, n // 4))
            # Counted after the timing: a statement psycopg prepares (at its sixth run on a
            # connection) takes one more round trip that once.
            library_trips = round_trips(db, conn, lambda: library(calls + 1))
            with baseline() as call:
                raw_trips = round_trips(db, conn, lambda: call(calls + 1))
            lib, base, again = (median_ms(times[v]) for v in ("library", "raw", "same"))
            print(f"  {db} {name}: {lib:.3f} vs {base:.3f} ms (same: {again:.3f})", flush=True)
            p90 = p90_ms(times["library"]), p90_ms(times["raw"])
            values = (
                db, name, n, lib, base, lib / base, *p90, again, lib / again, again / base,
                library_trips, raw_trips,
            )  # fmt: skip
            rows.append(row(COLUMNS, *values))

        # The rows the ``same`` variant claims and finishes (one each per call), and the
        # probes whose library calls give it the statements.
        fresh = [f"same-{i}" for i in range(calls + 1)]
        for job_id in [*fresh, "probe-claim", "probe-finish"]:
            register(store, job_id)
        versions = same_rows(store, table, "version")
        claim_rows = same_statements(
            store,
            lambda: claim(store, "probe-claim"),
            calls,
            lambda i: {"b_id": fresh[i], "b_version": versions[fresh[i]]},
        )
        unchanged = same_statements(store, lambda: renew(store, [held]), calls, lambda i: {})

        tokens: dict[int, int] = {}
        compare("claim", lambda i: tokens.__setitem__(i, claim(store, ids[i])), same=claim_rows)
        compare("renew", lambda i: renew(store, [held]), same=unchanged)
        for label, size in SIZES.items():
            text = state_text(size)

            def write(i: int, text: str = text) -> None:
                checkpoint(store, *held, text)

            n = big_calls if size > 100_000 else calls
            same = same_statements(store, lambda: write(0), n, lambda i: {})
            compare(f"checkpoint {label}", write, text, same=same)
        # The same variant's rows, claimed by its claims above (each once: token 1).
        fresh_tokens = same_rows(store, table, "token")
        if sorted(fresh_tokens.values()) != [0] + [1] * calls:  # same-<calls> is never claimed
            raise RuntimeError("the same variant's claims did not all claim their row")
        probe = claim(store, "probe-finish")
        finish_rows = same_statements(
            store,
            lambda: finish(store, "probe-finish", probe),
            calls,
            lambda i: {"b_id": fresh[i], "b_token": fresh_tokens[fresh[i]]},
        )
        compare("finish", lambda i: finish(store, ids[i], tokens[i]), same=finish_rows)
        if list(same_rows(store, table, "state").values()).count("done") != calls:
            raise RuntimeError("the same variant's finishes did not all finish their row")
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
