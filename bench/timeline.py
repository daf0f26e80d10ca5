"""Where a job's time goes in a worker's pool process: plain, floor and leased, side by side.

A real ``celery worker -P prefork`` (``bench/worker_app.py``, Redis broker, PostgreSQL) runs
a batch of tasks sent beforehand, one variant at a time, the variants' order turning every
round: ``plain`` (a plain Celery task), ``floor`` (a plain task making a raw single-row
autocommit ``UPDATE`` before and after its body: two durable writes and no library) and
``leased`` (a LeasedTask: its claim before the body, its finish after). Each pool process
stamps its jobs' moments on the machine's monotonic clock (``BENCH_TIMELINE``:
``task_prerun``, the body's start and end, each statement's start and end, ``task_postrun``);
each job's time splits into:

- ``before``: ``task_prerun`` to the body's start (leased: the claim; floor: its first write);
- ``body``: the task's own body (10 ms asleep, or nothing);
- ``after``: the body's end to ``task_postrun`` (leased: the finish; floor: its second write);
- ``between``: ``task_postrun`` to the next job's ``task_prerun`` (the bench's counter write
  in Redis, the result's trip to the worker's main process and the next job's trip back);
- ``cycle``: ``task_prerun`` to the next one, i.e. the job's whole cost to its process;
- ``stmt 1``, ``stmt 2``: the round trips inside ``before`` and ``after`` (leased: the claim
  and the finish, timed around the store's calls; floor: the raw writes); what is left of
  ``before`` and ``after`` is Python (Celery's and the library's).

Medians over every job but each process's first and last, then the median of the rounds; the
rate is the batch's, first to last completion. Nothing here is asserted. The stamps are in the
pool processes only: what the worker's main process does shows in ``between``, for every
variant alike (with ``-c 2`` it includes a wait for the main process to hand the next job).

    python -m bench.timeline [--quick] [--concurrency N] [--rounds R] [--kinds 10ms noop]
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import parser, report, row, scratch
from bench.throughput import floor_table
from bench.worker_app import TIMELINE, make_app, publish, start_worker, wait_done
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, private_redis_url
from tests.support.worker import Spawner

VARIANTS = ("plain", "floor", "leased")
#: The kinds of task: their body in ``bench.worker_app``, its arguments, tasks per run.
KINDS = {"10ms": ("sleep", (0.010,), 300), "noop": ("noop", (), 1000)}
SEGMENTS = ("before", "body", "after", "between", "cycle", "stmt1", "stmt2")
COLUMNS = "task variant per_s " + " ".join(f"{s}_ms" for s in SEGMENTS) + " python_ms"


def jobs_of(stamps: Sequence[tuple[float, str]]) -> list[dict[str, float]]:
    """One process's stamps as its jobs' segments (ms), each job but the first and the last
    (the one without a next ``task_prerun``), and but one whose body did not run."""
    starts = [i for i, (_, moment) in enumerate(stamps) if moment == "prerun"]
    jobs = []
    for begin, end in itertools.pairwise(starts[1:]):
        job = stamps[begin:end]
        at = {moment: t for t, moment in job if not moment.startswith("statement")}
        if "body<" not in at or "body>" not in at or "postrun" not in at:
            continue  # a delivery that did not run its body (a duplicate dropped by its claim)
        statements = [t for t, moment in job if moment.startswith("statement")]
        spans = list(zip(statements[::2], statements[1::2], strict=True))
        before = (at["body<"] - at["prerun"]) * 1000
        after = (at["postrun"] - at["body>"]) * 1000
        stmt1 = sum((b - a) * 1000 for a, b in spans if a < at["body<"])
        stmt2 = sum((b - a) * 1000 for a, b in spans if a >= at["body>"])
        jobs.append(
            {
                "before": before,
                "body": (at["body>"] - at["body<"]) * 1000,
                "after": after,
                "between": (stamps[end][0] - at["postrun"]) * 1000,
                "cycle": (stamps[end][0] - at["prerun"]) * 1000,
                "stmt1": stmt1,
                "stmt2": stmt2,
                "python": before + after - stmt1 - stmt2,
            }
        )
    return jobs


def run_once(
    spawner: Spawner, config: dict[str, Any], *, counter: str, floor: str, task: str,
    args: tuple[Any, ...], count: int, concurrency: int,
) -> dict[str, float]:  # fmt: skip
    """The medians of one worker's run of ``count`` tasks, and its rate."""
    app = make_app(config, name="bench-client")
    run = f"bench:{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-timeline-") as stamps_dir:
        try:
            publish(app, task, count, args)
        finally:
            close_app(app)
        worker = start_worker(
            spawner,
            config,
            counter_url=counter,
            run=run,
            concurrency=concurrency,
            floor_table=floor,
            extra_env={TIMELINE: stamps_dir},
        )
        try:
            first, last = wait_done(counter, run, count, worker=worker, timeout=60 + count / 20)
        finally:
            worker.stop(timeout=15)
        jobs = [
            job
            for path in Path(stamps_dir).glob("*.json")
            for job in jobs_of([tuple(s) for s in json.loads(path.read_text())])
        ]
    if not jobs:
        raise RuntimeError(f"{task}: the pool processes wrote no stamps")
    medians = {name: statistics.median(job[name] for job in jobs) for name in jobs[0]}
    return medians | {"per_s": (count - 1) / (last - first)}


def main(argv: Sequence[str] | None = None) -> None:
    options = parser(__doc__)
    options.add_argument("--concurrency", type=int, default=1, help="pool processes (-c)")
    options.add_argument("--rounds", type=int, help="rounds of the three variants (3; quick 1)")
    options.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    args = options.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    rows = []
    with (
        scratch(POSTGRES_URL, "timeline") as table,
        tempfile.TemporaryDirectory(prefix="bench-timeline-logs-") as logs,
        private_redis_url() as counter,
        floor_table() as floor,
    ):
        queue = f"bench_q_{uuid.uuid4().hex[:8]}"
        config = {
            "broker_url": counter,
            "task_default_queue": queue,
            "control_exchange": f"{queue}_control",
            "leases_database_url": POSTGRES_URL,
            "leases_table": table,
        }
        spawner = Spawner(logs)
        try:
            for kind in args.kinds:
                body, task_args, count = KINDS[kind]
                count = count // 2 if args.quick else count
                runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
                for repeat in range(rounds):
                    for variant in VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3]:
                        measured = run_once(
                            spawner, config, counter=counter, floor=floor,
                            task=f"bench.{variant}_{body}", args=task_args, count=count,
                            concurrency=args.concurrency,
                        )  # fmt: skip
                        runs[variant].append(measured)
                        print(
                            f"{kind} {variant}: {measured['per_s']:.1f}/s, cycle "
                            f"{measured['cycle']:.2f} ms",
                            flush=True,
                        )
                for variant in VARIANTS:
                    median = {
                        name: statistics.median(r[name] for r in runs[variant])
                        for name in runs[variant][0]
                    }
                    rows.append(
                        row(
                            COLUMNS,
                            kind,
                            variant,
                            median["per_s"],
                            *(median[s] for s in SEGMENTS),
                            median["python"],
                        )
                    )
        finally:
            spawner.stop_all()
    title = (
        f"A job's time in a pool process, -c {args.concurrency} (medians of {rounds} rounds; ms)"
    )
    report("timeline", rows, quick=args.quick, title=title, rounds=rounds)


if __name__ == "__main__":
    main()
