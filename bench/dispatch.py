"""Dispatch cost: ``apply_async`` of a LeasedTask (INSERT, then publish) vs a plain task.

Redis broker, PostgreSQL store, no worker; alternating blocks, medians and p90 in ms.

- ``leased``: the default. A plain job's record (no lease key, no group) commits without
  waiting for its WAL flush (``Record.register_unflushed``; docs/guarantees.md says why that
  loses nothing: the message published next is the job's second copy).
- ``leased, sync record``: ``leases_record_sync_commit = True``, every record flushed.
- ``leased keyed``: a lease key per call, each a new key (its record reads the key first,
  then inserts, flushed: a keyed record decides what is published).
- ``raw INSERT`` / ``raw INSERT, sync``: the statement the leased (or sync-record) call sent
  (its text and parameters, read at the driver, a new id each call), sent by hand on the same
  connection in autocommit: ``added - raw INSERT`` is the library's own work.

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

COLUMNS = "task median_ms p90_ms mean_ms median/plain added_ms raw_insert_ms library_own_ms"


def send(task: Any, i: int) -> None:
    task.apply_async()


def send_keyed(task: Any, run: str, i: int) -> None:
    task.apply_async(lease_key=f"{run}-{i}")


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
        synced = make_app(
            {
                "broker_url": broker,
                "leases_database_url": POSTGRES_URL,
                "leases_table": table,
                "leases_record_sync_commit": True,
            }
        )
        tasks["leased, sync record"] = synced.tasks["bench.leased_noop"]
        run = uuid.uuid4().hex[:8]
        try:
            for i in range(20):  # connections, schema check, compiled statements
                for task in tasks.values():
                    task.apply_async()
                send_keyed(tasks["leased"], f"warm-{run}", i)
            variants = {name: steady(functools.partial(send, t)) for name, t in tasks.items()}
            variants["leased keyed"] = steady(functools.partial(send_keyed, tasks["leased"], run))
            variants["raw INSERT"] = steady(raw_insert(tasks["leased"]))
            variants["raw INSERT, sync"] = steady(raw_insert(tasks["leased, sync record"]))
            times = interleaved(variants, calls=calls, block=block)
        finally:
            close_app(app)
            close_app(synced)
    plain = median_ms(times["plain"])
    rows = []
    for name in ("plain", "leased", "leased, sync record", "leased keyed"):
        seconds = times[name]
        median = median_ms(seconds)
        mean = statistics.fmean(seconds) * 1000
        added = median - plain
        raw = {"leased": "raw INSERT", "leased, sync record": "raw INSERT, sync"}.get(name)
        insert = median_ms(times[raw]) if raw else None
        own = added - insert if insert is not None else None
        values = (name, median, p90_ms(seconds), mean, median / plain, added, insert, own)
        rows.append(row(COLUMNS, *values))
    title = f"apply_async, Redis broker, PostgreSQL store ({calls} calls each, ms)"
    report("dispatch", rows, quick=args.quick, title=title, block=block)


if __name__ == "__main__":
    main()
