"""Crash to resume: how long a job waits after its worker dies, celery-leases vs plain Celery.

A 16-unit job (0.25 s a unit, a checkpoint after each) of ``tests/apps/leased_app.py`` on one
of two workers (``tests.support.scenario.Scenario``; Redis, PostgreSQL or MariaDB) is crashed
during unit 5; the figure is crash -> first unit of the next run, both from the unit log
(database clock). Leased: each ``--lease`` (2 s) with the reaper every ``--reaper-every``
(1 s) from a real beat; plain Celery in the same run, its runs interleaved with the leased ones:
``task_acks_late``, Redis ``visibility_timeout`` 10 s, unacked messages swept every second
(``unacked_restore_interval`` 1, throttle 1: kombu's default sweep is every ~100 s).
``redone_units``: units the crashed run had started (finished, or in flight at the crash) that
the next run started again; ``stale_units``: units the crashed run committed after the next
run had started (a frozen, then woken, run). ``worker SIGTERM (hand-off)`` is a warm
shutdown: the job hands back at its next checkpoint. ``stall``: the attempt hangs at the
start of unit 5 (an hour's sleep, as on a dead socket); leased with ``leases_stall_timeout``
2 s (``leases_kill_stalled`` on, the default); measured from the start of the hung unit.

    python -m bench.recovery [--quick] [--runs N] [--no-plain] [--lease S ...]
        [--reaper-every S ...] [--database postgres|mariadb] [--crash C ...] [--tag T]
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import available, parser, report, row, scratch
from tests.support.scenario import Scenario, freeze, kill_all, runs_of, thaw
from tests.support.service import POSTGRES_URL, private_redis_url
from tests.support.unit_log import Unit
from tests.support.worker import Spawner, Worker

UNITS, UNIT_SECONDS, CRASH_AT = 16, 0.25, 5
STALL_TIMEOUT = 2.0
#: Seconds a plain run waits for a hung task to move (it never does: nothing watches it).
PLAIN_STALL_WAIT = 20.0
#: Keywords of ``tests.support.apps.factory.app_env``, and seconds to wait for the next run.
MODES: dict[str, tuple[dict[str, Any], float]] = {
    "leased": ({"lease_seconds": 2.0, "reaper_every": 1.0}, 30.0),
    "plain": ({"acks_late": True, "visibility_timeout": 10, "restore_interval": 1}, 60.0),
}
COLUMNS = (
    "mode database lease_s reaper_s crash resumed median_s worst_s redone_units stale_units outcome"
)
CRASHES: dict[str, Callable[[Unit, Worker], None]] = {
    "pool process SIGKILL": lambda row, worker: os.kill(row.pid, signal.SIGKILL),
    "worker SIGKILL": lambda row, worker: worker.kill(),
    "worker SIGSTOP": lambda row, worker: freeze(worker),
    "worker SIGTERM (hand-off)": lambda row, worker: worker.signal(signal.SIGTERM),
    "stall": lambda row, worker: None,  # the task hangs by itself
}


def crash_once(
    mode: str, crash: str, *, database: str = POSTGRES_URL, **leased_options: Any
) -> dict[str, Any]:
    """Crash one job once; when its next run started and what the old run wrote after.
    ``leased_options`` override the leased mode's (``lease_seconds``, ``reaper_every``)."""
    leased, (options, timeout) = mode == "leased", MODES[mode]
    stall = crash == "stall"
    settings = {"leases_stall_timeout": STALL_TIMEOUT} if leased and stall else {}
    if leased:
        options = options | leased_options
        timeout = options["lease_seconds"] + options["reaper_every"] + timeout
    elif stall:
        timeout = PLAIN_STALL_WAIT
    with (
        private_redis_url() as broker,
        tempfile.TemporaryDirectory(prefix="bench-recovery-") as logs,
        scratch(database, "recovery") as table,
    ):
        spawner = Spawner(logs)
        s = Scenario.create(
            spawner,
            broker={"broker_url": broker} | settings,
            database_url=database,
            table=table,
            queue=f"{table}_queue",
            **options,
        )
        try:
            s.start_workers(2)
            if leased:
                s.start_beat()
            hang = {"hang_at": CRASH_AT, "hang_file": str(Path(logs) / "hung")} if stall else {}
            task = "e2e.units" if leased else "e2e.plain_units"
            job_id = s.send(task, UNITS, UNIT_SECONDS, kwargs=hang)
            row = s.wait_unit(job_id, unit=CRASH_AT, timeout=30)
            victim = s.worker_of(row)
            crashed_at = row.started_at if stall else s.log.now()
            CRASHES[crash](row, victim)
            resumed = next_run(s, job_id, crashed_at, timeout, None if leased else victim)
            if resumed is None:
                outcome = "not run again"
                if stall:
                    outcome += f" (hung, still waiting after {timeout:g} s)"
                elif _finished_by(s, job_id, row.run):
                    outcome += " (the stopping worker finished it: warm shutdown waits)"
                return {"mode": mode, "crash": crash, "seconds": None, "outcome": outcome}
            thaw(victim)
            if leased:
                s.wait_finished(job_id, timeout=60)
            else:
                time.sleep(UNITS * UNIT_SECONDS)
            rows = s.log.rows(job_id)
            last_started = max(r.unit for r in rows if r.run == row.run)
            return {
                "mode": mode,
                "crash": crash,
                "lease_s": options.get("lease_seconds"),
                "reaper_s": options.get("reaper_every"),
                "seconds": resumed.started_at - crashed_at,
                # Units the crashed run had started (finished or in flight) that the next
                # run started again.
                "redone_units": max(last_started - resumed.unit + 1, 0),
                "stale_units": sum(
                    r.run == row.run and (r.ended_at or 0) > resumed.started_at for r in rows
                ),
                "outcome": "resumed" if resumed.unit else "run again from unit 0",
            }
        finally:
            s.thaw_all()
            kill_all(spawner)
            s.close()


def next_run(
    s: Scenario, job_id: str, crashed_at: float, timeout: float, plain: Worker | None
) -> Unit | None:
    """The first unit of the first run started after the crash; None after ``timeout`` s, or
    once the ``plain`` Celery worker logged WorkerLostError (it then acks the message as
    failed, and the job never runs again) or finished the job (a warm shutdown)."""
    deadline = time.monotonic() + timeout
    for poll in itertools.count():
        runs = runs_of(s.log.rows(job_id))
        later = [r for r in runs if r.first.started_at > crashed_at]
        if later:
            return later[0].first
        if plain is not None and poll % 20 == 19 and _plain_ended(s, job_id, plain):
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    raise AssertionError("unreachable")


def _plain_ended(s: Scenario, job_id: str, worker: Worker) -> bool:
    """Plain Celery is done with the job: it acked it as failed, or a run finished it."""
    return "WorkerLostError" in worker.log_text() or _finished_by(s, job_id, None)


def _finished_by(s: Scenario, job_id: str, run: str | None) -> bool:
    """Whether the job's last unit was committed (by ``run``, if given)."""
    return any(
        r.unit == UNITS - 1 and r.committed and run in (None, r.run) for r in s.log.rows(job_id)
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parser(__doc__)
    options.add_argument("--runs", type=int, help="runs per crash and mode (10; --quick: 2)")
    options.add_argument("--no-plain", action="store_true", help="leave plain Celery out")
    options.add_argument(
        "--lease", type=float, nargs="+", default=[2.0], help="lease seconds to run (2)"
    )
    options.add_argument(
        "--reaper-every", type=float, nargs="+", default=[1.0], help="reaper intervals (1)"
    )
    options.add_argument("--database", choices=("postgres", "mariadb"), default="postgres")
    options.add_argument("--crash", choices=list(CRASHES), nargs="+", help="crashes to run (all)")
    options.add_argument("--tag", help="results go to bench/results/recovery-<tag>.json")
    args = options.parse_args(argv)
    runs = args.runs or (2 if args.quick else 10)
    database = POSTGRES_URL if args.database == "postgres" else available("mariadb")
    if database is None:
        raise SystemExit("mariadb is not reachable")
    crashes = args.crash or list(CRASHES)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("leased", {"lease_seconds": lease, "reaper_every": every})
        for lease, every in itertools.product(args.lease, args.reaper_every)
    ]
    if not (args.quick or args.no_plain):
        variants.append(("plain", {}))
    cells = [
        (mode, leased_options, crash) for mode, leased_options in variants for crash in crashes
    ]
    done: dict[int, list[dict[str, Any]]] = {n: [] for n in range(len(cells))}
    # Run by run, every cell once per round: drift on the machine hits every cell alike.
    for _ in range(runs):
        for n, (mode, leased_options, crash) in enumerate(cells):
            done[n].append(crash_once(mode, crash, database=database, **leased_options))
            print(done[n][-1], flush=True)
    rows, results = [], []
    for n, (mode, leased_options, crash) in enumerate(cells):
        results += done[n]
        seconds = [r["seconds"] for r in done[n] if r["seconds"] is not None]
        median = statistics.median(seconds) if seconds else None
        worst = max(seconds) if len(seconds) == runs else None  # None: some run never resumed
        redone = max(r.get("redone_units", 0) for r in done[n])
        stale = max(r.get("stale_units", 0) for r in done[n])
        outcome = "; ".join(sorted({r["outcome"] for r in done[n]}))
        values = (
            mode,
            args.database,
            leased_options.get("lease_seconds"),
            leased_options.get("reaper_every"),
            crash,
            f"{len(seconds)}/{runs}",
            median,
            worst,
            redone,
            stale,
            outcome,
        )
        rows.append(row(COLUMNS, *values))
    title = "Crash -> first unit of the next run (s)"
    name = f"recovery-{args.tag}" if args.tag else "recovery"
    report(name, rows, quick=args.quick, title=title, modes=MODES, runs=results, argv=argv)


if __name__ == "__main__":
    main()
