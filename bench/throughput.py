"""Worker throughput: LeasedTask vs a plain task, no-op and 10 ms tasks, Redis and RabbitMQ.

One real ``celery worker`` (prefork, 2 pool processes, default prefetch, log level WARNING) per
run; the leases table is on PostgreSQL. The tasks are published first, then the worker starts:
throughput is (tasks - 1) / (last completion - first completion), counted in Redis from each
task's ``task_postrun`` (see ``bench.worker_app``), so worker start-up and publishing are out.
Leased and plain runs alternate; each figure is the median of the repeats. The leased runs also
count the SQL statements the pool processes sent, by kind, per task.

    python -m bench.throughput [--quick]
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bench.common import (
    POSTGRES_URL,
    RABBITMQ_URL,
    arguments,
    bench_worker,
    delete_rabbitmq,
    drop_tables,
    print_table,
    private_redis,
    scratch_name,
    wait_done,
    write_result,
)
from bench.worker_app import make_app

CONCURRENCY = 2
SLEEP_SECONDS = 0.010


@contextmanager
def broker(name: str, queue: str) -> Iterator[tuple[str, str]]:
    """(broker URL, counter Redis URL) for ``name`` (redis | rabbitmq); cleaned up after."""
    with private_redis() as redis_url:
        if name == "redis":
            yield redis_url, redis_url
            return
        try:
            yield RABBITMQ_URL, redis_url
        finally:
            delete_rabbitmq(queue)


def publish(app: Any, task_name: str, count: int, args: tuple[Any, ...]) -> float:
    """Publish ``count`` messages of ``task_name`` on one producer; the seconds it took."""
    task = app.tasks[task_name]
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for _ in range(count):
            task.apply_async(args, producer=producer)
    return time.perf_counter() - started


def one_run(
    app: Any,
    config: dict[str, Any],
    counter_url: str,
    task_name: str,
    count: int,
    args: tuple[Any, ...],
    log_dir: str,
) -> dict[str, Any]:
    """Publish ``count`` tasks with ``app``, then let a fresh worker run them all."""
    run = f"bench:{uuid.uuid4().hex[:8]}"
    purge(app)
    publish_seconds = publish(app, task_name, count, args)
    worker = bench_worker(
        config, counter_url=counter_url, run=run, concurrency=CONCURRENCY, log_dir=log_dir
    )
    try:
        done = wait_done(counter_url, run, count, worker=worker, timeout=60 + count / 20)
    finally:
        worker.stop(timeout=15)
    elapsed = done["last"] - done["first"]
    return {
        "tasks": count,
        "seconds": elapsed,
        "tasks_per_s": (count - 1) / elapsed if elapsed > 0 else float("nan"),
        "publish_seconds": publish_seconds,
        "sql": done["sql"],
    }


def with_retries(run: Callable[..., dict[str, Any]], *args: Any, tries: int = 3) -> dict[str, Any]:
    """``run(*args)``, again after a failure (a shared Redis or RabbitMQ restarted under us)."""
    for attempt in range(1, tries + 1):
        try:
            return run(*args)
        except Exception as exc:
            if attempt == tries:
                raise
            print(f"run failed ({exc!r:.200}); again in 5 s", flush=True)
            time.sleep(5)
    raise AssertionError("unreachable")


def purge(app: Any) -> None:
    """Drop what a failed run left in the queue."""
    with contextlib.suppress(Exception):
        app.control.purge()


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv)
    repeats = 1 if args.quick else 3
    kinds: dict[str, dict[str, Any]] = {
        "no-op": {"count": 500 if args.quick else 2000, "args": ()},
        "10 ms": {"count": 200 if args.quick else 500, "args": (SLEEP_SECONDS,)},
    }
    task_names = {
        ("no-op", "plain"): "bench.plain_noop",
        ("no-op", "leased"): "bench.leased_noop",
        ("10 ms", "plain"): "bench.plain_sleep",
        ("10 ms", "leased"): "bench.leased_sleep",
    }
    table = scratch_name("tput")
    log_dir = tempfile.mkdtemp(prefix="bench-throughput-")
    print(f"worker logs in {log_dir}")
    runs: list[dict[str, Any]] = []
    try:
        for broker_name in ("redis", "rabbitmq"):
            queue = f"bench_q_{uuid.uuid4().hex[:8]}"
            with broker(broker_name, queue) as (broker_url, counter_url):
                config = {
                    "broker_url": broker_url,
                    "task_default_queue": queue,
                    "control_exchange": f"{queue}_control",
                    "leases_database_url": POSTGRES_URL,
                    "leases_table": table,
                }
                # One client app per broker: kombu's connection pools are global per URL.
                app = make_app(config, name="bench-client")
                try:
                    for repeat in range(repeats):
                        for kind, spec in kinds.items():
                            variants = ["plain", "leased"]
                            if repeat % 2:
                                variants.reverse()
                            for variant in variants:
                                result = with_retries(
                                    one_run,
                                    app,
                                    config,
                                    counter_url,
                                    task_names[kind, variant],
                                    spec["count"],
                                    spec["args"],
                                    log_dir,
                                )
                                result.update(
                                    broker=broker_name, kind=kind, variant=variant, repeat=repeat
                                )
                                runs.append(result)
                                print(
                                    f"{broker_name:8s} {kind:6s} {variant:6s} repeat {repeat}:"
                                    f" {result['tasks_per_s']:7.1f} tasks/s",
                                    flush=True,
                                )
                finally:
                    app.pool.force_close_all()
                    app.close()
    finally:
        drop_tables(POSTGRES_URL, table)
    shutil.rmtree(log_dir, ignore_errors=True)  # kept when a run failed
    summary = summarize(runs)
    report(summary)
    write_result(
        "throughput",
        {"repeats": repeats, "concurrency": CONCURRENCY, "summary": summary, "runs": runs},
        quick=args.quick,
    )


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for broker_name in ("redis", "rabbitmq"):
        for kind in ("no-op", "10 ms"):
            row: dict[str, Any] = {"broker": broker_name, "kind": kind}
            for variant in ("plain", "leased"):
                chosen = [
                    r
                    for r in runs
                    if (r["broker"], r["kind"], r["variant"]) == (broker_name, kind, variant)
                ]
                if not chosen:
                    continue
                rates = [r["tasks_per_s"] for r in chosen]
                row[variant] = statistics.median(rates)
                row[f"{variant}_runs"] = rates
                if variant == "leased":
                    tasks = sum(r["tasks"] for r in chosen)
                    kinds: dict[str, int] = {}
                    for r in chosen:
                        for k, v in r["sql"].items():
                            kinds[k] = kinds.get(k, 0) + v
                    row["sql_per_task"] = {k: v / tasks for k, v in sorted(kinds.items())}
            if "plain" in row and "leased" in row:
                row["ratio"] = row["leased"] / row["plain"]
                row["ms_per_task_added"] = (1 / row["leased"] - 1 / row["plain"]) * 1000
            out.append(row)
    return out


def report(summary: list[dict[str, Any]]) -> None:
    rows = []
    for r in summary:
        if "ratio" not in r:
            continue
        sql = r.get("sql_per_task", {})
        statements = sum(v for k, v in sql.items() if k != "checkout")
        rows.append(
            [
                r["broker"],
                r["kind"],
                r["plain"],
                r["leased"],
                r["ratio"],
                r["ms_per_task_added"] * 2,  # 2 pool processes: per-process cost of one task
                statements,
                ", ".join(f"{k} {v:.2f}" for k, v in sql.items()),
            ]
        )
    print_table(
        f"Throughput, one prefork worker with {CONCURRENCY} pool processes (median tasks/s)",
        [
            "broker",
            "task",
            "plain",
            "leased",
            "leased / plain",
            "added ms per task per process",
            "SQL statements / task",
            "by kind (per task)",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
