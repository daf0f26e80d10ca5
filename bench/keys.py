"""Lease keys: how many triggers one busy key absorbs, and how soon its follow-up run starts.

A real ``celery worker`` (two for the latency) runs ``e2e.keyed_units`` of
``tests/support/apps/leased_app.py`` (lease key ``account:<account>``); the client is this
process, calling ``apply_async`` through LeasedTask as a webhook receiver would.

- **absorb**: while a job of the key runs (one long run, started first), a loop of
  ``apply_async`` on that key for ``--seconds`` (a single client, then N threads at once);
  every call is a waiting trigger of the key, coalesced into the key's one follow-up id (one
  read of the job holding the key, then one upsert of the key's row, ``<table>_keys``, which
  keeps the first trigger's id and message and the latest one's time; nothing is published).
  Calls per second, and the median and p90 of one call. Checked: every call returned the
  same id, the one waiting on the key's row (``pending_id``), and the key has one job (the
  run). Next to it, in the same run, the same loop with a
  key of its own per call: a new job each (the read of the key's holder, the ``INSERT``, then
  a publish to a queue no worker reads), what each trigger costs when nothing coalesces it.
  Checked: an id per call.
- **follow-up latency**: a run of 3 units of 0.1 s, one trigger while it runs; from the run's
  end (``finished_at``) to the follow-up's claim (``claimed_at``), both the database clock.
  The worker that ends the run records and publishes the follow-up right after its finish;
  the other worker is idle. ``--runs`` runs (10), median and worst.

PostgreSQL + Redis, and SQLite (a file) + Redis (the broker carries only the follow-up's
message; on SQLite every coalesced call takes the database's one write lock).

    python -m bench.keys [--quick] [--seconds S] [--threads N ...] [--runs N]
        [--database postgres sqlite]
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.common import (
    available,
    median_ms,
    p90_ms,
    parser,
    print_rows,
    redis_bed,
    report,
    row,
)
from tests.support.scenario import Scenario

TASK = "e2e.keyed_units"
#: The long run that keeps the key busy while the clients call (cancelled once they are done).
BUSY_UNITS, BUSY_UNIT_SECONDS = 10_000, 0.1
#: The short runs of the latency measurement.
RUN_UNITS, RUN_UNIT_SECONDS = 3, 0.1
ABSORB_COLUMNS = "database trigger clients calls seconds calls_per_s median_ms p90_ms checked"
LATENCY_COLUMNS = "database runs median_s worst_s best_s"


def absorb(
    s: Scenario, database: str, *, seconds: float, threads: Sequence[int]
) -> list[dict[str, Any]]:
    """Triggers per second one busy key absorbs, for one client loop and each of ``threads``;
    after each, the same calls each on a key of its own (a new job per call, published to a
    queue no worker reads): what every trigger would cost without the key."""
    task = s.app.tasks[TASK]
    idle_queue = f"{s.app.conf.task_default_queue}_unread"
    rows = []
    for clients in (1, *threads):
        account = f"busy-{uuid.uuid4().hex[:8]}"
        busy = s.send(TASK, account, BUSY_UNITS, BUSY_UNIT_SECONDS)
        s.wait_unit(busy, unit=0, timeout=30)
        # The first trigger becomes the follow-up and gives it its arguments (no units: it
        # ends at once); the measured calls are coalesced into it.
        followup = str(task.apply_async((account, 0, 0.0)).id)
        times, ids, elapsed = call_for(
            lambda account=account: task.apply_async((account, 1, 0.0)), clients, seconds
        )
        # The triggers wait on the key's row until the run ends; the key has one job.
        key = f"account:{account}"
        jobs = [j.id for j in s.store.list_jobs(limit=20) if j.lease_key == key]
        one_followup = ids == {followup} and jobs == [busy] and waiting(s, key) == followup
        # The run is cancelled at its next unit; its follow-up then runs (no units) and ends.
        s.store.request_stop([busy], "cancel")
        s.wait_finished(busy, timeout=30)
        s.wait_finished(followup, timeout=30)
        fresh_times, fresh_ids, fresh_elapsed = call_for(
            lambda: task.apply_async(
                ("x", 1, 0.0), lease_key=f"fresh:{uuid.uuid4().hex}", queue=idle_queue
            ),
            clients,
            seconds,
        )
        shown = "1 loop" if clients == 1 else f"{clients} threads"
        for kind, found, took, check in (
            ("busy key (coalesced)", times, elapsed, one_followup),
            (
                "a key each (new job)",
                fresh_times,
                fresh_elapsed,
                len(fresh_ids) == len(fresh_times),
            ),
        ):
            rows.append(
                row(
                    ABSORB_COLUMNS,
                    database,
                    kind,
                    shown,
                    len(found),
                    took,
                    len(found) / took,
                    median_ms(found),
                    p90_ms(found),
                    "yes" if check else "NO",
                )
            )
            print(rows[-1], flush=True)
    return rows


def waiting(s: Scenario, key: str) -> str | None:
    """The id the triggers waiting on ``key`` were given (None: none waits)."""
    keys = s.store.keys
    query = sa.select(keys.c.pending_id).where(keys.c.lease_key == key)
    with s.store.engine.connect() as connection:
        return connection.execute(query).scalar_one_or_none()


def call_for(
    call: Callable[[], Any], clients: int, seconds: float
) -> tuple[list[float], set[str], float]:
    """``clients`` threads running ``call`` (an ``apply_async``) for ``seconds``: the seconds
    of each call, the ids returned, and the seconds from the start to the last thread's end."""
    times: list[list[float]] = [[] for _ in range(clients)]
    served: list[set[str]] = [set() for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def loop(out: list[float], ids: set[str]) -> None:
        clock = time.perf_counter
        start.wait()
        deadline = clock() + seconds
        while (began := clock()) < deadline:
            ids.add(str(call().id))
            out.append(clock() - began)

    threads = [threading.Thread(target=loop, args=(times[n], served[n])) for n in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    return [t for out in times for t in out], set().union(*served), elapsed


def followup_latency(s: Scenario, *, runs: int) -> list[float]:
    """Seconds from the end of a run to its follow-up's claim (DB clock), ``runs`` times."""
    found = []
    for _ in range(runs):
        account = f"lat-{uuid.uuid4().hex[:8]}"
        first = s.send(TASK, account, RUN_UNITS, RUN_UNIT_SECONDS)
        s.wait_unit(first, unit=0, timeout=30)
        followup = s.send(TASK, account, RUN_UNITS, RUN_UNIT_SECONDS)
        assert followup != first, "the trigger during the run was not coalesced"
        ended = s.wait_finished(first, timeout=60)
        started = s.wait_finished(followup, timeout=60)
        assert ended.finished_at is not None and started.claimed_at is not None
        found.append(started.claimed_at - ended.finished_at)
        print(f"follow-up claimed {found[-1] * 1000:.1f} ms after the run ended", flush=True)
    return found


def measure(
    database: str, url: str, *, seconds: float, threads: Sequence[int], runs: int
) -> tuple[list[dict[str, Any]], list[float]]:
    with redis_bed(url, "keys", workers=2) as s:
        rows = absorb(s, database, seconds=seconds, threads=threads)
        return rows, followup_latency(s, runs=runs)


def main(argv: Sequence[str] | None = None) -> None:
    options = parser(__doc__)
    options.add_argument("--seconds", type=float, help="seconds of calls per row (5; quick 2)")
    options.add_argument("--threads", type=int, nargs="+", default=[4, 16], help="threads (4 16)")
    options.add_argument("--runs", type=int, help="follow-up latency runs (10; quick 10)")
    options.add_argument(
        "--database", nargs="+", choices=("postgres", "sqlite"), default=["postgres", "sqlite"]
    )
    args = options.parse_args(argv)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    runs = args.runs or 10
    absorbed: list[dict[str, Any]] = []
    latency_rows: list[dict[str, Any]] = []
    raw: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-keys-sqlite-") as folder:
        for database in args.database:
            url = available("postgres") if database == "postgres" else None
            if database == "sqlite":
                url = f"sqlite:///{Path(folder) / 'leases.sqlite3'}"
            if url is None:
                continue
            rows, latencies = measure(
                database, url, seconds=seconds, threads=args.threads, runs=runs
            )
            absorbed += rows
            raw[database] = latencies
            latency_rows.append(
                row(
                    LATENCY_COLUMNS,
                    database,
                    len(latencies),
                    statistics.median(latencies),
                    max(latencies),
                    min(latencies),
                )
            )
    print_rows("Follow-up latency: run end -> follow-up claim (s, DB clock)", latency_rows)
    report(
        "keys",
        absorbed,
        quick=args.quick,
        title="Triggers one busy key absorbs (apply_async coalesced into its follow-up)",
        latency=latency_rows,
        latency_seconds=raw,
        argv=argv,
    )


if __name__ == "__main__":
    main()
