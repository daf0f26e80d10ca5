"""Debounce: a burst of triggers of one key runs once, a quiet period after its last trigger.

A real ``celery worker`` runs ``e2e.keyed_units`` of ``tests/support/apps/leased_app.py``
(lease key ``account:<account>``); the client is this process, calling ``apply_async(...,
lease_debounce=(quiet, max_wait))`` as a webhook receiver would: ``--triggers`` calls (50)
``--gap`` seconds apart (0.1) on one account, the n-th asking for n units of no time, with a
quiet period of ``--quiet`` (2 s) and a maximum wait of ``--max-wait`` (30 s).

Measured on the database clock: from the last trigger (the clock read right after its call
returned) to the run's claim (``claimed_at``): the delay, and its error against the quiet
period. Checked: every call returned one id, the key has one job, it ran once (one attempt)
with the last trigger's arguments (its result is the last trigger's unit count).

SQLite (a file) + Redis, and PostgreSQL + Redis.

    python -m bench.debounce [--quick] [--runs N] [--triggers N] [--gap S] [--quiet S]
        [--max-wait S] [--database sqlite postgres]
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import available, parser, print_rows, redis_bed, report, row
from tests.support.scenario import Scenario

TASK = "e2e.keyed_units"
COLUMNS = "database run triggers burst_s runs delay_s error_s checked"


def burst(
    s: Scenario,
    database: str,
    run: int,
    *,
    triggers: int,
    gap: float,
    debounce: tuple[float, float],
) -> dict[str, Any]:
    """One burst of ``triggers`` calls ``gap`` seconds apart on a fresh account; its row."""
    task = s.app.tasks[TASK]
    account = f"deb-{uuid.uuid4().hex[:8]}"
    ids = set()
    began = s.store.now()
    for n in range(1, triggers + 1):
        ids.add(str(task.apply_async((account, n, 0.0), lease_debounce=debounce).id))
        if n < triggers:
            time.sleep(gap)
    last = s.store.now()
    (job_id,) = ids
    job = s.wait_finished(job_id, timeout=debounce[1] + 60)
    assert job.claimed_at is not None
    delay = job.claimed_at - last
    jobs = [j.id for j in s.store.list_jobs(limit=50) if j.lease_key == f"account:{account}"]
    checked = (
        len(ids) == 1
        and jobs == [job_id]
        and (job.state, job.attempts, job.result) == ("done", 1, triggers)
    )
    found = row(
        COLUMNS,
        database,
        run,
        triggers,
        last - began,
        len(jobs),
        delay,
        delay - debounce[0],
        "yes" if checked else "NO",
    )
    print(found, flush=True)
    return found


def measure(
    database: str, url: str, *, runs: int, triggers: int, gap: float, debounce: tuple[float, float]
) -> list[dict[str, Any]]:
    with redis_bed(url, "debounce", workers=1) as s:
        return [
            burst(s, database, run, triggers=triggers, gap=gap, debounce=debounce)
            for run in range(1, runs + 1)
        ]


def main(argv: Sequence[str] | None = None) -> None:
    options = parser(__doc__)
    options.add_argument("--runs", type=int, help="bursts per database (3; quick 1)")
    options.add_argument("--triggers", type=int, default=50, help="triggers per burst (50)")
    options.add_argument("--gap", type=float, default=0.1, help="seconds between triggers (0.1)")
    options.add_argument("--quiet", type=float, default=2.0, help="quiet period, seconds (2)")
    options.add_argument("--max-wait", type=float, default=30.0, help="maximum wait, s (30)")
    options.add_argument(
        "--database", nargs="+", choices=("postgres", "sqlite"), default=["sqlite", "postgres"]
    )
    args = options.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    debounce = (args.quiet, args.max_wait)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-debounce-sqlite-") as folder:
        for database in args.database:
            url = available("postgres") if database == "postgres" else None
            if database == "sqlite":
                url = f"sqlite:///{Path(folder) / 'leases.sqlite3'}"
            if url is None:
                continue
            rows += measure(
                database, url, runs=runs, triggers=args.triggers, gap=args.gap, debounce=debounce
            )
    errors = [r["error_s"] for r in rows]
    summary = (
        [
            row(
                "bursts median_error_s worst_error_s",
                len(errors),
                statistics.median(errors),
                max(errors, key=abs),
            )
        ]
        if errors
        else []
    )
    print_rows("Debounce error: (run claim - last trigger) - quiet (s, DB clock)", summary)
    report(
        "debounce",
        rows,
        quick=args.quick,
        title=(
            f"Debounce: {args.triggers} triggers {args.gap} s apart, quiet {args.quiet} s, "
            f"max wait {args.max_wait} s: one run, delay after the last trigger"
        ),
        summary=summary,
        argv=argv,
    )


if __name__ == "__main__":
    main()
