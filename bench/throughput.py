"""Worker throughput: LeasedTask vs a plain task, no-op and 10 ms tasks, Redis and RabbitMQ.

One ``celery worker -P prefork -c 2`` per run (PostgreSQL store) starts after the tasks are
published; rate = (tasks - 1) / (last - first completion). ``added_ms`` = (1/leased -
1/plain) x 2 processes: what a leased task adds in its pool process.

The floor: a leased task makes two durable writes (claim, finish), and they cost it twice.
In time: each pool process cannot take less than plain + 2 raw writes per task. In CPU: the
machine runs the worker, the broker and the database on the same cores, so the database's and
the driver's work for those writes (``raw_write_cpu_ms``, all cores) is taken from the worker.
``raw_write_ms`` and ``raw_write_cpu_ms`` are one single-row autocommit UPDATE through psycopg
on its own connection (as the store connects), each after an idle gap as long as the task's
body (none for no-op, 10 ms for 10 ms tasks: on a virtual machine a write after a pause costs
more than one in a loop). ``cpu_ms`` is the machine's busy CPU time per task during the run
(``/proc/stat``, every core, from the first completion to the last). The floor is the lower
of the two bounds: ``floor`` = min(plain per-task time / (that + 2 raw writes), plain CPU per
task / (that + 2 raw writes' CPU)) when the plain run kept every core busy, else the first.

    python -m bench.throughput [--quick]
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import threading
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
COLUMNS = (
    "broker task plain_per_s leased_per_s leased/plain added_ms plain_cpu_ms leased_cpu_ms "
    "busy_cores raw_write_ms raw_write_cpu_ms floor runs"
)
#: Seconds between two reads of /proc/stat while a worker runs.
CPU_SAMPLE_SECONDS = 0.01
CORES = os.cpu_count() or 1


def busy_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """Reads the machine's busy CPU time every ``CPU_SAMPLE_SECONDS`` (wall clock stamps)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(CPU_SAMPLE_SECONDS):
            self.samples.append((time.time(), busy_cpu_seconds()))

    def between(self, first: float, last: float) -> float:
        """Busy CPU seconds from wall time ``first`` to ``last`` (the nearest samples)."""

        def at(moment: float) -> float:
            return min(self.samples, key=lambda sample: abs(sample[0] - moment))[1]

        return at(last) - at(first)

    def __enter__(self) -> CpuSampler:
        self.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stopped.set()
        self.join()


def raw_write(gap: float, *, writes: int = 300) -> tuple[float, float]:
    """Median ms of a single-row autocommit UPDATE on PostgreSQL, each after ``gap`` s idle,
    and the machine's busy CPU ms per write (every core: the driver's and the server's)."""
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
                # What the machine spends with nothing running here, taken off below.
                background = busy_cpu_seconds()
                time.sleep(1.0)
                background = busy_cpu_seconds() - background
                seconds = []
                busy, began = busy_cpu_seconds(), time.monotonic()
                for i in range(writes):
                    if gap:
                        time.sleep(gap)
                    started = time.perf_counter()
                    conn.execute(f"UPDATE {table} SET v = %s WHERE id = 1", (float(i),))
                    seconds.append(time.perf_counter() - started)
                busy = busy_cpu_seconds() - busy - background * (time.monotonic() - began)
            finally:
                raw.close()
        finally:
            engine.dispose()
    return statistics.median(seconds) * 1000, max(busy, 0.0) / writes * 1000


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

        def rate(task: str, args: tuple[Any, ...], count: int) -> tuple[float, float]:
            """Tasks per second of a fresh worker running ``count`` tasks sent beforehand, and
            the machine's busy CPU ms per task meanwhile."""
            run = f"bench:{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(Exception):
                app.control.purge()  # what a failed run left queued
            publish(app, task, count, args)
            with CpuSampler() as cpu:
                worker = start_worker(
                    spawner, config, counter_url=counter, run=run, concurrency=CONCURRENCY
                )
                try:
                    first, last = wait_done(
                        counter, run, count, worker=worker, timeout=60 + count / 20
                    )
                finally:
                    worker.stop(timeout=15)
            return (count - 1) / (last - first), cpu.between(first, last) / (count - 1) * 1000

        try:
            for kind, (body, args) in KINDS.items():
                rates: dict[str, list[float]] = {"leased": [], "plain": []}
                cpus: dict[str, list[float]] = {"leased": [], "plain": []}
                for repeat in range(repeats):
                    for variant in sorted(rates, reverse=repeat % 2 == 1):
                        per_s, cpu_ms = rate(f"bench.{variant}_{body}", args, counts[kind])
                        rates[variant].append(round(per_s, 1))
                        cpus[variant].append(round(cpu_ms, 3))
                        print(
                            f"{broker} {kind} {variant}: {per_s:.0f}/s, {cpu_ms:.2f} ms CPU a task",
                            flush=True,
                        )
                plain, leased = (statistics.median(rates[v]) for v in ("plain", "leased"))
                plain_cpu, leased_cpu = (statistics.median(cpus[v]) for v in ("plain", "leased"))
                added = (1 / leased - 1 / plain) * 1000 * CONCURRENCY
                write, write_cpu = raw_write(args[0] if args else 0.0)
                per_task = 1000 * CONCURRENCY / plain
                floor = per_task / (per_task + 2 * write)
                busy_cores = plain * plain_cpu / 1000
                if busy_cores > 0.9 * CORES:  # the plain run kept every core busy
                    floor = min(floor, plain_cpu / (plain_cpu + 2 * write_cpu))
                values = (
                    broker, kind, plain, leased, leased / plain, added, plain_cpu, leased_cpu,
                    busy_cores, write, write_cpu, floor, {"rates": rates, "cpu_ms": cpus},
                )  # fmt: skip
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
