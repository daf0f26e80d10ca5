"""Newest wins: how soon a newer call stops the running job of its key, and starts its own run.

A real ``celery worker`` (prefork, one pool process) runs ``e2e.keyed_units`` of
``tests/support/apps/leased_app.py`` (lease key ``account:<account>``): each unit sleeps
``--interval`` seconds, then commits its checkpoint and the key's cursor in one transaction
and calls ``stop_point()``, so the checkpoint interval is the unit's length. The client is this
process: while a long run of the key is past its first unit, after a random part of one
interval (the call lands anywhere between two checkpoints), it calls
``apply_async(..., lease_key_strategy="newest")`` once. Three times, all the database clock:

- **trigger -> stop**: from the call to the superseded job's end (``finished_at``), in seconds
  and in checkpoint intervals: the running attempt sees the request at its next checkpoint,
  so at most about one interval, plus the end's write;
- **stop -> follow-up**: from that end to the claim of the call's run (``claimed_at``): the
  worker that ends the job records and publishes the run right after its end;
- **trigger -> follow-up**: the two together, what the caller waits before its run starts.

SQLite (a file) + Redis (the broker), one worker. ``--runs`` runs (10; quick 5).

    python -m bench.newest [--quick] [--runs N] [--interval S]
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import parser, redis_bed, report, row
from tests.support.scenario import Scenario

TASK = "e2e.keyed_units"
#: The long run the newer call supersedes (it never gets near its end).
BUSY_UNITS = 10_000
COLUMNS = "measure runs median_s worst_s best_s median_intervals worst_intervals"


def supersede_once(s: Scenario, interval: float) -> tuple[float, float]:
    """One run superseded by one call: (trigger -> stop, stop -> follow-up), seconds."""
    task = s.app.tasks[TASK]
    account = f"newest-{uuid.uuid4().hex[:8]}"
    busy = s.send(TASK, account, BUSY_UNITS, interval)
    s.wait_unit(busy, unit=1, timeout=30)
    time.sleep(random.uniform(0, interval))
    called = s.store.now()
    followup = str(
        task.apply_async((account, 1, 0.0), lease_key_strategy="newest").id  # one short unit
    )
    ended = s.wait_finished(busy, timeout=30)
    assert ended.state == "superseded" and ended.finished_at is not None, ended
    started = s.wait_finished(followup, timeout=30)
    assert started.state == "done" and started.claimed_at is not None, started
    stop, start = ended.finished_at - called, started.claimed_at - ended.finished_at
    print(
        f"stopped {stop:.3f} s ({stop / interval:.2f} intervals) after the call; its run "
        f"claimed {start * 1000:.1f} ms later",
        flush=True,
    )
    return stop, start


def measure(url: str, *, runs: int, interval: float) -> list[tuple[float, float]]:
    with redis_bed(url, "newest", workers=1) as s:
        return [supersede_once(s, interval) for _ in range(runs)]


def summary(name: str, seconds: list[float], interval: float) -> dict[str, Any]:
    return row(
        COLUMNS,
        name,
        len(seconds),
        statistics.median(seconds),
        max(seconds),
        min(seconds),
        statistics.median(seconds) / interval,
        max(seconds) / interval,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parser(__doc__)
    options.add_argument("--runs", type=int, help="runs superseded (10; quick 5)")
    options.add_argument(
        "--interval", type=float, default=0.2, help="checkpoint interval, seconds (0.2)"
    )
    args = options.parse_args(argv)
    runs = args.runs or (5 if args.quick else 10)
    with tempfile.TemporaryDirectory(prefix="bench-newest-sqlite-") as folder:
        url = f"sqlite:///{Path(folder) / 'leases.sqlite3'}"
        found = measure(url, runs=runs, interval=args.interval)
    stops, starts = [f[0] for f in found], [f[1] for f in found]
    rows = [
        summary("trigger -> stop", stops, args.interval),
        summary("stop -> follow-up claim", starts, args.interval),
        summary("trigger -> follow-up claim", [a + b for a, b in found], args.interval),
    ]
    report(
        "newest",
        rows,
        quick=args.quick,
        title=(
            f"Newest wins on SQLite + Redis, one worker: a call superseding a running job "
            f"(checkpoint interval {args.interval} s; seconds, DB clock)"
        ),
        interval_seconds=args.interval,
        raw=found,
        argv=argv,
    )


if __name__ == "__main__":
    main()
