"""Worker throughput: LeasedTask vs a plain task, no-op and 10 ms tasks, Redis and RabbitMQ.

One ``celery worker -P prefork -c 2`` per run (PostgreSQL store) starts after the tasks are
published; rate = (tasks - 1) / (last - first completion). ``added_ms`` = (1/leased -
1/plain) x 2 processes: what a leased task adds in its pool process.

The floor: a leased task makes two durable writes (claim, finish), so it cannot take less than
plain + 2 raw writes. ``raw_write_ms`` is one single-row autocommit UPDATE through psycopg on
its own connection (as the store connects), each after an idle gap as long as the task's body
(none for no-op, 10 ms for 10 ms tasks: on a virtual machine a write after a pause costs more
than one in a loop); ``floor`` = plain per-task time / (that + 2 raw writes).

    python -m bench.throughput [--quick]
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from bench.common import available, parser, report, row, scratch
from bench.worker_app import make_app, publish, start_worker, wait_done
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, delete_rabbitmq_entities, private_redis_url
from tests.support.worker import Spawner

CONCURRENCY = 2
KINDS = {"no-op": ("noop", ()), "10 ms": ("sleep", (0.010,))}
COLUMNS = "broker task plain_per_s leased_per_s leased/plain added_ms raw_write_ms floor runs"


def raw_write_ms(gap: float, *, writes: int = 300) -> float:
    """Median ms of a single-row autocommit UPDATE on PostgreSQL, each after ``gap`` s idle."""
    with scratch(POSTGRES_URL, "tpraw", leases=False) as table:
        engine = sa.create_engine(POSTGRES_URL)
        try:
            with engine.begin() as connection:
                connection.execute(sa.text(f"CREATE TABLE {table} (id int PRIMARY KEY, v float)"))
                connection.execute(sa.text(f"INSERT INTO {table} VALUES (1, 0)"))
            raw = engine.raw_connection()
            try:
                conn = raw.driver_connection
                conn.autocommit = True
                seconds = []
                for i in range(writes):
                    if gap:
                        time.sleep(gap)
                    started = time.perf_counter()
                    conn.execute(f"UPDATE {table} SET v = %s WHERE id = 1", (float(i),))
                    seconds.append(time.perf_counter() - started)
            finally:
                raw.close()
        finally:
            engine.dispose()
    return statistics.median(seconds) * 1000


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
                write = raw_write_ms(args[0] if args else 0.0)
                per_task = 1000 * CONCURRENCY / plain
                floor = per_task / (per_task + 2 * write)
                values = (broker, kind, plain, leased, leased / plain, added, write, floor, rates)
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
