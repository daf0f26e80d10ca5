"""Groups: per-tenant fairness, a global rate limit, and what admission costs.

A real ``celery worker`` with 8 prefork processes runs the e2e tasks of
``tests/support/apps/leased_app.py`` (``e2e.units``, leased, grouped per call; ``e2e.plain_units``,
plain Celery); the client is this process. PostgreSQL + Redis.

- **fairness**: tenant A sends ``--jobs`` jobs of one 0.5 s unit at once, tenant B one such
  job 1 s later (``--runs`` times with groups, ``--plain-runs`` times in plain Celery, each
  on a fresh table and broker; the median and the worst of B's waits). With groups (each
  tenant a group, limit 2), A has at most 2 jobs in the broker or running and the rest wait
  in the database, so B's job is published at once; in plain
  Celery B's job waits behind A's whole queue. B's wait: from its send to its unit's start
  (database clock). Also the most jobs of A running at once (from the unit log).
- **rate**: 200 jobs of one group at ``lease_group_rate="10/s"`` (no concurrency limit), one
  unit of 0.01 s each, sent at once, run by ``--rate-workers`` workers of 2 processes each (a
  limit held in the database, not per worker): the most not-before times (``run_after``, written at
  admission: the bucket holds one token, as Celery's) and the most actual starts in any 1 s
  window, how late each started after its time, and the time from the first start to the
  last against the ideal 19.9 s.
- **cost**: the statements a client sends for one ``apply_async`` with and without a group,
  and those of one admission after an end (counted on the store's connection); then the
  throughput of ``--jobs`` no-op leased jobs (sent first, then drained by the worker), without
  a group, in one group of limit 8 (the worker's processes: each job is published only once
  one ends) and of limit 64 (the broker always holds some), from the first claim to the last
  end (database clock).
- **reaper**: ``--full-groups`` groups (500) of limit 1, each with one job admitted (in the
  broker) and one waiting, then one group whose admitted job ended with no one admitting its
  next (the worker died first): room, and a job that only a reaper pass admits. Its group is
  created last and named to sort last, behind every full group in any order a pass could take
  them. One real reaper pass (the ``celery_leases.reap`` task, run in this process): its time,
  its statements (on the store's direct connections and through its engine), and what it
  admitted (it must be that one job, and
  nothing of the full groups); then 5 passes with nothing to admit (median).

    python -m bench.groups [--quick] [--jobs N] [--runs N] [--plain-runs N] [--rate-workers N]
        [--full-groups N] [--parts fairness rate cost reaper]
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import sqlalchemy as sa

from bench.common import (
    available,
    bench_scenario,
    parser,
    print_rows,
    report,
    row,
    scratch,
)
from celery_leases.config import settings_for
from celery_leases.db import store_for
from celery_leases.db.rows import Claimed
from celery_leases.reaper import REAP_TASK, register_reaper
from tests.support.driver import executed
from tests.support.scenario import Scenario, kill_all
from tests.support.service import private_redis_url
from tests.support.worker import Spawner

UNIT_SECONDS = 0.5
FAIRNESS_COLUMNS = "mode a_jobs a_send_s b_wait_s a_most_at_once"
FAIRNESS_SUMMARY_COLUMNS = "mode runs b_wait_median_s b_wait_worst_s a_most_at_once"
RATE_COLUMNS = (
    "rate jobs most_due_in_1s min_due_gap_s most_starts_in_1s min_start_gap_s "
    "late_median_s late_max_s first_to_last_s ideal_s"
)
COST_COLUMNS = "what statements kinds"
REAPER_COLUMNS = "database full_groups pass admitted admitted_the_one statements seconds"
THROUGHPUT_COLUMNS = "mode jobs seconds jobs_per_s"


def wait_started(s: Scenario, job_id: str, timeout: float) -> float:
    """The database time the first unit of ``job_id`` started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = s.log.rows(job_id)
        if rows:
            return min(u.started_at for u in rows)
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} did not start within {timeout} s")


def most_in_a_second(times: list[float]) -> int:
    """The most of ``times`` in any window of one second [t, t + 1)."""
    return max(sum(1 for t in times if t0 <= t < t0 + 1.0) for t0 in times)


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most intervals (start, end) open at one time."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


def fairness(s: Scenario, *, jobs: int, grouped: bool) -> dict[str, Any]:
    """B's wait behind A's ``jobs`` (seconds), with groups (limit 2) or in plain Celery."""
    a_group, b_group = f"A-{uuid.uuid4().hex[:6]}", f"B-{uuid.uuid4().hex[:6]}"
    began = time.perf_counter()
    if grouped:
        task = s.app.tasks["e2e.units"]
        a_ids = [
            str(task.apply_async((1, UNIT_SECONDS), lease_group=a_group, lease_group_limit=2).id)
            for _ in range(jobs)
        ]
    else:
        task = s.app.tasks["e2e.plain_units"]
        a_ids = [str(task.apply_async((1, UNIT_SECONDS)).id) for _ in range(jobs)]
    send_s = time.perf_counter() - began
    time.sleep(1.0)
    sent_at = s.log.now()
    if grouped:
        b = task.apply_async((1, UNIT_SECONDS), lease_group=b_group, lease_group_limit=2)
    else:
        b = task.apply_async((1, UNIT_SECONDS))
    started = wait_started(s, str(b.id), timeout=jobs * UNIT_SECONDS / 8 + 60)
    spans = [(u.started_at, u.ended_at or s.log.now()) for j in a_ids for u in s.log.rows(j)]
    found = row(
        FAIRNESS_COLUMNS,
        "celery-leases groups (limit 2)" if grouped else "plain Celery",
        jobs,
        send_s,
        started - sent_at,
        most_at_once(spans),
    )
    print(found, flush=True)
    return found


def fairness_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """B's wait over the runs of each mode: the median and the worst."""
    summary = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        waits = [r["b_wait_s"] for r in runs if r["mode"] == mode]
        most = max(r["a_most_at_once"] for r in runs if r["mode"] == mode)
        summary.append(
            row(
                FAIRNESS_SUMMARY_COLUMNS,
                mode,
                len(waits),
                statistics.median(waits),
                max(waits),
                most,
            )
        )
    return summary


def rate(s: Scenario, *, jobs: int = 200) -> dict[str, Any]:
    group = f"R-{uuid.uuid4().hex[:6]}"
    task = s.app.tasks["e2e.units"]
    ids = [
        str(task.apply_async((1, 0.01), lease_group=group, lease_group_rate="10/s").id)
        for _ in range(jobs)
    ]
    for job_id in ids:
        s.wait_finished(job_id, timeout=120)
    starts = sorted(min(u.started_at for u in s.log.rows(j)) for j in ids)
    t = s.store.table
    with s.store.engine.connect() as connection:
        due = dict(
            connection.execute(sa.select(t.c.id, t.c.run_after).where(t.c.id.in_(ids))).all()
        )
    dues = sorted(float(d) for d in due.values())
    late = sorted(min(u.started_at for u in s.log.rows(j)) - float(due[j]) for j in ids)
    found = row(
        RATE_COLUMNS,
        "10/s",
        jobs,
        most_in_a_second(dues),
        min(b - a for a, b in pairwise(dues)),
        most_in_a_second(starts),
        min(b - a for a, b in pairwise(starts)),
        statistics.median(late),
        late[-1],
        starts[-1] - starts[0],
        (jobs - 1) / 10.0,
    )
    print(found, flush=True)
    return found


def statements(s: Scenario) -> list[dict[str, Any]]:
    """Statements on the store's connection: one apply_async without a group, in a group with
    room (record, then the admission that admits it), in a full group (record, then an
    admission that admits nothing), and the admission a worker runs after an end."""
    store = s.store
    task = s.app.tasks["e2e.units"]
    idle = f"{s.app.conf.task_default_queue}_unread"
    # The schema check, and each statement's first runs (psycopg prepares it), out of the way
    warm = {"lease_group": f"W-{uuid.uuid4().hex[:6]}", "lease_group_limit": 1}
    for _ in range(6):
        task.apply_async((0, 0.0), queue=idle)
        task.apply_async((0, 0.0), queue=idle, **warm)
    with executed() as plain:
        task.apply_async((0, 0.0), queue=idle)
    group = {"lease_group": f"C-{uuid.uuid4().hex[:6]}", "lease_group_limit": 1}
    with executed() as admitted:
        first = task.apply_async((0, 0.0), queue=idle, **group)
    with executed() as waiting:
        task.apply_async((0, 0.0), queue=idle, **group)
    job = store.get(str(first.id))
    assert job is not None
    claimed = store.claim(job.message, owner="bench/1", duration=30.0)
    assert isinstance(claimed, Claimed)
    store.finish(job.id, claimed.token, result=None)
    with executed() as after_end:
        next_ones = store.admit(group["lease_group"])
    assert len(next_ones) == 1
    rows = [
        row(COST_COLUMNS, "apply_async, no group (record)", *shown(plain)),
        row(
            COST_COLUMNS, "apply_async in a group with room (record + admission)", *shown(admitted)
        ),
        row(COST_COLUMNS, "apply_async in a full group (record + admission)", *shown(waiting)),
        row(COST_COLUMNS, "a worker's admission after an end (admits one)", *shown(after_end)),
    ]
    for found in rows:
        print(found, flush=True)
    return rows


def shown(seen: list[Any]) -> tuple[int, str]:
    """How many statements ran (``tests.support.driver.executed``), and their first words."""
    kinds = [" ".join(compiled.sql.split()[:2]) for _, compiled, _ in seen]
    return len(seen), ", ".join(kinds)


def throughput(s: Scenario, *, jobs: int, limit: int | None) -> dict[str, Any]:
    task = s.app.tasks["e2e.units"]
    options: dict[str, Any] = {}
    if limit is not None:
        options = {"lease_group": f"T-{uuid.uuid4().hex[:6]}", "lease_group_limit": limit}
    ids = [str(task.apply_async((0, 0.0), **options).id) for _ in range(jobs)]
    workers = s.start_workers(1, concurrency=8)
    for job_id in ids:
        s.wait_finished(job_id, timeout=600)
    for worker in workers:
        worker.terminate()
        worker.stop(timeout=10)
    finished = [s.job(job_id) for job_id in ids]
    first = min(j.claimed_at or 0.0 for j in finished)
    last = max(j.finished_at or 0.0 for j in finished)
    found = row(
        THROUGHPUT_COLUMNS,
        "no group" if limit is None else f"one group, limit {limit}",
        jobs,
        last - first,
        jobs / (last - first),
    )
    print(found, flush=True)
    return found


def reaper_pass(s: Scenario, db: str, *, full_groups: int) -> list[dict[str, Any]]:
    """A reaper pass over ``full_groups`` full groups and one with room behind them (the
    module's docstring, **reaper**): one pass that admits, then the median of 5 with nothing
    to admit."""
    store = s.store
    task = s.app.tasks["e2e.units"]
    unread = f"{s.app.conf.task_default_queue}_unread"  # no worker reads it
    tag = uuid.uuid4().hex[:6]
    for n in range(full_groups):
        full = {"lease_group": f"A-{tag}-{n:04d}", "lease_group_limit": 1}
        task.apply_async((0, 0.0), queue=unread, **full)  # admitted: the group is full
        task.apply_async((0, 0.0), queue=unread, **full)  # waits
    room = {"lease_group": f"Z-{tag}", "lease_group_limit": 1}
    first = str(task.apply_async((0, 0.0), queue=unread, **room).id)
    the_one = str(task.apply_async((0, 0.0), queue=unread, **room).id)
    job = store.get(first)
    assert job is not None
    claimed = store.claim(job.message, owner="bench/1", duration=30.0)
    assert isinstance(claimed, Claimed)
    store.finish(first, claimed.token, result=None)  # no admission after it: room, one waiting
    register_reaper(s.app)
    reap = s.app.tasks[REAP_TASK]
    # The pass's statements: on the store's direct connections, and through its engine's pool
    engine = store_for(settings_for(s.app)).engine
    rows = []
    for label, passes in (("the pass that admits", 1), ("idle pass, median of 5", 5)):
        seconds, admitted, counted = [], [], []
        for _ in range(passes):
            through_engine: list[str] = []

            def listener(*event: Any, seen: list[str] = through_engine) -> None:
                seen.append(event[2])

            sa.event.listen(engine, "before_cursor_execute", listener)
            try:
                with executed() as direct:
                    started = time.perf_counter()
                    outcome = reap.apply().get()
                    seconds.append(time.perf_counter() - started)
            finally:
                sa.event.remove(engine, "before_cursor_execute", listener)
            admitted.append(outcome["admitted"])
            counted.append(len(direct) + len(through_engine))
        found = row(
            REAPER_COLUMNS,
            db,
            full_groups,
            label,
            len(admitted[0]),
            ("yes" if admitted[0] == [the_one] else "no") if passes == 1 else "-",
            int(statistics.median(counted)),
            statistics.median(seconds),
        )
        print(found, flush=True)
        rows.append(found)
    if rows[0]["admitted_the_one"] != "yes":
        raise RuntimeError(f"the pass admitted {rows[0]['admitted']} jobs, not the one with room")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    options = parser(__doc__)
    options.add_argument("--jobs", type=int, help="tenant A's jobs, and the no-op jobs (1000)")
    options.add_argument("--runs", type=int, help="fairness runs with groups (10; quick 2)")
    options.add_argument(
        "--plain-runs", type=int, help="fairness runs in plain Celery (2; quick 1)"
    )
    options.add_argument(
        "--rate-workers", type=int, default=4, help="workers (2 processes each) of the rate run (4)"
    )
    options.add_argument(
        "--full-groups", type=int, default=500, help="full groups of the reaper pass (500)"
    )
    options.add_argument(
        "--parts",
        nargs="+",
        choices=("fairness", "rate", "cost", "reaper"),
        default=["fairness", "rate", "cost", "reaper"],
        help="what to measure (all)",
    )
    args = options.parse_args(argv)
    jobs = args.jobs or (200 if args.quick else 1000)
    runs = {
        True: args.runs or (2 if args.quick else 10),
        False: args.plain_runs or (1 if args.quick else 2),
    }
    url = available("postgres")
    if url is None:
        return
    fair: list[dict[str, Any]] = []
    rated: list[dict[str, Any]] = []
    costs: list[dict[str, Any]] = []
    rates: list[dict[str, Any]] = []
    reaped: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-groups-") as logs:
        for grouped in (True, False) if "fairness" in args.parts else ():
            for _ in range(runs[grouped]):
                with private_redis_url() as broker, scratch(url, "groups") as table:
                    spawner = Spawner(logs)
                    s = bench_scenario(spawner, url, table, broker)
                    try:
                        s.start_workers(1, concurrency=8)
                        fair.append(fairness(s, jobs=jobs, grouped=grouped))
                    finally:
                        kill_all(spawner)
                        s.close()
        with private_redis_url() as broker, scratch(url, "groups") as table:
            spawner = Spawner(logs)
            s = bench_scenario(spawner, url, table, broker)
            try:
                if "rate" in args.parts:
                    s.start_workers(args.rate_workers, concurrency=2)
                    rated = [rate(s)]
                    kill_all(spawner)
                if "cost" in args.parts:
                    costs = statements(s)
                    # Twice, the order turned round: drift on a shared machine hits each mode
                    for limit in (None, 8, 64, 64, 8, None):
                        rates.append(throughput(s, jobs=jobs, limit=limit))
            finally:
                kill_all(spawner)
                s.close()
        for db in ("postgres", "mariadb") if "reaper" in args.parts else ():
            db_url = available(db)
            if db_url is None:
                continue
            with private_redis_url() as broker, scratch(db_url, "groups") as table:
                s = bench_scenario(Spawner(logs), db_url, table, broker)
                try:
                    reaped += reaper_pass(s, db, full_groups=args.full_groups)
                finally:
                    s.close()
    summary = fairness_summary(fair)
    if fair:
        print_rows("Fairness, every run", fair)
        print_rows("Fairness: tenant B's wait, median and worst", summary)
    print_rows(f"Rate limit: 200 jobs of one group at 10/s, {args.rate_workers} workers x 2", rated)
    print_rows("Statements on the store's connection", costs)
    print_rows("Throughput of no-op leased jobs, one worker -c 8", rates)
    print_rows(f"A reaper pass: {args.full_groups} full groups, one with room behind", reaped)
    report(
        "groups",
        fair,
        quick=args.quick,
        title="Fairness: tenant B's one job behind tenant A's queue (one worker, -c 8)",
        summary=summary,
        rate=rated,
        statements=costs,
        throughput=rates,
        reaper=reaped,
        argv=argv,
    )


if __name__ == "__main__":
    main()
