"""Worker throughput: LeasedTask vs a plain task, no-op and 10 ms tasks, Redis and RabbitMQ.

One ``celery worker -P prefork -c 2`` per run (PostgreSQL store) starts after the tasks are
published; rate = (tasks - 1) / (last - first completion). ``added_ms`` = (1/leased -
1/plain) x 2 processes: what a leased task adds in its pool process.

    python -m bench.throughput [--quick]
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

from bench.common import available, parser, report, row, scratch
from bench.worker_app import make_app, publish, start_worker, wait_done
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, delete_rabbitmq_entities, private_redis_url
from tests.support.worker import Spawner

CONCURRENCY = 2
KINDS = {"no-op": ("noop", ()), "10 ms": ("sleep", (0.010,))}
COLUMNS = "broker task plain_per_s leased_per_s leased/plain added_ms runs"


def measure(
    broker: str, url: str | None, table: str, *, counts: dict[str, int], repeats: int
) -> list[dict[str, Any]]:
    """One row per kind of task on ``broker`` (``url``; None: the private Redis database)."""
    queue = f"bench_q_{uuid.uuid4().hex[:8]}"
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-throughput-") as logs,
        private_redis_url() as counter,
    ):
        spawner = Spawner(logs)
        config = {
            "broker_url": url or counter,
            "task_default_queue": queue,
            "control_exchange": f"{queue}_control",
            "leases_database_url": POSTGRES_URL,
            "leases_table": table,
        }
        app = make_app(config, name="bench-client")

        def rate(task: str, args: tuple[Any, ...], count: int) -> float:
            """Tasks per second of a fresh worker running ``count`` tasks sent beforehand."""
            run = f"bench:{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(Exception):
                app.control.purge()  # what a failed run left queued
            publish(app, task, count, args)
            worker = start_worker(
                spawner, config, counter_url=counter, run=run, concurrency=CONCURRENCY
            )
            try:
                first, last = wait_done(counter, run, count, worker=worker, timeout=60 + count / 20)
            finally:
                worker.stop(timeout=15)
            return (count - 1) / (last - first)

        try:
            for kind, (body, args) in KINDS.items():
                rates: dict[str, list[float]] = {"leased": [], "plain": []}
                for repeat in range(repeats):
                    for variant in sorted(rates, reverse=repeat % 2 == 1):
                        rates[variant].append(
                            round(rate(f"bench.{variant}_{body}", args, counts[kind]), 1)
                        )
                        print(f"{broker} {kind} {variant}: {rates[variant][-1]:.0f}/s", flush=True)
                plain, leased = (statistics.median(rates[v]) for v in ("plain", "leased"))
                added = (1 / leased - 1 / plain) * 1000 * CONCURRENCY
                values = (broker, kind, plain, leased, leased / plain, added, rates)
                rows.append(row(COLUMNS, *values))
        finally:
            close_app(app)
            spawner.stop_all()
            if url:
                pidbox = f"{queue}_control.pidbox"
                delete_rabbitmq_entities(
                    url, queues=[queue], exchanges=[queue, pidbox, f"reply.{pidbox}"]
                )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    repeats = 1 if args.quick else 3
    counts = {"no-op": 500, "10 ms": 200} if args.quick else {"no-op": 2000, "10 ms": 500}
    rows = []
    with scratch(POSTGRES_URL, "throughput") as table:
        rows += measure("redis", None, table, counts=counts, repeats=repeats)
        rabbitmq = available("rabbitmq")
        if rabbitmq:
            rows += measure("rabbitmq", rabbitmq, table, counts=counts, repeats=repeats)
    title = f"Throughput of one prefork worker -c {CONCURRENCY} (median tasks/s)"
    report("throughput", rows, quick=args.quick, title=title, tasks=counts, repeats=repeats)


if __name__ == "__main__":
    main()
