"""Dispatch cost: ``apply_async`` of a LeasedTask (INSERT, then publish) vs a plain task.

Redis broker, PostgreSQL store, no worker; alternating blocks, medians and p90 in ms.

    python -m bench.dispatch [--quick]
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from typing import Any

from bench.common import interleaved, median_ms, p90_ms, parser, report, row, scratch, steady
from bench.worker_app import make_app
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, private_redis_url


def send(task: Any, i: int) -> None:
    task.apply_async()


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    calls, block = (500, 50) if args.quick else (2000, 100)
    with private_redis_url() as broker, scratch(POSTGRES_URL, "dispatch") as table:
        app = make_app(
            {"broker_url": broker, "leases_database_url": POSTGRES_URL, "leases_table": table}
        )
        tasks = {name: app.tasks[f"bench.{name}_noop"] for name in ("plain", "leased")}
        try:
            for _ in range(20):  # connections, schema check, compiled statements
                for task in tasks.values():
                    task.apply_async()
            times = interleaved(
                {name: steady(functools.partial(send, task)) for name, task in tasks.items()},
                calls=calls,
                block=block,
            )
        finally:
            close_app(app)
    plain = median_ms(times["plain"])
    rows = []
    for name, seconds in times.items():
        median = median_ms(seconds)
        mean = statistics.fmean(seconds) * 1000
        values = (name, median, p90_ms(seconds), mean, median / plain, median - plain)
        rows.append(row("task median_ms p90_ms mean_ms median/plain added_ms", *values))
    title = f"apply_async, Redis broker, PostgreSQL store ({calls} calls each, ms)"
    report("dispatch", rows, quick=args.quick, title=title, block=block)


if __name__ == "__main__":
    main()
