"""Dispatch cost: ``apply_async`` of a LeasedTask (INSERT, then publish) vs a plain task.

Redis broker, PostgreSQL store, no worker; alternating blocks, medians and p90 in ms. The
floor of a leased dispatch is a plain one plus its INSERT: ``raw INSERT`` sends the statement
the library sent (its text and parameters, read at the driver, a new id each call) by hand on
the same connection in autocommit, so ``leased - plain - raw INSERT`` is the library's own work.
``leased, async commit`` is a LeasedTask of a second app whose leases URL sets PostgreSQL's
``synchronous_commit = off`` for its sessions (``?options=-c synchronous_commit=off``): its
INSERT returns before the WAL reaches the disk (docs/benchmarks.md, section 2, says what a
database crash can then lose).

    python -m bench.dispatch [--quick]
"""

from __future__ import annotations

import functools
import statistics
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from bench.common import interleaved, median_ms, p90_ms, parser, report, row, scratch, steady
from bench.worker_app import make_app
from tests.support.driver import executed
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, private_redis_url

#: The same database, each session's commits asynchronous.
ASYNC_COMMIT_URL = POSTGRES_URL + "?options=-c%20synchronous_commit%3Doff"
COLUMNS = "task median_ms p90_ms mean_ms median/plain added_ms raw_insert_ms library_own_ms"


def send(task: Any, i: int) -> None:
    task.apply_async()


def raw_insert(task: Any) -> Callable[[int], None]:
    """The INSERT a leased ``apply_async`` sends, by hand, with a new id at each call."""
    with executed() as seen:
        task.apply_async()
    ((conn, compiled, params),) = seen  # one statement, or the baseline is not like for like
    sql, parameters = compiled.parameters(params)
    run = uuid.uuid4().hex[:8]

    def insert(i: int) -> None:
        cursor = conn.cursor()
        try:
            cursor.execute(sql, {**parameters, "b_id": f"raw-{run}-{i}"})
            cursor.fetchall()
        finally:
            cursor.close()

    return insert


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    calls, block = (500, 50) if args.quick else (2000, 100)
    with private_redis_url() as broker, scratch(POSTGRES_URL, "dispatch") as table:
        app = make_app(
            {"broker_url": broker, "leases_database_url": POSTGRES_URL, "leases_table": table}
        )
        tasks = {name: app.tasks[f"bench.{name}_noop"] for name in ("plain", "leased")}
        fast = make_app(
            {"broker_url": broker, "leases_database_url": ASYNC_COMMIT_URL, "leases_table": table}
        )
        tasks["leased, async commit"] = fast.tasks["bench.leased_noop"]
        try:
            for _ in range(20):  # connections, schema check, compiled statements
                for task in tasks.values():
                    task.apply_async()
            variants = {name: steady(functools.partial(send, t)) for name, t in tasks.items()}
            variants["raw INSERT"] = steady(raw_insert(tasks["leased"]))
            times = interleaved(variants, calls=calls, block=block)
        finally:
            close_app(app)
            close_app(fast)
    plain, insert = median_ms(times["plain"]), median_ms(times["raw INSERT"])
    rows = []
    for name in ("plain", "leased", "leased, async commit"):
        seconds = times[name]
        median = median_ms(seconds)
        mean = statistics.fmean(seconds) * 1000
        added = median - plain
        own = added - insert if name == "leased" else None
        values = (name, median, p90_ms(seconds), mean, median / plain, added, insert, own)
        rows.append(row(COLUMNS, *values))
    title = f"apply_async, Redis broker, PostgreSQL store ({calls} calls each, ms)"
    report("dispatch", rows, quick=args.quick, title=title, block=block)


if __name__ == "__main__":
    main()
