"""Worker memory: RSS of a prefork worker (1 pool process) after 10,000 LeasedTask or plain tasks.

One real ``celery worker -P prefork -c 1`` per variant (Redis broker, PostgreSQL store), fed
no-op tasks in batches; after each batch has run (1,000, 5,000 and 10,000 tasks in all) the
parent's and the pool process's memory is read from ``/proc``: VmRSS, and from
``smaps_rollup`` the PSS and the private (unshared) memory. Flat figures mean no growth.

    python -m bench.memory [--quick]
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    POSTGRES_URL,
    arguments,
    bench_worker,
    drop_tables,
    print_table,
    private_redis,
    scratch_name,
    wait_done,
    write_result,
)
from bench.throughput import publish
from bench.worker_app import make_app


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, Pss and private memory (Private_Clean + Private_Dirty) of ``pid``, in KiB."""
    out = {"rss": 0, "pss": 0, "private": 0}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss"] = int(line.split()[1])
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return out
    for line in rollup:
        name, _, rest = line.partition(":")
        if name == "Pss":
            out["pss"] = int(rest.split()[0])
        elif name in ("Private_Clean", "Private_Dirty"):
            out["private"] += int(rest.split()[0])
    return out


def sample(worker: Any, done: int) -> dict[str, Any]:
    children = worker.children()
    return {
        "tasks": done,
        "parent": memory_kib(worker.pid),
        "child": memory_kib(children[0]) if children else None,
        "child_pid": children[0] if children else None,
    }


def run_variant(
    app: Any,
    config: dict[str, Any],
    counter_url: str,
    task_name: str,
    marks: list[int],
    log_dir: str,
) -> list[dict[str, Any]]:
    run = f"bench:{uuid.uuid4().hex[:8]}"
    worker = bench_worker(config, counter_url=counter_url, run=run, concurrency=1, log_dir=log_dir)
    samples = []
    try:
        samples.append(sample(worker, 0))
        sent = 0
        for mark in marks:
            publish(app, task_name, mark - sent, ())
            sent = mark
            wait_done(counter_url, run, mark, worker=worker, timeout=60 + mark / 20)
            samples.append(sample(worker, mark))
            print(
                f"  {task_name}: {mark:6d} tasks, child RSS "
                f"{samples[-1]['child']['rss'] / 1024:.1f} MiB",
                flush=True,
            )
    finally:
        worker.stop(timeout=15)
    return samples


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv)
    marks = [200, 1000, 2000] if args.quick else [1000, 5000, 10000]
    table = scratch_name("mem")
    queue = f"bench_q_{uuid.uuid4().hex[:8]}"
    log_dir = tempfile.mkdtemp(prefix="bench-memory-")
    data: dict[str, Any] = {"marks": marks, "variants": {}}
    try:
        with private_redis() as redis_url:
            config = {
                "broker_url": redis_url,
                "task_default_queue": queue,
                "control_exchange": f"{queue}_control",
                "leases_database_url": POSTGRES_URL,
                "leases_table": table,
            }
            app = make_app(config, name="bench-memory")
            try:
                for variant, task_name in (
                    ("plain", "bench.plain_noop"),
                    ("leased", "bench.leased_noop"),
                ):
                    data["variants"][variant] = run_variant(
                        app, config, redis_url, task_name, marks, log_dir
                    )
            finally:
                app.pool.force_close_all()
                app.close()
    finally:
        drop_tables(POSTGRES_URL, table)
    shutil.rmtree(log_dir, ignore_errors=True)  # kept when a run failed
    report(data)
    write_result("memory", data, quick=args.quick)


def report(data: dict[str, Any]) -> None:
    rows = []
    for variant, samples in data["variants"].items():
        for s in samples:
            child = s["child"] or {"rss": 0, "pss": 0, "private": 0}
            rows.append(
                [
                    variant,
                    s["tasks"],
                    s["parent"]["rss"] / 1024,
                    child["rss"] / 1024,
                    child["pss"] / 1024,
                    child["private"] / 1024,
                ]
            )
    print_table(
        "Worker memory after N no-op tasks (MiB; prefork, 1 pool process)",
        ["task", "tasks run", "parent RSS", "child RSS", "child PSS", "child private"],
        rows,
    )
    rows = []
    for variant, samples in data["variants"].items():
        first, last = samples[1], samples[-1]
        rows.append(
            [
                variant,
                (last["child"]["rss"] - first["child"]["rss"]) / 1024,
                (last["parent"]["rss"] - first["parent"]["rss"]) / 1024,
                (last["child"]["private"] - first["child"]["private"]) / 1024,
            ]
        )
    plain, leased = data["variants"].get("plain"), data["variants"].get("leased")
    if plain and leased:
        print(
            f"\nleased - plain, child RSS after {leased[-1]['tasks']} tasks: "
            f"{(leased[-1]['child']['rss'] - plain[-1]['child']['rss']) / 1024:+.1f} MiB"
        )
    print_table(
        f"Growth from {data['marks'][0]:,} to {data['marks'][-1]:,} tasks (MiB)",
        ["task", "child RSS", "parent RSS", "child private"],
        rows,
    )


if __name__ == "__main__":
    main()
