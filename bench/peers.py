"""Side by side with procrastinate: celery-leases, procrastinate and plain Celery, one run.

The same PostgreSQL (one scratch database, ``bench_procrastinate``, made and dropped by the
run: procrastinate's schema, the leases table and the unit logs), the same machine, the
variants' runs interleaved (each first, middle and last in turn). Celery's broker is Redis.

- **throughput**: no-op and 10 ms (``time.sleep(0.01)``) jobs per second. Celery: one ``celery
  worker -P prefork -c N`` (N pool processes, and the main process that takes the messages);
  procrastinate: N worker processes of concurrency 1 (its documented way to run N synchronous
  jobs at once), and, for N = 4, one process of ``concurrency=4`` (its sub-workers: each
  synchronous job in a thread). Celery's tasks are published first, then the worker starts;
  procrastinate's jobs are deferred in one ``batch_defer`` once its workers listen. Every job
  is counted in Redis as it ends (Celery: ``task_postrun``; procrastinate: the task's last
  line); rate = (jobs - 1) / (last - first count).
- **recovery**: ``bench.recovery``'s 16-unit job (0.25 s a unit), its worker SIGKILLed during
  unit 5, two workers of one job slot each; crash -> first unit of the next run (database
  clock), and where that run starts. celery-leases: lease 2 s (renewed every third of it), the
  reaper every 1 s from a real beat, a checkpoint per unit. procrastinate: its "Retry stalled
  jobs" how-to (a periodic task calling ``get_stalled_jobs`` and ``retry_job``) every 1 s,
  ``seconds_since_heartbeat`` and ``stalled_worker_timeout`` 2 s, a heartbeat every 2/3 s (the
  lease's figures); the job keeps the user's own progress row, upserted with each unit.
  Plain Celery: ``task_acks_late``, Redis ``visibility_timeout`` 10 s, swept every second.
- **progress write**: ``self.checkpoint(...)`` in a real worker against what a procrastinate
  user writes (it has no checkpoint): an ``UPDATE`` of their own row, on its own (autocommit)
  and inside the unit's transaction (``bench/peers_app.py``).
- **dispatch**: ``apply_async()`` of a LeasedTask and of a plain task against
  procrastinate's synchronous ``defer()`` (its sync connector's pool), no worker.

    python -m bench.peers [--quick]
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from bench.common import interleaved, median_ms, p90_ms, parser, report, row, scratch, steady
from tests.support.scenario import close_app, kill_all, runs_of, start_all, wait_for
from tests.support.service import POSTGRES_URL, private_redis_url
from tests.support.worker import CeleryProcess, Spawner

DATABASE = "bench_procrastinate"
#: celery-leases' lease and reaper interval; procrastinate's stalled threshold and retry
#: interval take the same figures, its heartbeat the lease's renew interval (a third).
LEASE, REAPER = 2.0, 1.0
HEARTBEAT = LEASE / 3
KINDS = {"no-op": ("noop", (), {}), "10 ms": ("sleep", (0.010,), {"seconds": 0.010})}
SYSTEMS = ("celery-leases", "procrastinate", "plain Celery")
COLUMNS = "measure celery-leases procrastinate plain_Celery leases/procrastinate leases/plain"
COLUMNS += " spread"


@dataclass(frozen=True)
class Setup:
    """How N jobs run at once: Celery's ``-c``, procrastinate's processes x concurrency."""

    name: str
    celery: int
    processes: int
    concurrency: int


ONE = Setup("1 process", 1, 1, 1)
FOUR = Setup("4 processes", 4, 4, 1)
FOUR_THREADS = Setup("1 process, concurrency 4", 4, 1, 4)


def urls() -> tuple[str, str]:
    """The scratch database's SQLAlchemy URL and libpq conninfo."""
    url = sa.engine.make_url(POSTGRES_URL).set(database=DATABASE)
    dsn = url.set(drivername="postgresql").render_as_string(False)
    return url.render_as_string(False), dsn


@contextlib.contextmanager
def database() -> Iterator[tuple[str, str]]:
    """A fresh ``bench_procrastinate`` database with procrastinate's schema; dropped after."""
    from bench.procrastinate_app import make_app

    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")

    def drop() -> None:
        with admin.connect() as connection:
            connection.execute(sa.text(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))

    try:
        drop()
        with admin.connect() as connection:
            connection.execute(sa.text(f"CREATE DATABASE {DATABASE}"))
        url, dsn = urls()
        app = make_app(dsn)
        app.open()
        try:
            app.schema_manager.apply_schema()
        finally:
            app.close()
        yield url, dsn
    finally:
        try:
            drop()
        finally:
            admin.dispose()


def reset_procrastinate(dsn: str) -> None:
    """Empty procrastinate's tables (no worker running): each run starts from an empty queue."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(
            "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers, "
            "procrastinate_workers CASCADE"
        )


class ProcrastinateWorker(CeleryProcess):
    """``python -m bench.procrastinate_app``: one procrastinate worker process."""

    command_name = "procrastinate"
    ready_pattern = re.compile(r"procrastinate worker \d+ ready\.")

    def __init__(self, *, concurrency: int, options: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__("bench.procrastinate_app", **kwargs)
        self.concurrency = concurrency
        self.options = tuple(options)

    def command(self) -> list[str]:
        args = ["--name", self.name, "--concurrency", str(self.concurrency), *self.options]
        # Not ``-m``: procrastinate warns of an app made in the ``__main__`` module.
        start = "import sys; from bench.procrastinate_app import main; main(sys.argv[1:])"
        return [sys.executable, "-c", start, *args]


def procrastinate_workers(
    spawner: Spawner, env: dict[str, str], dsn: str, setup: Setup, options: Sequence[str] = ()
) -> list[ProcrastinateWorker]:
    """``setup.processes`` procrastinate workers, started and listening."""
    workers = [
        ProcrastinateWorker(
            concurrency=setup.concurrency, options=options, env=env, log_dir=spawner.log_dir
        )
        for _ in range(setup.processes)
    ]
    spawner.processes.extend(workers)
    start_all(workers, timeout=60)
    with psycopg.connect(dsn, autocommit=True) as connection:
        # A worker that does not listen yet would miss the jobs' notification and wait for
        # its next poll (5 s).
        query = (
            "SELECT count(DISTINCT application_name) FROM pg_stat_activity "
            "WHERE application_name = ANY(%s) AND query LIKE 'LISTEN %%'"
        )
        names = [worker.name for worker in workers]

        def listening() -> bool:
            found = connection.execute(query, (names,)).fetchone()
            return found is not None and found[0] == len(workers)

        wait_for(listening, timeout=30, interval=0.02, what="procrastinate workers to listen")
    return workers


class Together:
    """Workers seen as one by ``bench.worker_app.wait_done``."""

    def __init__(self, workers: Sequence[CeleryProcess]) -> None:
        self.workers = workers

    def is_alive(self) -> bool:
        return all(worker.is_alive() for worker in self.workers)

    def log_tail(self) -> str:
        return "\n".join(worker.log_tail(10) for worker in self.workers)


# -- throughput -------------------------------------------------------------------------------


def throughput(
    url: str, dsn: str, table: str, *, counts: dict[str, int], repeats: int
) -> dict[str, Any]:
    """Jobs per second and the machine's busy CPU ms a job, by kind, setup and system."""
    from bench.procrastinate_app import COUNTER, DSN, RUN
    from bench.procrastinate_app import make_app as make_procrastinate
    from bench.throughput import CpuSampler
    from bench.worker_app import make_app, publish, start_worker, wait_done

    queue = f"bench_peers_{uuid.uuid4().hex[:8]}"
    found: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="bench-peers-") as logs,
        private_redis_url() as counter,
    ):
        spawner = Spawner(logs)
        config = {
            "broker_url": counter,
            "task_default_queue": queue,
            "control_exchange": f"{queue}_control",
            "leases_database_url": url,
            "leases_table": table,
        }
        app = make_app(config, name="bench-client")
        client = make_procrastinate(dsn)
        client.open()

        def celery_rate(variant: str, kind: str, setup: Setup) -> tuple[float, float]:
            body, args, _ = KINDS[kind]
            run, total = f"bench:{uuid.uuid4().hex[:8]}", counts[kind]
            with contextlib.suppress(Exception):
                app.control.purge()
            publish(app, f"bench.{variant}_{body}", total, args)
            with CpuSampler() as cpu:
                worker = start_worker(
                    spawner, config, counter_url=counter, run=run, concurrency=setup.celery
                )
                try:
                    first, last = wait_done(
                        counter, run, total, worker=worker, timeout=60 + total / 20
                    )
                finally:
                    worker.stop(timeout=15)
            return (total - 1) / (last - first), cpu.between(first, last) / (total - 1) * 1000

        def procrastinate_rate(kind: str, setup: Setup) -> tuple[float, float]:
            body, _, kwargs = KINDS[kind]
            run, total = f"bench:{uuid.uuid4().hex[:8]}", counts[kind]
            reset_procrastinate(dsn)
            env = {DSN: dsn, COUNTER: counter, RUN: run}
            with CpuSampler() as cpu:
                workers = procrastinate_workers(spawner, env, dsn, setup)
                try:
                    client.tasks[f"peers.{body}"].batch_defer(*[kwargs] * total)
                    first, last = wait_done(
                        counter, run, total, worker=Together(workers), timeout=60 + total / 20
                    )
                finally:
                    for worker in workers:
                        worker.terminate()
                    for worker in workers:
                        worker.stop(timeout=15)
            return (total - 1) / (last - first), cpu.between(first, last) / (total - 1) * 1000

        cells: dict[str, Callable[[str], tuple[float, float]]] = {}
        try:
            for setup in (ONE, FOUR):
                cells = {
                    "celery-leases": lambda kind, s=setup: celery_rate("leased", kind, s),
                    "procrastinate": lambda kind, s=setup: procrastinate_rate(kind, s),
                    "plain Celery": lambda kind, s=setup: celery_rate("plain", kind, s),
                }
                if setup is FOUR:
                    cells["procrastinate, 1 process x 4"] = lambda kind: procrastinate_rate(
                        kind, FOUR_THREADS
                    )
                names = list(cells)
                for kind in KINDS:
                    rates: dict[str, list[float]] = {name: [] for name in names}
                    cpus: dict[str, list[float]] = {name: [] for name in names}
                    for repeat in range(repeats):
                        shift = repeat % len(names)
                        for name in names[shift:] + names[:shift]:
                            per_s, cpu_ms = cells[name](kind)
                            rates[name].append(round(per_s, 1))
                            cpus[name].append(round(cpu_ms, 3))
                            print(
                                f"{kind}, {setup.name}, {name}: {per_s:.0f}/s, "
                                f"{cpu_ms:.2f} ms CPU a job",
                                flush=True,
                            )
                    found[f"{kind}, {setup.name}"] = {"rates": rates, "cpu_ms": cpus}
        finally:
            client.close()
            close_app(app)
            spawner.stop_all()
    return found


# -- recovery ---------------------------------------------------------------------------------


def procrastinate_crash_once(url: str, dsn: str) -> dict[str, Any]:
    """procrastinate's side of ``bench.recovery.crash_once`` for a whole-worker SIGKILL."""
    from bench.procrastinate_app import DSN, RETRY_EVERY, STALLED, UNITS_URL, progress_table
    from bench.procrastinate_app import make_app as make_procrastinate
    from bench.recovery import CRASH_AT, UNIT_SECONDS, UNITS
    from tests.support.unit_log import UnitLog

    reset_procrastinate(dsn)
    with (
        tempfile.TemporaryDirectory(prefix="bench-peers-recovery-") as logs,
        scratch(url, "peersrec", leases=False) as table,
    ):
        log = UnitLog(url, f"{table}_units").create()
        progress_table(f"{table}_units_progress").create(log.engine)
        env = {DSN: dsn, UNITS_URL: url, RETRY_EVERY: str(REAPER), STALLED: str(LEASE)}
        options = ["--heartbeat", str(HEARTBEAT), "--stalled", str(LEASE)]
        spawner = Spawner(logs)
        client = make_procrastinate(dsn)
        client.open()
        try:
            procrastinate_workers(spawner, env, dsn, Setup("2 workers", 0, 2, 1), options)
            job = client.tasks["peers.units"].defer(
                count=UNITS, unit_seconds=UNIT_SECONDS, log_table=f"{table}_units"
            )
            job_id = str(job)

            def at_crash() -> Any:
                rows = [r for r in log.rows(job_id) if r.unit >= CRASH_AT]
                return rows[-1] if rows else None

            crashed = wait_for(at_crash, timeout=30, interval=0.02, what="unit 5")
            crashed_at = log.now()
            os.kill(crashed.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            resumed = None
            while resumed is None and time.monotonic() < deadline:
                later = [r for r in runs_of(log.rows(job_id)) if r.first.started_at > crashed_at]
                resumed = later[0].first if later else None
                time.sleep(0.02)
            if resumed is None:
                return {"seconds": None, "outcome": "not run again within 60 s"}

            def succeeded() -> bool:
                with psycopg.connect(dsn) as connection:
                    found = connection.execute(
                        "SELECT status FROM procrastinate_jobs WHERE id = %s", (int(job_id),)
                    ).fetchone()
                return found is not None and found[0] == "succeeded"

            wait_for(succeeded, timeout=60, interval=0.1, what=f"job {job_id} to succeed")
            rows = log.rows(job_id)
            last_started = max(r.unit for r in rows if r.run == crashed.run)
            return {
                "seconds": resumed.started_at - crashed_at,
                "resumed_at_unit": resumed.unit,
                "redone_units": max(last_started - resumed.unit + 1, 0),
                "outcome": "resumed" if resumed.unit else "run again from unit 0",
            }
        finally:
            client.close()
            kill_all(spawner)
            log.dispose()


def recovery(url: str, dsn: str, *, runs: int) -> dict[str, list[dict[str, Any]]]:
    """``runs`` crashes of each system, every system once per round."""
    from bench.recovery import crash_once

    cells: dict[str, Callable[[], dict[str, Any]]] = {
        "celery-leases": lambda: crash_once(
            "leased", "worker SIGKILL", database=url, lease_seconds=LEASE, reaper_every=REAPER
        ),
        "procrastinate": lambda: procrastinate_crash_once(url, dsn),
        "plain Celery": lambda: crash_once("plain", "worker SIGKILL", database=url),
    }
    done: dict[str, list[dict[str, Any]]] = {name: [] for name in cells}
    names = list(cells)
    for n in range(runs):
        shift = n % len(names)
        for name in names[shift:] + names[:shift]:
            done[name].append(cells[name]())
            print(f"recovery, {name}: {done[name][-1]}", flush=True)
    return done


# -- progress write and dispatch ----------------------------------------------------------------


def progress_write(url: str, table: str, *, calls: int, block: int) -> dict[str, list[float]]:
    """Seconds of each variant of ``peers.progress``, timed in a real ``-c 1`` worker."""
    from bench.peers_app import add_progress_task
    from bench.worker_app import CONFIG, make_app

    queue = f"bench_peers_{uuid.uuid4().hex[:8]}"
    with (
        tempfile.TemporaryDirectory(prefix="bench-peers-progress-") as logs,
        private_redis_url() as broker,
        scratch(url, "peersuser", leases=False) as user_table,
    ):
        engine = sa.create_engine(url)
        try:
            with engine.begin() as connection:
                connection.execute(
                    sa.text(f"CREATE TABLE {user_table} (job_id text PRIMARY KEY, state text)")
                )
                connection.execute(
                    sa.text(
                        f"CREATE TABLE {user_table}_units "
                        "(id bigserial PRIMARY KEY, job_id text NOT NULL, n int NOT NULL)"
                    )
                )
        finally:
            engine.dispose()
        config = {
            "broker_url": broker,
            "task_default_queue": queue,
            "control_exchange": f"{queue}_control",
            "leases_database_url": url,
            "leases_table": table,
        }
        spawner = Spawner(logs)
        app = make_app(config, name="bench-client")
        add_progress_task(app)
        out = Path(logs) / "progress.json"
        try:
            worker = spawner.worker(
                "bench.peers_app", env={CONFIG: json.dumps(config)}, concurrency=1, timeout=60
            )
            app.tasks["peers.progress"].apply_async((calls, block, user_table, str(out)))

            def written() -> bool:
                if not worker.is_alive():
                    raise RuntimeError(f"the worker died: {worker.log_tail()}")
                return out.exists()

            wait_for(written, timeout=60 + calls * 0.05, interval=0.1, what="progress timings")
            times: dict[str, list[float]] = json.loads(out.read_text())
        finally:
            close_app(app)
            spawner.stop_all()
    return times


def dispatch(url: str, dsn: str, table: str, *, calls: int, block: int) -> dict[str, list[float]]:
    """Seconds of each ``apply_async()`` / ``defer()``, alternating in blocks."""
    from bench.procrastinate_app import make_app as make_procrastinate
    from bench.worker_app import make_app

    with private_redis_url() as broker:
        app = make_app({"broker_url": broker, "leases_database_url": url, "leases_table": table})
        client = make_procrastinate(dsn)
        client.open()
        leased, plain = app.tasks["bench.leased_noop"], app.tasks["bench.plain_noop"]
        deferred = client.tasks["peers.noop"]
        calls_of: dict[str, Callable[[int], Any]] = {
            "celery-leases": lambda i: leased.apply_async(),
            "procrastinate": lambda i: deferred.defer(),
            "plain Celery": lambda i: plain.apply_async(),
        }
        try:
            for call in calls_of.values():  # connections, schema check, prepared statements
                for i in range(20):
                    call(i)
            variants = {name: steady(call) for name, call in calls_of.items()}
            times = interleaved(variants, calls=calls, block=block)
        finally:
            client.close()
            close_app(app)
    reset_procrastinate(dsn)  # the deferred jobs: no worker is to run them
    return times


def defer_round_trips(dsn: str) -> float:
    """Round trips of one synchronous ``defer()`` to PostgreSQL (libpq's trace: its
    ``ReadyForQuery`` messages), on a pool of one connection."""
    from bench.procrastinate_app import make_app

    app = make_app(dsn, min_size=1, max_size=1)
    task = app.tasks["peers.noop"]
    app.open()
    try:
        task.defer()
        with app.connector.get_sync_connector().pool.connection() as connection:
            pgconn = connection.pgconn
        with tempfile.TemporaryFile("w+") as trace:
            pgconn.trace(os.dup(trace.fileno()))  # libpq keeps a FILE on the descriptor
            try:
                for _ in range(3):
                    task.defer()
            finally:
                pgconn.untrace()
            trace.seek(0)
            return sum("ReadyForQuery" in line for line in trace) / 3
    finally:
        app.close()
        reset_procrastinate(dsn)


# -- the table --------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _spread(values: dict[str, list[float]], names: Sequence[str], fmt: str = "{:.0f}") -> str:
    parts = []
    for name in names:
        found = values.get(name) or []
        parts.append(f"{fmt.format(min(found))}-{fmt.format(max(found))}" if found else "-")
    return " / ".join(parts)


def rows_of(
    rates: dict[str, Any],
    crashes: dict[str, list[dict[str, Any]]],
    progress: dict[str, list[float]],
    sends: dict[str, list[float]],
    defer_trips: float,
) -> list[dict[str, Any]]:
    rows = []
    for cell, found in rates.items():
        medians = {name: statistics.median(v) for name, v in found["rates"].items()}
        leases = medians["celery-leases"]
        rows.append(
            row(
                COLUMNS,
                f"{cell}: jobs/s",
                leases,
                medians["procrastinate"],
                medians["plain Celery"],
                _ratio(leases, medians["procrastinate"]),
                _ratio(leases, medians["plain Celery"]),
                "min-max " + _spread(found["rates"], SYSTEMS),
            )
        )
        if "procrastinate, 1 process x 4" in medians:
            threads = medians["procrastinate, 1 process x 4"]
            rows.append(
                row(
                    COLUMNS,
                    f"{cell.split(',')[0]}, procrastinate 1 process x concurrency 4: jobs/s",
                    None,
                    threads,
                    None,
                    _ratio(leases, threads),
                    None,
                    "min-max " + _spread(found["rates"], ["procrastinate, 1 process x 4"]),
                )
            )
    seconds = {
        name: [r["seconds"] for r in done if r.get("seconds") is not None]
        for name, done in crashes.items()
    }
    medians = {name: statistics.median(v) if v else None for name, v in seconds.items()}
    resumed = " / ".join(f"{len(seconds[name])}/{len(crashes[name])}" for name in SYSTEMS)
    rows.append(
        row(
            COLUMNS,
            "worker SIGKILL -> next run starts: s",
            *(medians[name] for name in SYSTEMS),
            _ratio(medians["celery-leases"], medians["procrastinate"]),
            _ratio(medians["celery-leases"], medians["plain Celery"]),
            "min-max " + _spread(seconds, SYSTEMS, "{:.2f}") + f"; ran again {resumed}",
        )
    )

    #: Where a resumed run reads where to start.
    source = {"celery-leases": "its checkpoint", "procrastinate": "the user's progress row"}

    def where(name: str) -> str:
        done = crashes[name]
        redone = max((r.get("redone_units", 0) for r in done), default=0)
        outcomes = sorted({r["outcome"] for r in done})
        if outcomes == ["resumed"]:
            starts = f"at the unit in flight ({source.get(name)})"
        else:
            starts = "; ".join(outcomes)
        return f"{starts}, {redone} units redone"

    rows.append(row(COLUMNS, "next run starts", *map(where, SYSTEMS), None, None, ""))
    own, unit = median_ms(progress["checkpoint"]), median_ms(progress["unit alone"])
    user = median_ms(progress["user UPDATE"])
    in_unit = median_ms(progress["unit + checkpoint"]) - unit
    user_in_unit = median_ms(progress["unit + user UPDATE"]) - unit
    same = median_ms(progress["unit + same statement"]) - unit
    p90 = {name: p90_ms(v) for name, v in progress.items()}
    rows.append(
        row(
            COLUMNS,
            "progress write on its own: ms (procrastinate: the user's UPDATE)",
            own,
            user,
            None,
            _ratio(own, user),
            None,
            f"p90 {p90['checkpoint']:.2f} / {p90['user UPDATE']:.2f}",
        )
    )
    rows.append(
        row(
            COLUMNS,
            "progress write in the unit's transaction: ms added",
            in_unit,
            user_in_unit,
            None,
            _ratio(in_unit, user_in_unit),
            None,
            f"unit alone {unit:.2f} ms; the checkpoint's statement by hand adds {same:.2f}",
        )
    )
    call = {name: median_ms(sends[name]) for name in SYSTEMS}
    rows.append(
        row(
            COLUMNS,
            "dispatch (apply_async / defer): ms a call",
            *(call[name] for name in SYSTEMS),
            _ratio(call["celery-leases"], call["procrastinate"]),
            _ratio(call["celery-leases"], call["plain Celery"]),
            "p90 "
            + " / ".join(f"{p90_ms(sends[name]):.2f}" for name in SYSTEMS)
            + f"; a defer is {defer_trips:g} round trips, a leased dispatch 1 and a publish",
        )
    )
    rows.append(
        row(
            COLUMNS,
            "dispatch: ms over plain Celery's",
            call["celery-leases"] - call["plain Celery"],
            call["procrastinate"] - call["plain Celery"],
            0.0,
            None,
            None,
            "",
        )
    )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    if importlib.util.find_spec("procrastinate") is None:
        print("peers: left out (procrastinate is not installed: pip install -e '.[bench]')")
        return
    quick = args.quick
    counts = {"no-op": 400, "10 ms": 120} if quick else {"no-op": 1500, "10 ms": 400}
    repeats, runs = (1, 1) if quick else (3, 5)
    calls, block = (300, 50) if quick else (2000, 100)
    progress_calls, progress_block = (200, 25) if quick else (1000, 50)
    started = time.monotonic()
    with database() as (url, dsn), scratch(url, "peers") as table:
        sends = dispatch(url, dsn, table, calls=calls, block=block)
        defer_trips = defer_round_trips(dsn)
        progress = progress_write(url, table, calls=progress_calls, block=progress_block)
        rates = throughput(url, dsn, table, counts=counts, repeats=repeats)
        crashes = recovery(url, dsn, runs=runs)
    rows = rows_of(rates, crashes, progress, sends, defer_trips)
    title = (
        "celery-leases, procrastinate and plain Celery (Redis broker), same PostgreSQL "
        f"(medians; {repeats} runs a throughput cell, {runs} crashes a system)"
    )
    report(
        "peers",
        rows,
        quick=quick,
        title=title,
        versions={"procrastinate": metadata.version("procrastinate")},
        setups={s.name: vars(s) for s in (ONE, FOUR, FOUR_THREADS)},
        recovery_parameters={
            "lease_s": LEASE,
            "reaper_every_s": REAPER,
            "procrastinate_heartbeat_s": HEARTBEAT,
            "procrastinate_stalled_s": LEASE,
            "procrastinate_retry_every_s": REAPER,
        },
        tasks=counts,
        throughput=rates,
        recovery=crashes,
        progress_ms={name: median_ms(v) for name, v in progress.items()},
        dispatch_ms={name: median_ms(v) for name, v in sends.items()},
        defer_round_trips=defer_trips,
        seconds=time.monotonic() - started,
    )


if __name__ == "__main__":
    main()
