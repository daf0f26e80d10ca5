"""Per-operation cost against the physical limit: claim, renew tick, checkpoint, finish.

For PostgreSQL, MariaDB and SQLite, each worker operation of the store is timed as the library
calls it (``Store.claim`` etc., SQLAlchemy included) next to, on the same connection:

- ``raw UPDATE``: a plain single-row ``UPDATE <table> SET renewed_at = ? WHERE id = ?`` then
  ``COMMIT`` through the DBAPI cursor: the physical limit of one durable write.
- ``same SQL``: the exact statement(s) the store sent (captured), replayed through the DBAPI
  cursor, then ``COMMIT``: what the database itself charges for the operation's SQL.
- ``no pre-ping``: the store with ``pool_pre_ping=False`` (a diagnostic: one round trip less).

Variants alternate in blocks (rotating order) so drift on a noisy machine hits all of them.
Also: statements, connection checkouts and commits per operation (SQLAlchemy events), a time
breakdown of each operation on PostgreSQL (ping, execute, commit, Python), and checkpoint cost
by state size.

    python -m bench.operations [--quick]
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from bench.common import (
    MARIADB_URL,
    POSTGRES_URL,
    StatementCounter,
    arguments,
    drop_tables,
    print_table,
    reachable,
    scratch_name,
    settings,
    sqlite_url,
    summary,
    write_result,
)
from celery_leases.schema import QUEUED, SCHEMA_VERSION
from celery_leases.store import Claimed, Store

OWNER = "bench@host/1"
DURATION = 30.0
OPERATIONS = ("claim", "renew", "checkpoint", "finish")
SIZES = {"100 B": 100, "10 KB": 10 * 1024, "1 MB": 1024 * 1024 - 64}


def state_text(size: int) -> str:
    """A JSON checkpoint of about ``size`` bytes (hex text: little for a compressor to gain)."""
    head = '{"cursor":"'
    body = (bytes(range(256)) * (size // 256 + 1)).hex()[: max(size - len(head) - 2, 1)]
    return head + body + '"}'


class Backend:
    """One database under test: a scratch table, the stores, and raw access to a connection."""

    def __init__(self, name: str, url: str, calls: int) -> None:
        self.name = name
        self.url = url
        self.calls = calls
        self.table = scratch_name("ops")
        self.store = Store(settings(url, self.table))
        self.store.ensure_schema()
        self.nopreping = Store(settings(url, self.table, engine_options={"pool_pre_ping": False}))
        self.nopreping._schema_ready = True
        self.t = self.store.table
        self.tokens: dict[str, int] = {}
        self._restore: Callable[[], None] | None = None
        self._insert_queued(["raw-row", *self._ids("lib"), *self._ids("raw"), *self._ids("npp")])
        self._insert_queued([f"hold-{kind}" for kind in ("lib", "raw", "npp")])
        analyze(self)
        for kind in ("lib", "raw", "npp"):
            claimed = self.store.claim(
                f"hold-{kind}",
                owner=OWNER,
                duration=DURATION,
                task="bench.noop",
                args="[]",
                kwargs="{}",
            )
            assert isinstance(claimed, Claimed)
            self.tokens[f"hold-{kind}"] = claimed.token

    def _ids(self, kind: str) -> list[str]:
        return [f"{kind}-{i}" for i in range(self.calls + 50)]

    def _insert_queued(self, ids: Sequence[str]) -> None:
        rows = [
            {
                "id": i,
                "task": "bench.noop",
                "args": "[]",
                "kwargs": "{}",
                "options": "{}",
                "state": QUEUED,
                "token": 0,
                "attempts": 0,
                "stalled_attempts": 0,
                "created_at": time.time(),
                "schema_version": SCHEMA_VERSION,
            }
            for i in ids
        ]
        with self.store.engine.begin() as connection:
            for start in range(0, len(rows), 1000):
                connection.execute(sa.insert(self.t), rows[start : start + 1000])

    # -- raw access ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def raw(self) -> Iterator[Any]:
        """The store's pooled DBAPI connection, checked out for one block of raw calls.

        With nothing else checked out, the store's next operation gets this same connection.
        """
        fairy = self.store.engine.raw_connection()
        try:
            yield fairy
        finally:
            if self._restore is not None:
                self._restore()
                self._restore = None
            fairy.close()

    def autocommit(self, fairy: Any) -> None:
        """Put the raw connection in autocommit mode until the end of the block."""
        conn = fairy.driver_connection
        if self.name == "postgresql":
            conn.autocommit = True
            self._restore = lambda: setattr(conn, "autocommit", False)
        elif self.name == "mariadb":
            conn.autocommit(True)
            self._restore = lambda: conn.autocommit(False)
        else:
            before = conn.isolation_level
            conn.isolation_level = None
            self._restore = lambda: setattr(conn, "isolation_level", before)

    def placeholder(self) -> str:
        return "?" if self.name == "sqlite" else "%s"

    def raw_update_sql(self) -> str:
        p = self.placeholder()
        return f"UPDATE {self.table} SET renewed_at = {p} WHERE id = {p}"

    def close(self) -> None:
        self.store.engine.dispose()
        self.nopreping.engine.dispose()
        drop_tables(self.url, self.table)


def capture(store: Store, call: Callable[[], Any]) -> tuple[list[tuple[str, Any]], dict[str, int]]:
    """The statements (SQL, DBAPI parameters) one call sends, and what it counted."""
    counter = StatementCounter(store.engine)
    try:
        call()
        return list(counter.last), counter.counts()
    finally:
        counter.close()


def replace_value(params: Any, old: Any, new: Any) -> Any:
    if isinstance(params, dict):
        return {k: (new if v == old else v) for k, v in params.items()}
    return type(params)(new if v == old else v for v in params)


def replay(fairy: Any, statements: list[tuple[str, Any]], fetch: bool = True) -> None:
    cursor = fairy.cursor()
    try:
        for sql, params in statements:
            cursor.execute(sql, params)
            if fetch and cursor.description is not None:
                cursor.fetchall()
    finally:
        cursor.close()
    fairy.commit()


def measure_operations(b: Backend, *, block: int) -> dict[str, Any]:
    """Time each operation next to the raw UPDATE and the same SQL, interleaved in blocks."""
    store, npp, calls = b.store, b.nopreping, b.calls
    raw_sql = b.raw_update_sql()
    results: dict[str, Any] = {}
    held: dict[str, Any] = {}

    def raw_update(fairy: Any) -> Callable[[int], None]:
        def call(i: int) -> None:
            cursor = fairy.cursor()
            cursor.execute(raw_sql, (float(i), "raw-row"))
            cursor.close()
            fairy.commit()

        return call

    def raw_autocommit(fairy: Any) -> Callable[[int], None]:
        # The same UPDATE in one round trip: no BEGIN, the server commits it (durably).
        b.autocommit(fairy)

        def call(i: int) -> None:
            cursor = fairy.cursor()
            cursor.execute(raw_sql, (float(i), "raw-row"))
            cursor.close()

        return call

    def claim_call(s: Store, kind: str) -> Callable[[int], Any]:
        return lambda i: s.claim(
            f"{kind}-{i}", owner=OWNER, duration=DURATION, task="bench.noop", args="[]", kwargs="{}"
        )

    # What each operation sends, captured on spare jobs (also the statements per operation).
    spare = b.calls + 10
    sent: dict[str, list[tuple[str, Any]]] = {}
    counts: dict[str, dict[str, int]] = {}
    sent["claim"], counts["claim"] = capture(store, lambda: claim_call(store, "lib")(spare))
    hold = ("hold-lib", b.tokens["hold-lib"])
    sent["renew"], counts["renew"] = capture(store, lambda: store.renew([hold]))
    small = state_text(SIZES["100 B"])
    sent["checkpoint"], counts["checkpoint"] = capture(
        store, lambda: store.checkpoint(hold[0], hold[1], small)
    )
    sent["finish"], counts["finish"] = capture(
        store, lambda: store.finish(f"lib-{spare}", 1, result="null")
    )
    proto_claim_id = f"lib-{spare}"
    proto_finish_id = f"lib-{spare}"

    def same_sql(op: str) -> Callable[[Any], Callable[[int], None]]:
        def make(fairy: Any) -> Callable[[int], None]:
            statements = sent[op]

            def call(i: int) -> None:
                if op in ("claim", "finish"):
                    old = proto_claim_id if op == "claim" else proto_finish_id
                    todo = [(sql, replace_value(p, old, f"raw-{i}")) for sql, p in statements]
                elif op in ("renew", "checkpoint"):
                    # The same lease as the library's, under another job: the raw row held.
                    todo = [
                        (
                            sql,
                            replace_value(
                                replace_value(p, "hold-lib", "hold-raw"),
                                b.tokens["hold-lib"],
                                b.tokens["hold-raw"],
                            ),
                        )
                        for sql, p in statements
                    ]
                replay(fairy, todo)

            return call

        return make

    def measure(op: str, library: Callable[[int], Any], nopre: Callable[[int], Any]) -> None:
        times = interleaved_with_raw(
            b,
            {"library": library, "no pre-ping": nopre},
            {"raw UPDATE": raw_update, "same SQL": same_sql(op), "raw autocommit": raw_autocommit},
            calls=calls,
            block=block,
        )
        results[op] = {name: summary(values) for name, values in times.items()}

    measure("claim", claim_call(store, "lib"), claim_call(npp, "npp"))
    # The statistics are from before the claims (all jobs queued): the plans a burst of work
    # after a quiet spell gets. Then fresh statistics, as autovacuum would take, for the rest.
    held["plans_stale_statistics"] = plans(b, {op: sent[op] for op in OPERATIONS})
    analyze(b)
    held["plans"] = plans(b, {op: sent[op] for op in OPERATIONS})
    hold_npp = ("hold-npp", b.tokens["hold-npp"])
    measure("renew", lambda i: store.renew([hold]), lambda i: npp.renew([hold_npp]))
    measure(
        "checkpoint",
        lambda i: store.checkpoint(hold[0], hold[1], small),
        lambda i: npp.checkpoint(hold_npp[0], hold_npp[1], small),
    )
    measure(
        "finish",
        lambda i: store.finish(f"lib-{i}", 1, result="null"),
        lambda i: npp.finish(f"npp-{i}", 1, result="null"),
    )
    held["statements"] = counts
    held["sql"] = {op: [sql for sql, _ in statements] for op, statements in sent.items()}
    return {"timings": results, **held}


def analyze(b: Backend) -> None:
    """Refresh the planner's statistics of the table (not on SQLite, which has none by
    default and where few applications run ANALYZE)."""
    if b.name == "sqlite":
        return
    with b.store.engine.begin() as connection:
        word = "ANALYZE" if b.name == "postgresql" else "ANALYZE TABLE"
        connection.execute(sa.text(f"{word} {b.table}"))


def plans(b: Backend, sent: dict[str, list[tuple[str, Any]]]) -> dict[str, Any]:
    """The plan of each operation's statements, and the indexes they use.

    PostgreSQL: ``EXPLAIN (ANALYZE, BUFFERS)`` in a transaction rolled back; MariaDB:
    ``EXPLAIN``; SQLite: ``EXPLAIN QUERY PLAN``.
    """
    prefix = {
        "postgresql": "EXPLAIN (ANALYZE, BUFFERS) ",
        "mariadb": "EXPLAIN ",
        "sqlite": "EXPLAIN QUERY PLAN ",
    }[b.name]
    out: dict[str, Any] = {}
    with b.raw() as fairy:
        for op, statements in sent.items():
            lines: list[str] = []
            chosen: list[str] = []  # what the plan uses (MariaDB: the "key" column only)
            for sql, params in statements:
                cursor = fairy.cursor()
                cursor.execute(prefix + sql, params)
                for row in cursor.fetchall():
                    lines.append(" ".join(str(v) for v in row))
                    chosen.append(str(row[5]) if b.name == "mariadb" else lines[-1])
                cursor.close()
                fairy.rollback()
            out[op] = {
                "plan": lines,
                "uses_expiry_index": any(f"ix_{b.table}_expiry" in c for c in chosen),
                "buffers": _buffers(lines),
            }
    return out


def _buffers(lines: list[str]) -> int | None:
    """Shared buffers the top node of a PostgreSQL plan touched (None elsewhere)."""
    for line in lines:
        if "Buffers: shared" in line:
            total = 0
            for part in line.split("Buffers: shared", 1)[1].split():
                name, _, number = part.partition("=")
                if number.isdigit() and name in ("hit", "read", "dirtied", "written"):
                    total += int(number) if name in ("hit", "read") else 0
            return total
    return None


def interleaved_with_raw(
    b: Backend,
    library_variants: dict[str, Callable[[int], Any]],
    raw_variants: dict[str, Callable[[Any], Callable[[int], None]]],
    *,
    calls: int,
    block: int,
) -> dict[str, list[float]]:
    """Like ``bench.common.interleaved``, but the raw variants run each block on the store's
    own pooled connection, checked out for the block (not timed) and returned after it."""
    names = [*library_variants, *raw_variants]
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    clock, cpu_clock = time.perf_counter, time.thread_time
    done = 0
    round_number = 0
    while done < calls:
        size = min(block, calls - done)
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            out, cpu_out = times[name], cpu[name]
            with contextlib.ExitStack() as stack:
                if name in raw_variants:
                    fairy = stack.enter_context(b.raw())
                    call = raw_variants[name](fairy)
                else:
                    call = library_variants[name]
                for i in range(done, done + size):
                    cpu_started = cpu_clock()
                    started = clock()
                    call(i)
                    out.append(clock() - started)
                    cpu_out.append(cpu_clock() - cpu_started)
        done += size
        round_number += 1
    for name in names:
        times[f"{name} CPU"] = cpu[name]
    return times


def measure_sizes(b: Backend, *, calls_by_size: dict[str, int], block: int) -> dict[str, Any]:
    """Checkpoint by state size: the library's call next to the same SQL and the raw UPDATE."""
    store = b.store
    hold = ("hold-lib", b.tokens["hold-lib"])
    raw_hold = ("hold-raw", b.tokens["hold-raw"])
    raw_sql = b.raw_update_sql()
    out: dict[str, Any] = {}
    for label, size in SIZES.items():
        text = state_text(size)

        def library(i: int, t: str = text) -> Any:
            return store.checkpoint(hold[0], hold[1], t)

        statements, _ = capture(store, lambda: library(0))
        todo = [
            (sql, replace_value(replace_value(p, hold[0], raw_hold[0]), hold[1], raw_hold[1]))
            for sql, p in statements
        ]

        def raw_update(fairy: Any) -> Callable[[int], None]:
            def call(i: int) -> None:
                cursor = fairy.cursor()
                cursor.execute(raw_sql, (float(i), "raw-row"))
                cursor.close()
                fairy.commit()

            return call

        def same_sql(fairy: Any, s: list[tuple[str, Any]] = todo) -> Callable[[int], None]:
            return lambda i: replay(fairy, s)

        times = interleaved_with_raw(
            b,
            {"library": library},
            {"raw UPDATE": raw_update, "same SQL": same_sql},
            calls=calls_by_size[label],
            block=block,
        )
        out[label] = {"bytes": len(text), **{n: summary(v) for n, v in times.items()}}
    return out


def breakdown(b: Backend, *, calls: int) -> dict[str, Any]:
    """Where one operation's time goes: pool ping, statement execution (BEGIN included on
    psycopg), commit, and the rest (Python: building the statement, SQLAlchemy, the pool)."""
    engine = b.store.engine
    dialect = engine.dialect
    spent = {"ping": 0.0, "execute": 0.0, "commit": 0.0}
    clock = time.perf_counter
    original_ping, original_commit = dialect.do_ping, dialect.do_commit

    def timed_ping(dbapi_connection: Any) -> Any:
        started = clock()
        try:
            return original_ping(dbapi_connection)
        finally:
            spent["ping"] += clock() - started

    def timed_commit(dbapi_connection: Any) -> Any:
        started = clock()
        try:
            return original_commit(dbapi_connection)
        finally:
            spent["commit"] += clock() - started

    marks: list[float] = []

    def before(*_: Any) -> None:
        marks.append(clock())

    def after(*_: Any) -> None:
        spent["execute"] += clock() - marks.pop()

    hold = ("hold-lib", b.tokens["hold-lib"])
    small = state_text(SIZES["100 B"])
    queued = [f"bd-{i}" for i in range(calls)]
    b._insert_queued(queued)
    operations: dict[str, Callable[[int], Any]] = {
        "claim": lambda i: b.store.claim(
            queued[i], owner=OWNER, duration=DURATION, task="bench.noop", args="[]", kwargs="{}"
        ),
        "renew": lambda i: b.store.renew([hold]),
        "checkpoint": lambda i: b.store.checkpoint(hold[0], hold[1], small),
        "finish": lambda i: b.store.finish(queued[i], 1, result="null"),
    }
    dialect.do_ping = timed_ping  # type: ignore[method-assign]
    dialect.do_commit = timed_commit  # type: ignore[method-assign]
    sa.event.listen(engine, "before_cursor_execute", before)
    sa.event.listen(engine, "after_cursor_execute", after)
    out: dict[str, Any] = {}
    try:
        for op, call in operations.items():
            for key in spent:
                spent[key] = 0.0
            started = clock()
            for i in range(calls):
                call(i)
            total = clock() - started
            per_call = {k: v / calls * 1000 for k, v in spent.items()}
            per_call["python"] = total / calls * 1000 - sum(per_call.values())
            per_call["total"] = total / calls * 1000
            out[op] = per_call
    finally:
        sa.event.remove(engine, "before_cursor_execute", before)
        sa.event.remove(engine, "after_cursor_execute", after)
        del dialect.do_ping, dialect.do_commit
    return out


def profile_claim(b: Backend, *, calls: int) -> str:
    """cProfile of ``calls`` claims: the top functions by own time (text)."""
    queued = [f"pf-{i}" for i in range(calls)]
    b._insert_queued(queued)
    profiler = cProfile.Profile()
    profiler.enable()
    for job_id in queued:
        b.store.claim(
            job_id, owner=OWNER, duration=DURATION, task="bench.noop", args="[]", kwargs="{}"
        )
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv)
    calls = 200 if args.quick else 1000
    block = 25 if args.quick else 50
    calls_by_size = (
        {"100 B": 200, "10 KB": 200, "1 MB": 20}
        if args.quick
        else {"100 B": 1000, "10 KB": 1000, "1 MB": 200}
    )
    backends = {"postgresql": POSTGRES_URL, "mariadb": MARIADB_URL, "sqlite": sqlite_url("ops")}
    data: dict[str, Any] = {
        "calls": calls,
        "block": block,
        "sizes_calls": calls_by_size,
        "backends": {},
    }
    for name, url in backends.items():
        problem = reachable(url)
        if problem:
            print(f"{name}: skipped ({problem})")
            data["backends"][name] = {"skipped": problem}
            continue
        print(f"{name}: {calls} calls per variant and operation...", flush=True)
        b = Backend(name, url, calls)
        try:
            result = measure_operations(b, block=block)
            result["checkpoint_sizes"] = measure_sizes(b, calls_by_size=calls_by_size, block=block)
            result["breakdown_ms"] = breakdown(b, calls=min(calls, 300))
            if name == "postgresql":
                result["claim_profile"] = profile_claim(b, calls=min(calls, 300))
        finally:
            b.close()
        data["backends"][name] = result
    report(data)
    write_result("operations", data, quick=args.quick)


def report(data: dict[str, Any]) -> None:
    rows = []
    for name, result in data["backends"].items():
        if "skipped" in result:
            continue
        for op in OPERATIONS:
            t = result["timings"][op]
            raw = t["raw UPDATE"]["median_ms"]
            lib = t["library"]["median_ms"]
            rows.append(
                [
                    name,
                    op,
                    lib,
                    t["no pre-ping"]["median_ms"],
                    t["same SQL"]["median_ms"],
                    raw,
                    t["raw autocommit"]["median_ms"],
                    lib / raw,
                    t["same SQL"]["median_ms"] / raw,
                    t["library"]["p99_ms"],
                    t["library CPU"]["mean_ms"],
                    t["raw UPDATE CPU"]["mean_ms"],
                ]
            )
    print_table(
        "Per-operation median latency (ms) vs a raw single-row UPDATE + COMMIT, same connection",
        [
            "database",
            "operation",
            "library",
            "no pre-ping",
            "same SQL raw",
            "raw UPDATE",
            "raw autocommit UPDATE",
            "library / raw",
            "same SQL / raw",
            "library p99",
            "library CPU (mean)",
            "raw UPDATE CPU (mean)",
        ],
        rows,
    )
    rows = []
    for name, result in data["backends"].items():
        if "skipped" in result:
            continue
        for op in OPERATIONS:
            c = result["statements"][op]
            rows.append(
                [name, op, c["statements"], c["checkouts"], c["commits"], c["cache_misses"]]
            )
    print_table(
        "Statements per operation (SQLAlchemy before_cursor_execute; one checkout = one pre-ping)",
        [
            "database",
            "operation",
            "statements",
            "checkouts (pings)",
            "commits",
            "compile-cache misses (1st call)",
        ],
        rows,
    )
    rows = []
    for name, result in data["backends"].items():
        if "skipped" in result:
            continue
        for label, s in result["checkpoint_sizes"].items():
            raw = s["raw UPDATE"]["median_ms"]
            rows.append(
                [
                    name,
                    label,
                    s["library"]["median_ms"],
                    s["same SQL"]["median_ms"],
                    raw,
                    s["library"]["median_ms"] / raw,
                    s["library"]["median_ms"] / s["same SQL"]["median_ms"],
                ]
            )
    print_table(
        "Checkpoint by state size: median ms",
        [
            "database",
            "state",
            "library",
            "same SQL raw",
            "raw UPDATE (tiny)",
            "library / raw",
            "library / same SQL",
        ],
        rows,
    )
    rows = []
    for name, result in data["backends"].items():
        if "skipped" in result:
            continue
        for op, parts in result["breakdown_ms"].items():
            rows.append(
                [
                    name,
                    op,
                    parts["ping"],
                    parts["execute"],
                    parts["commit"],
                    parts["python"],
                    parts["total"],
                ]
            )
    print_table(
        "Where the library's time goes, ms per call (sequential run, events attached)",
        [
            "database",
            "operation",
            "pre-ping",
            "execute (incl. BEGIN)",
            "commit",
            "Python (SQLAlchemy, store)",
            "total",
        ],
        rows,
    )
    rows = []
    for name, result in data["backends"].items():
        if "skipped" in result:
            continue
        for op in ("claim", "renew", "checkpoint", "finish"):
            stale, fresh = result["plans_stale_statistics"][op], result["plans"][op]
            rows.append(
                [
                    name,
                    op,
                    stale["uses_expiry_index"],
                    stale["buffers"] or "-",
                    fresh["uses_expiry_index"],
                    fresh["buffers"] or "-",
                ]
            )
    print_table(
        "Plans: does a write by primary key walk the (state, expires_at) index instead? "
        "(statistics from before the claims / fresh)",
        [
            "database",
            "operation",
            "expiry index, stale statistics",
            "buffers",
            "expiry index, fresh statistics",
            "buffers",
        ],
        rows,
    )
    pg = data["backends"].get("postgresql", {})
    if "claim_profile" in pg:
        print("\nPostgreSQL claim, cProfile top functions by own time:\n")
        print("\n".join(pg["claim_profile"].splitlines()[:40]))


if __name__ == "__main__":
    main()
