"""Worker throughput: LeasedTask vs a plain task, no-op and 10 ms tasks, Redis and RabbitMQ.

One ``celery worker -P prefork -c 2`` per run (PostgreSQL store) starts after the tasks are
published; rate = (tasks - 1) / (last - first completion). ``added_ms`` = (1/leased -
1/plain) x 2 processes: what a leased task adds in its pool process.

The floor is measured, not computed: a leased task makes two durable writes (the claim before
its body, the finish after it), so its baseline is the same plain task making two raw writes
in the same places (``bench.floor_*`` of ``bench/worker_app.py``: a single-row autocommit
``UPDATE`` each, through psycopg, on the pool process's own connection, as the store
connects), in the same worker, on the same machine, its runs interleaved with the others.
That counts everything two writes cost a worker: their round trips, and the database's work
on the same two cores as the worker and the broker (a pool process waits for a core too).
``leased/floor`` is then what the library costs beyond its two writes. ``cpu_ms`` is the
machine's busy CPU time per task during a run (``/proc/stat``, every core, from the first
completion to the last).

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
#: The variants of each task, as ``bench.<variant>_<body>``.
VARIANTS = ("plain", "floor", "leased")
COLUMNS = (
    "broker task plain_per_s floor_per_s leased_per_s leased/plain floor/plain leased/floor "
    "added_ms plain_cpu_ms floor_cpu_ms leased_cpu_ms runs"
)
#: Seconds between two reads of /proc/stat while a worker runs.
CPU_SAMPLE_SECONDS = 0.01


def busy_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat: user,
    nice, system, irq, softirq; not idle or iowait, nor steal, a virtual machine's time taken
    by its host)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


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


def measure(
    broker: str, url: str | None, table: str, *, counts: dict[str, int], repeats: int
) -> list[dict[str, Any]]:
    """One row per kind of task on ``broker`` (``url``; None: the private Redis database)."""
    queue = f"bench_q_{uuid.uuid4().hex[:8]}"
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-throughput-") as logs,
        private_redis_url() as counter,
        floor_table() as floor,
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
                    spawner,
                    config,
                    counter_url=counter,
                    run=run,
                    concurrency=CONCURRENCY,
                    floor_table=floor,
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
                rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
                cpus: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for repeat in range(repeats):
                    # Each variant first, in the middle and last in turn.
                    order = VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3]
                    for variant in order:
                        per_s, cpu_ms = rate(f"bench.{variant}_{body}", args, counts[kind])
                        rates[variant].append(round(per_s, 1))
                        cpus[variant].append(round(cpu_ms, 3))
                        print(
                            f"{broker} {kind} {variant}: {per_s:.0f}/s, {cpu_ms:.2f} ms CPU a task",
                            flush=True,
                        )
                plain, floor_rate, leased = (statistics.median(rates[v]) for v in VARIANTS)
                cpu = [statistics.median(cpus[v]) for v in VARIANTS]
                added = (1 / leased - 1 / plain) * 1000 * CONCURRENCY
                values = (
                    broker, kind, plain, floor_rate, leased, leased / plain, floor_rate / plain,
                    leased / floor_rate, added, *cpu, {"rates": rates, "cpu_ms": cpus},
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


@contextlib.contextmanager
def floor_table() -> Any:
    """The scratch table of the floor tasks' writes (a row per pool process)."""
    with scratch(POSTGRES_URL, "tpfloor", leases=False) as table:
        engine = sa.create_engine(POSTGRES_URL)
        try:
            with engine.begin() as connection:
                connection.execute(
                    sa.text(f"CREATE TABLE {table} (id int PRIMARY KEY, v bigint NOT NULL)")
                )
        finally:
            engine.dispose()
        yield table


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    repeats = 1 if args.quick else 5
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
