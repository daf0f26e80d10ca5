"""Per-call cost of ``self.checkpoint(state)`` against the bare UPDATE a user would write.

For each database (PostgreSQL, MariaDB, SQLite) and each checkpoint size (~100 B and ~10 KB of
JSON), two sides alternate in blocks, the order turning every round, so drift on a shared
machine hits both:

- ``lease``: the library's checkpoint as a task's ``self.checkpoint(state)`` runs it
  (``LeasedTask.checkpoint`` -> ``celery_leases.checkpoint.save`` -> ``Store.checkpoint``),
  with no Celery worker: a job recorded and claimed through the store as a worker's attempt
  claims it (bound to a keeper's holder row), its ``Lease`` made current with
  ``lease.holding``, then ``task.checkpoint(state)`` of a LeasedTask of an app pointed at
  the scratch table. It runs on the store's own direct connection, in autocommit.
- ``bare``: what a user would write instead: ``json.dumps(state)`` (the library's separators,
  so the rows are the same size), then ONE autocommit ``UPDATE <table> SET checkpoint = ?
  WHERE id = ?`` of a row of its own in the same table, on a connection of its own opened
  with the same driver (psycopg 3, PyMySQL, sqlite3; SQLite with ``synchronous=NORMAL`` as
  the store sets it).

Each call saves a state of its own, the same for both sides: ``{"done": "<counter>",
"cursor": "<random hex>"}`` (a counter of fixed width, so every UPDATE changes its row: MariaDB
skips an UPDATE that changes nothing, and then commits nothing). Printed per case:
median and p90 of each side in microseconds and lease/bare (medians); the load average at the
start and the end; the round trips of each side, counted at the driver after the timing
(libpq's protocol trace: ``ReadyForQuery`` messages; PyMySQL: commands sent; SQLite:
statements its trace callback sees), with the statements the store ran (``Driver.execute``)
and any through SQLAlchemy's engine (``before_cursor_execute``). After the timing each
side's row is read back and checked.

``--parts`` adds a breakdown of each call, timed with ``time.perf_counter`` around the
driver's ``cursor.execute`` and the fetch of its rows (a thin proxy of the DBAPI connection,
on both sides), in another interleaved run: ``before`` the Python before it (the library's:
encoding, checks, settings, taking the connection, compiling the parameters; the bare side's:
``json.dumps`` and the cursor), ``execute`` the statement (its round trip and the driver's
work; SQLite finishes a statement with RETURNING, and commits, while its rows are fetched),
``after`` the Python after it (the library's: the result, giving the connection back,
metrics, the lease's bookkeeping, the signal).

    python -m bench.checkpoint [--quick] [--parts] [--database postgres mariadb sqlite]
        [--size 100 10000]
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from celery import Celery

from bench.common import available, interleaved, parser, print_rows, report, row, scratch, steady
from bench.operations import claim, keeper_session, register, renew_holder, round_trips
from celery_leases import LeasedTask
from celery_leases.db.store import Store
from celery_leases.lease import Lease, holding
from tests.support.driver import direct_connection, executed

DATABASES = ("postgres", "mariadb", "sqlite")
#: The database's name in ``bench.operations``' driver counting.
DIALECT = {"postgres": "postgresql", "mariadb": "mariadb", "sqlite": "sqlite"}
SIZES = (100, 10_000)
HOLDER = "bench-keeper"
COLUMNS = (
    "database size_B calls lease_us lease_p90_us bare_us bare_p90_us lease/bare "
    "round_trips_lease round_trips_bare"
)
PART_COLUMNS = "database size_B side before_us execute_us after_us total_us"


def states_of(size: int, count: int) -> list[dict[str, str]]:
    """``count`` checkpoint states whose JSON is ``size`` bytes each, each one different (a
    counter first; MariaDB skips an UPDATE that changes nothing: no write, no commit to
    flush), the rest random hex (little to compress)."""
    cursor = os.urandom(size).hex()[: size - 31]
    return [{"done": f"{i:08d}", "cursor": cursor} for i in range(count)]


def encoded(state: Any) -> str:
    """The bare side's JSON: ``json.dumps`` with the library's separators (same row size)."""
    return json.dumps(state, separators=(",", ":"), ensure_ascii=False)


def us(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e6


def p90_us(seconds: Sequence[float]) -> float:
    return statistics.quantiles(seconds, n=10)[-1] * 1e6


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- the bare side -------------------------------------------------------------------------


def bare_connection(db: str, url: str) -> Any:
    """A connection of the bare side's own, with the store's driver, in autocommit."""
    u = sa.engine.make_url(url)
    if db == "postgres":
        import psycopg

        return psycopg.connect(
            host=u.host,
            port=u.port or 5432,
            user=u.username,
            password=u.password,
            dbname=u.database,
            autocommit=True,
        )
    if db == "mariadb":
        import pymysql

        return pymysql.connect(
            host=u.host,
            port=u.port or 3306,
            user=u.username,
            password=u.password or "",
            database=u.database,
            autocommit=True,
        )
    conn = sqlite3.connect(str(u.database), timeout=30, isolation_level=None)
    conn.execute("PRAGMA synchronous=NORMAL")  # as the store sets it (WAL is the file's)
    return conn


def bare_update(
    db: str, conn: Any, table: str, row_id: str, states: Sequence[Any]
) -> Callable[[int], None]:
    """The user's checkpoint of ``states[i]``: its JSON, then one autocommit UPDATE of
    ``row_id``."""
    p = "?" if db == "sqlite" else "%s"
    sql = f"UPDATE {table} SET checkpoint = {p} WHERE id = {p}"

    def call(i: int) -> None:
        text = encoded(states[i])
        cursor = conn.cursor()
        cursor.execute(sql, (text, row_id))
        cursor.close()

    return call


# -- the timing of --parts -----------------------------------------------------------------


class Marks:
    """When the last ``cursor.execute`` started and when it (or the fetch of its rows)
    returned, and how many ran."""

    def __init__(self) -> None:
        self.sent = self.back = 0.0
        self.count = 0


class TimedCursor:
    def __init__(self, cursor: Any, marks: Marks) -> None:
        self._cursor = cursor
        self._marks = marks

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        marks = self._marks
        marks.count += 1
        marks.sent = time.perf_counter()
        try:
            return self._cursor.execute(*args, **kwargs)
        finally:
            marks.back = time.perf_counter()

    def fetchall(self) -> Any:
        # SQLite runs a statement with RETURNING to its end (and commits) while its rows
        # are fetched: the fetch is part of the statement's time (psycopg and PyMySQL have
        # read the rows at execute).
        try:
            return self._cursor.fetchall()
        finally:
            self._marks.back = time.perf_counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


class TimedConnection:
    """A DBAPI connection whose cursors note their ``execute`` in ``marks``."""

    def __init__(self, conn: Any, marks: Marks) -> None:
        self._conn = conn
        self._marks = marks

    def cursor(self, *args: Any, **kwargs: Any) -> TimedCursor:
        return TimedCursor(self._conn.cursor(*args, **kwargs), self._marks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@contextlib.contextmanager
def timed_store(store: Store, marks: Marks) -> Iterator[None]:
    """The store's direct connection behind a :class:`TimedConnection` for the block."""
    (direct,) = store.db.direct._idle
    original = direct._dbapi_connection
    direct._dbapi_connection = TimedConnection(original, marks)
    try:
        yield
    finally:
        direct._dbapi_connection = original


def parted(call: Callable[[int], Any], marks: Marks, out: list[tuple[float, float, float]]) -> Any:
    """``call`` noting (before, execute, after) of its one statement in ``out``."""

    def timed(i: int) -> None:
        marks.count = 0
        started = time.perf_counter()
        call(i)
        ended = time.perf_counter()
        if marks.count != 1:
            raise RuntimeError(f"{marks.count} statements in one call, not one")
        out.append((marks.sent - started, marks.back - marks.sent, ended - marks.back))

    return timed


# -- the measurement -----------------------------------------------------------------------


def leased_task(url: str, table: str) -> Any:
    """A LeasedTask of an app of its own, its leases in ``table`` of ``url`` (no worker, no
    broker: it is only called for its ``checkpoint``): the task itself, as a running task's
    ``self`` is, not the proxy ``@app.task`` returns before the app is finalized (each of
    whose attribute reads costs a lookup more: ~4 us a call here)."""
    app = Celery("bench_checkpoint", set_as_current=False)
    app.conf.update(broker_url="memory://", leases_database_url=url, leases_table=table)

    @app.task(base=LeasedTask, bind=True, shared=False, name="bench.checkpoint.noop")
    def noop(self: Any) -> None:
        return None

    app.finalize()
    return app.tasks[noop.name]


def measure(
    db: str, url: str, sizes: Sequence[int], *, calls: int, block: int, parts: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``db`` at ``url``, and those of ``--parts``."""
    rows, part_rows = [], []
    with scratch(url, "ckpt") as table:
        task = leased_task(url, table)
        store: Store = task.lease_store
        settings = store.settings
        session = keeper_session(store)
        renew_holder(store, HOLDER, session)  # a worker's keeper makes it before its claims
        for job_id in ("lease-row", "bare-row"):
            register(store, job_id)
        token = claim(store, "lease-row", HOLDER)
        claim(store, "bare-row", HOLDER)  # the same row shape as the lease's
        lease = Lease(
            "lease-row", token, 1, None, "bench@host/1", settings.duration,
            settings.renew_interval, stall_timeout=settings.stall_timeout,
        )  # fmt: skip
        lease.carry(settings, store)  # as an attempt's claim does
        bare = bare_connection(db, url)
        engine_statements: list[str] = []
        sa.event.listen(
            store.engine, "before_cursor_execute", lambda *a: engine_statements.append(a[2])
        )
        try:
            with holding(lease):
                for size in sizes:
                    # One state per call: the timed calls', the one counted, the warm-up's.
                    states = states_of(size, calls + 21)

                    def leased(i: int, states: Sequence[Any] = states) -> None:
                        task.checkpoint(states[i])

                    def user_on(conn: Any, states: Sequence[Any] = states) -> Any:
                        return bare_update(db, conn, table, "bare-row", states)

                    rows.append(
                        case(db, store, table, bare, states, leased, user_on(bare),
                             engine_statements, calls=calls, block=block)
                    )  # fmt: skip
                    if parts:
                        part_rows += breakdown(
                            db, store, bare, leased, user_on, len(encoded(states[0])),
                            calls=calls, block=block,
                        )  # fmt: skip
        finally:
            bare.close()
            session.close()
            store.engine.dispose()
    return rows, part_rows


def case(
    db: str,
    store: Store,
    table: str,
    bare: Any,
    states: Sequence[Any],
    leased: Callable[[int], None],
    user: Callable[[int], None],
    engine_statements: list[str],
    *,
    calls: int,
    block: int,
) -> dict[str, Any]:
    """One database and size: the two sides interleaved, their round trips counted."""
    text = encoded(states[calls])  # the counted call's, the last written
    for i in range(calls + 1, calls + 21):  # connections, compiled and prepared statements
        leased(i)
        user(i)
    times = interleaved({"lease": steady(leased), "bare": steady(user)}, calls=calls, block=block)
    # Counted after the timing (psycopg prepares a statement at its sixth run: one more round
    # trip that once): at the driver, and the statements the store ran on any of its
    # connections, and any through SQLAlchemy's engine.
    counted = DIALECT[db]
    del engine_statements[:]
    with executed() as ran:
        lease_trips = round_trips(counted, direct_connection(store), lambda: leased(calls))
    bare_trips = round_trips(counted, bare, lambda: user(calls))
    unit = "statement(s), in process" if db == "sqlite" else "round trip(s)"
    print(
        f"  {db} {len(text)} B, {unit} per call: lease {lease_trips} ({len(ran)} statement(s) "
        f"by the store, {len(engine_statements)} through SQLAlchemy's engine), "
        f"bare {bare_trips}",
        flush=True,
    )
    if lease_trips != bare_trips or len(ran) != 1 or engine_statements:
        print(
            f"  NOTE: the lease side makes {lease_trips} round trip(s) and "
            f"{len(ran) + len(engine_statements)} statement(s) a call, the bare side "
            f"{bare_trips}: not one for one",
            flush=True,
        )
    check(store, table, text)
    lib, raw = times["lease"], times["bare"]
    print(f"  {db} {len(text)} B: lease {us(lib):.0f} us vs bare {us(raw):.0f} us", flush=True)
    values = (
        db, len(text), calls, us(lib), p90_us(lib), us(raw), p90_us(raw), us(lib) / us(raw),
        lease_trips, bare_trips,
    )  # fmt: skip
    return row(COLUMNS, *values)


def breakdown(
    db: str,
    store: Store,
    bare: Any,
    leased: Callable[[int], None],
    user_on: Callable[[Any], Callable[[int], None]],
    size: int,
    *,
    calls: int,
    block: int,
) -> list[dict[str, Any]]:
    """``--parts``: (before, execute, after) of each side's calls, interleaved again."""
    marks = Marks()
    seen: dict[str, list[tuple[float, float, float]]] = {"lease": [], "bare": []}
    user_timed = user_on(TimedConnection(bare, marks))

    @contextlib.contextmanager
    def lease_block() -> Iterator[Callable[[int], Any]]:
        with timed_store(store, marks):
            yield parted(leased, marks, seen["lease"])

    variants = {"lease": lease_block, "bare": steady(parted(user_timed, marks, seen["bare"]))}
    interleaved(variants, calls=calls, block=block)
    result = []
    for side, parts in seen.items():
        before, execute, after = (list(p) for p in zip(*parts, strict=True))
        totals = [sum(p) for p in parts]
        result.append(
            row(PART_COLUMNS, db, size, side, us(before), us(execute), us(after), us(totals))
        )
    return result


def check(store: Store, table: str, text: str) -> None:
    """Both rows hold ``text``: the lease's saved by the library, the bare one's UPDATE."""
    with store.engine.connect() as c:
        found = dict(c.execute(sa.text(f"SELECT id, checkpoint FROM {table}")).all())  # type: ignore[arg-type]
    if found.get("lease-row") != text or found.get("bare-row") != text:
        raise RuntimeError("a side's checkpoint was not saved")


def main(argv: Sequence[str] | None = None) -> None:
    command = parser(__doc__)
    command.add_argument("--database", nargs="+", choices=DATABASES, default=DATABASES)
    command.add_argument("--size", nargs="+", type=int, choices=SIZES, default=SIZES)
    command.add_argument("--parts", action="store_true", help="before/execute/after breakdown")
    args = command.parse_args(argv)
    calls, block = (300, 25) if args.quick else (3000, 100)
    started = load()
    print(f"load average at the start: {started}", flush=True)
    rows: list[dict[str, Any]] = []
    part_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as folder:
        urls = {
            "postgres": available("postgres") if "postgres" in args.database else None,
            "mariadb": available("mariadb") if "mariadb" in args.database else None,
            "sqlite": f"sqlite:///{folder}/leases.sqlite3",
        }
        for db in DATABASES:
            url = urls[db]
            if url and db in args.database:
                print(f"{db}: {calls} calls per side and size, blocks of {block}...", flush=True)
                found, parted_rows = measure(
                    db, url, args.size, calls=calls, block=block, parts=args.parts
                )
                rows += found
                part_rows += parted_rows
    ended = load()
    print(f"load average at the end: {ended}", flush=True)
    if part_rows:
        title = "--parts: median us of each part of a call (medians do not add up to the total)"
        print_rows(title, part_rows)
    title = "self.checkpoint(state) vs a bare autocommit UPDATE (median and p90, us)"
    report(
        "checkpoint", rows, quick=args.quick, title=title, block=block, load_start=started,
        load_end=ended, parts=part_rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
