"""Crash to resume: how long a job waits after its worker dies, celery-leases vs plain Celery.

``python -m bench.recovery [--quick] [--runs N] [--plain-timeout S] [--no-plain]``

For each crash kind (the pool process SIGKILLed, the whole worker SIGKILLed, the whole worker
frozen with SIGSTOP), a 16-unit job (0.25 s a unit) is crashed during unit 5 with a second
worker idle, and we time from the crash (database clock) to the first unit of the attempt that
runs next (the unit log of ``tests/apps/leased_app.py``, same clock):

- celery-leases: early ack, lease 2 s, ``celery_leases.reap`` every 1 s from a real beat,
  Redis broker, PostgreSQL store;
- plain Celery (``e2e.plain_units``, no lease): ``task_acks_late`` on Redis with
  ``visibility_timeout`` 10 s and kombu's default restore sweep.

A frozen worker is woken (SIGCONT) once the job runs elsewhere; we record whether its stale
attempt then wrote anything. Prints a table and writes ``bench/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    POSTGRES_URL,
    REDIS_URL,
    drop_tables,
    print_table,
    private_redis,
    write_result,
)
from tests.apps.leased_app import app_env
from tests.apps.unit_log import Unit
from tests.e2e_support import Scenario, close_app, freeze, kill_all, runs_of, thaw
from tests.workers import Spawner

UNITS = 16
UNIT_SECONDS = 0.25
CRASH_AT_UNIT = 5
LEASE_SECONDS = 2.0
REAPER_EVERY = 1.0
VISIBILITY_TIMEOUT = 10
KINDS = ("pool process SIGKILL", "whole worker SIGKILL", "whole worker SIGSTOP")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 runs, no plain Celery")
    parser.add_argument("--runs", type=int, default=None, help="runs per crash kind (5)")
    parser.add_argument(
        "--plain-timeout", type=float, default=150.0, help="seconds to wait for plain Celery"
    )
    parser.add_argument("--no-plain", action="store_true", help="skip plain Celery")
    parser.add_argument(
        "--from-json", metavar="PATH", help="measure nothing: summarize the runs of a result file"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        document = json.loads(Path(args.from_json).read_text())
        kept = {k: document[k] for k in ("finished_at", "command", "machine") if k in document}
        report(
            document["runs"], document["settings"], quick=document.get("quick", False), kept=kept
        )
        return 0
    runs = args.runs or (2 if args.quick else 5)
    plain = not (args.no_plain or args.quick)

    measured: dict[str, dict[str, list[dict[str, Any]]]] = {"leased": {}, "plain": {}}
    for mode in ("leased", "plain") if plain else ("leased",):
        for kind in KINDS:
            results = measured[mode].setdefault(kind, [])
            for number in range(1, runs + 1):
                result = measure_retrying(mode, kind, plain_timeout=args.plain_timeout)
                results.append(result)
                print(f"{mode:6} {kind:22} run {number}: {describe(result)}", flush=True)
    settings = {
        "units": UNITS,
        "unit_seconds": UNIT_SECONDS,
        "crash_at_unit": CRASH_AT_UNIT,
        "lease_seconds": LEASE_SECONDS,
        "reaper_every_seconds": REAPER_EVERY,
        "plain_visibility_timeout_seconds": VISIBILITY_TIMEOUT,
        "plain_timeout_seconds": args.plain_timeout if plain else None,
        "runs": runs,
        "broker": "redis",
        "store": "postgresql",
    }
    report(measured, settings, quick=args.quick)
    return 0


def report(
    measured: dict[str, dict[str, list[dict[str, Any]]]],
    settings: dict[str, Any],
    *,
    quick: bool,
    kept: dict[str, Any] | None = None,
) -> None:
    """Print the table and write ``bench/results/recovery.json`` (``kept``: fields of an
    earlier result file to keep as they were, such as when and where it was measured)."""
    plain = bool(measured.get("plain"))
    rows = []
    summary: dict[str, Any] = {}
    for kind in KINDS:
        leased = figures(measured["leased"][kind])
        row: list[Any] = [kind, _s(leased["median_s"]), _s(leased["worst_s"]), leased["redone"]]
        summary[kind] = {"leased": leased}
        if plain:
            baseline = figures(measured["plain"][kind])
            summary[kind]["plain"] = baseline
            row += [_s(baseline["median_s"]), _s(baseline["worst_s"]), baseline["outcome"]]
        rows.append(row)
    headers = ["crash", "leases median s", "leases worst s", "leases units redone"]
    if plain:
        headers += ["plain median s", "plain worst s", "plain Celery outcome"]
    print_table(
        f"crash -> first unit of the next attempt (runs per cell: {settings['runs']}; leases: "
        f"lease {settings['lease_seconds']:g} s, reaper every {settings['reaper_every_seconds']:g}"
        f" s; plain: acks_late, Redis visibility_timeout "
        f"{settings['plain_visibility_timeout_seconds']} s)",
        headers,
        rows,
    )
    data: dict[str, Any] = {"settings": settings, "summary": summary, "runs": measured}
    if kept:
        data |= kept | {"summarized_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_result("recovery", data, quick=quick)


def measure_retrying(mode: str, kind: str, *, plain_timeout: float) -> dict[str, Any]:
    """``measure``, again (up to 3 tries) when a service fails under it, e.g. a PostgreSQL or
    Redis restarted by something else on a shared machine."""
    error = ""
    for attempt in range(1, 4):
        try:
            before = services_started()
            result = measure(mode, kind, plain_timeout=plain_timeout)
            if services_started() == before:
                return result
            error = "PostgreSQL or Redis restarted during the run"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(f"{mode} {kind}: try {attempt} failed ({error}); again", flush=True)
        time.sleep(5)
    return {"seconds": None, "outcome": f"error: {error}"}


def services_started() -> tuple[Any, Any]:
    """When PostgreSQL and Redis last started: a run that spans a restart measures nothing."""
    import redis
    import sqlalchemy as sa

    engine = sa.create_engine(POSTGRES_URL)
    try:
        with engine.connect() as connection:
            postgres = connection.execute(sa.text("SELECT pg_postmaster_start_time()")).scalar()
    finally:
        engine.dispose()
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        run_id = client.info("server")["run_id"]
    finally:
        client.close()
    return postgres, run_id


def measure(mode: str, kind: str, *, plain_timeout: float) -> dict[str, Any]:
    """One crash of one job; what happened after it."""
    leased = mode == "leased"
    table = f"bench_recovery_{uuid.uuid4().hex[:6]}"
    queue = f"bench_recovery_q_{uuid.uuid4().hex[:6]}"
    with private_redis() as broker, tempfile.TemporaryDirectory(prefix="bench-recovery-") as logs:
        options: dict[str, Any] = (
            {"lease_seconds": LEASE_SECONDS, "reaper_every": REAPER_EVERY}
            if leased
            else {"acks_late": True, "visibility_timeout": VISIBILITY_TIMEOUT}
        )
        env = app_env(
            broker_url=broker, database_url=POSTGRES_URL, table=table, queue=queue, **options
        )
        spawner = Spawner(log_dir=logs)
        s = Scenario(spawner, env)
        try:
            s.start_workers(2)
            if leased:
                s.start_beat()
            job_id = s.send("e2e.units" if leased else "e2e.plain_units", UNITS, UNIT_SECONDS)
            row = s.wait_unit(job_id, unit=CRASH_AT_UNIT, timeout=30)
            victim = s.worker_of(row)
            crashed_at = s.log.now()
            if kind == KINDS[0]:
                os.kill(row.pid, signal.SIGKILL)
            elif kind == KINDS[1]:
                victim.kill()
            else:
                freeze(victim)
            timeout = 30.0 if leased else plain_timeout
            lost = None if leased else message_gone(s, broker, queue, job_id)
            resumed = wait_next_run(s, job_id, crashed_at, timeout=timeout, lost=lost)
            result: dict[str, Any] = {
                "crashed_unit": row.unit,
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
            if resumed is None:
                result["seconds"] = None
                result["outcome"] = (
                    "never: the message was acked as failed"
                    if lost is not None and lost()
                    else f"not re-run within {timeout:.0f} s"
                )
                return result
            result["seconds"] = resumed.started_at - crashed_at
            result["resumed_at_unit"] = resumed.unit
            result["redone_units"] = row.unit - resumed.unit + 1
            result["other_worker"] = s.worker_of(resumed) is not victim
            if kind == KINDS[2]:
                thaw(victim)
                time.sleep(3.0 if not leased else 0.0)
            if leased:
                job = s.wait_finished(job_id, timeout=30)
                result["final_state"] = job.state
            else:
                time.sleep(UNITS * UNIT_SECONDS)
            rows = s.log.rows(job_id)
            stale_writes = [
                r for r in rows if r.run == row.run and r.committed and r.unit >= row.unit
            ]
            result["stale_attempt_committed_units"] = len(stale_writes)
            result["concurrent_runs"] = concurrent(rows)
            result["outcome"] = "resumed" if leased else "re-run from unit 0"
            return result
        finally:
            s.thaw_all()
            kill_all(spawner)
            close_app(s.app)
            s.log.dispose()
            with contextlib.suppress(Exception):
                s.store.engine.dispose()
            drop_tables(POSTGRES_URL, table)


def wait_next_run(
    s: Scenario,
    job_id: str,
    crashed_at: float,
    *,
    timeout: float,
    lost: Callable[[], bool] | None,
) -> Unit | None:
    """The first unit of the first run that started after the crash, or None by ``timeout``."""
    deadline = time.monotonic() + timeout
    checked_lost = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        later = [run for run in runs_of(s.log.rows(job_id)) if run.first.started_at > crashed_at]
        if later:
            return later[0].first
        if lost is not None and time.monotonic() > checked_lost:
            if lost():
                return None
            checked_lost = time.monotonic() + 2.0
        time.sleep(0.05)
    return None


def message_gone(s: Scenario, broker: str, queue: str, job_id: str) -> Callable[[], bool]:
    """For plain Celery on Redis: True once no copy of the job's message is left anywhere
    (not queued, not unacked), so it can never run again."""
    import redis

    def gone() -> bool:
        client = redis.Redis.from_url(broker)
        try:
            queued = any(job_id.encode() in m for m in client.lrange(queue, 0, -1))
            unacked = any(job_id.encode() in m for m in client.hvals("unacked"))
            return not (queued or unacked)
        finally:
            client.close()

    return gone


def concurrent(rows: list[Unit]) -> bool:
    """True if two runs worked at the same moment: a unit of one started while a committed unit
    of another was in progress (an uncommitted unit counts from its start only: a killed
    attempt's end is not logged)."""
    spans = sorted((u.started_at, u.ended_at or u.started_at, u.run) for u in rows)
    return any(b[0] < a[1] and a[2] != b[2] for i, a in enumerate(spans) for b in spans[i + 1 :])


def figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst seconds of the runs that measured something (a run that a service
    restart spoiled three times is left out and counted under ``errors``)."""
    valid = [r for r in results if not str(r["outcome"]).startswith("error:")]
    seconds = [float(r["seconds"]) for r in valid if r["seconds"] is not None]
    redone = sorted({int(r["redone_units"]) for r in valid if r.get("redone_units") is not None})
    stale = {
        int(r["stale_attempt_committed_units"])
        for r in valid
        if "stale_attempt_committed_units" in r
    }
    return {
        "median_s": statistics.median(seconds) if seconds else None,
        # None when some run never resumed: the worst case is "never".
        "worst_s": max(seconds) if seconds and len(seconds) == len(valid) else None,
        "resumed": f"{len(seconds)}/{len(valid)}",
        "errors": len(results) - len(valid),
        "redone": "/".join(str(r) for r in redone) or "-",
        "outcome": "; ".join(sorted({str(r["outcome"]) for r in valid})),
        "stale_attempt_committed_units": sorted(stale),
        "concurrent_runs": any(r.get("concurrent_runs") for r in valid),
    }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def describe(result: dict[str, Any]) -> str:
    if result["seconds"] is None:
        return str(result["outcome"])
    extra = {k: v for k, v in result.items() if k not in ("seconds", "outcome")}
    return f"{result['seconds']:.2f} s, {result['outcome']} {json.dumps(extra)}"


if __name__ == "__main__":
    sys.exit(main())
