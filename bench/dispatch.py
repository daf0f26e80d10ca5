"""Dispatch cost: ``apply_async`` latency of a LeasedTask vs a plain task (Redis, PostgreSQL).

A LeasedTask records its job (one ``INSERT ... ON CONFLICT DO NOTHING``, committed) before it
publishes; a plain task only publishes. Both are called as an application would, one
``apply_async`` at a time (the producer comes from Celery's pool), alternating in blocks so
drift on a noisy machine hits both alike. No worker runs; the queue is dropped afterwards.

    python -m bench.dispatch [--quick]
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from bench.common import (
    POSTGRES_URL,
    StatementCounter,
    arguments,
    drop_tables,
    interleaved,
    print_table,
    private_redis,
    scratch_name,
    summary,
    write_result,
)
from bench.worker_app import make_app
from celery_leases.store import store_for


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv)
    calls = 500 if args.quick else 2000
    block = 50 if args.quick else 100
    table = scratch_name("dispatch")
    queue = f"bench_q_{uuid.uuid4().hex[:8]}"
    data: dict[str, Any] = {"calls": calls, "block": block}
    with private_redis() as redis_url:
        app = make_app(
            {
                "broker_url": redis_url,
                "task_default_queue": queue,
                "leases_database_url": POSTGRES_URL,
                "leases_table": table,
            },
            name="bench-dispatch",
        )
        leased, plain = app.tasks["bench.leased_noop"], app.tasks["bench.plain_noop"]
        try:
            # Warm up both paths: broker connection, engine, schema check, compiled statements.
            for _ in range(20):
                leased.apply_async()
                plain.apply_async()
            store = store_for(leased.lease_settings)
            counter = StatementCounter(store.engine)
            leased.apply_async()
            data["statements_per_dispatch"] = counter.counts()
            data["sql"] = [sql for sql, _ in counter.last]
            counter.close()
            times = interleaved(
                {"plain": lambda i: plain.apply_async(), "leased": lambda i: leased.apply_async()},
                calls=calls,
                block=block,
            )
        finally:
            app.pool.force_close_all()
            app.close()
            drop_tables(POSTGRES_URL, table)
    data["plain"] = summary(times["plain"])
    data["leased"] = summary(times["leased"])
    report(data)
    write_result("dispatch", data, quick=args.quick)


def report(data: dict[str, Any]) -> None:
    p, q = data["plain"], data["leased"]
    rows = [
        ["plain", p["median_ms"], p["p90_ms"], p["p99_ms"], p["mean_ms"], 1.0],
        [
            "leased",
            q["median_ms"],
            q["p90_ms"],
            q["p99_ms"],
            q["mean_ms"],
            q["median_ms"] / p["median_ms"],
        ],
        [
            "difference",
            q["median_ms"] - p["median_ms"],
            q["p90_ms"] - p["p90_ms"],
            q["p99_ms"] - p["p99_ms"],
            q["mean_ms"] - p["mean_ms"],
            float("nan"),
        ],
    ]
    print_table(
        f"apply_async latency, Redis broker, PostgreSQL store ({data['calls']} calls each, ms)",
        ["task", "median", "p90", "p99", "mean", "median / plain"],
        rows,
    )
    c = data["statements_per_dispatch"]
    print(
        f"\nper leased dispatch: {c['statements']} statement(s), {c['checkouts']} checkout "
        f"(pre-ping), {c['commits']} commit"
    )


if __name__ == "__main__":
    main()
