"""Chaos driver: real ``celery worker`` (prefork) and ``celery beat`` processes on real services,
N jobs of M units, seeded random faults while they run, and the invariants checked at the end.

    python -m tests.support.chaos.driver --jobs 500 --units 20 --workers 3 --faults 100 --seed 7 \\
        --broker redis --database postgres --restart-database --restart-broker

``--broker`` is ``redis`` (a Redis database no test uses), ``rabbitmq``, ``filesystem`` (the
embedded broker) or a URL; ``--database`` is ``postgres``, ``sqlite`` or a URL. Half the jobs
run ``chaos.exactly_once`` (unit row and checkpoint in one transaction), half
``chaos.at_least_once`` (unit row committed, then the checkpoint): see
``tests/support/apps/chaos_app.py``. The seed is printed first; the same seed replays the same jobs,
fault plan (kinds, moments by progress, targets, freeze lengths). Exits 1 if an invariant
failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from celery_leases import LeaseError
from celery_leases.config import settings_for
from celery_leases.store import store_for
from tests.support.apps.chaos_app import (
    add_chaos_tasks,
    chaos_log_for,
    install_checkpoint_log,
    remove_checkpoint_log,
)
from tests.support.apps.leased_app import app_env
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.chaos import fault as F
from tests.support.chaos.check import (
    AT_LEAST_ONCE,
    EXACTLY_ONCE,
    Check,
    CheckpointRow,
    Evidence,
    JobRow,
    check_all,
)
from tests.support.scenario import freeze, kill_all, start_all, thaw
from tests.support.service import close_app
from tests.support.worker import Beat, Spawner, Worker

CHAOS_APP = "tests.support.apps.chaos_app"
TASK_OF_MODE = {EXACTLY_ONCE: "chaos.exactly_once", AT_LEAST_ONCE: "chaos.at_least_once"}

#: Log lines counted in every worker and beat log at the end, as figures.
LOG_EVENTS = {
    "claims refused, duplicate message dropped": r"message dropped",
    "resumed attempts": r": resumed, attempt",
    "re-published by the reaper": r"lease expired \(owner",
    "leases lost (renewals failed or another attempt)": r"lease lost on job",
    "attempts stopped on a lost lease": r"stopped, lease lost",
    "handed back at shutdown": r"handed back at its checkpoint",
    "claims delayed, database unreachable": r"leases database unreachable, delivering again",
    "task retries (transient database error)": r"Task chaos\.\w+\[[^\]]+\] retry:",
    "renewals failing": r"cannot renew leases",
    "gave up": r"gave up:",
}


@dataclass(frozen=True)
class Config:
    """The size of a run. Times are seconds."""

    jobs: int = 40
    units: int = 10
    unit_seconds: float = 0.5
    workers: int = 3
    concurrency: int = 2
    faults: int = 15
    seed: int = 0
    lease_seconds: float = 3.0
    renew_seconds: float = 0.6
    reaper_every: float = 1.0
    #: ``leases_queued_timeout``; None: four times a job's length, at least 20 s.
    queued_timeout: float | None = None
    #: Jobs submitted and not yet finished, at most; None: twice the pool slots.
    window: int | None = None
    kinds: tuple[str, ...] = F.WORKER_KINDS
    #: A run gives up when no unit commits and no job finishes for this long.
    stuck_seconds: float = 120.0
    #: Seconds between two faults, at least.
    min_gap: float = 1.0

    @property
    def slots(self) -> int:
        return self.workers * self.concurrency

    @property
    def job_seconds(self) -> float:
        return self.units * self.unit_seconds

    def effective_queued_timeout(self) -> float:
        return self.queued_timeout or max(20.0, 4 * self.job_seconds)

    def describe(self) -> str:
        return (
            f"jobs {self.jobs} x {self.units} units of {self.unit_seconds:g} s, "
            f"{self.workers} workers x {self.concurrency} prefork processes, "
            f"{self.faults} faults ({', '.join(self.kinds)}), lease {self.lease_seconds:g} s "
            f"renewed every {self.renew_seconds:g} s, reaper every {self.reaper_every:g} s, "
            f"queued timeout {self.effective_queued_timeout():g} s"
        )


@dataclass
class Report:
    seed: int
    checks: list[Check]
    faults: Counter[str]
    skipped_faults: int
    seconds: float
    figures: dict[str, Any]
    events: dict[str, int]
    text: str = ""

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)


@dataclass
class _Frozen:
    worker: Worker
    until: float


@dataclass
class Chaos:
    """One chaos run against ``broker`` (Celery settings with ``broker_url``) and
    ``database_url``, on the leases table ``table``; processes are made by ``spawner``."""

    config: Config
    spawner: Spawner
    broker: Mapping[str, Any]
    database_url: str
    table: str
    out: Callable[[str], None] = field(default=lambda line: print(line, flush=True))

    def __post_init__(self) -> None:
        c = self.config
        self.rng = random.Random(c.seed)
        extra = {k: v for k, v in self.broker.items() if k != "broker_url"}
        extra.update(
            leases_queued_timeout=c.effective_queued_timeout(),
            leases_db_retry_max_delay=4.0,
        )
        self.env = app_env(
            broker_url=self.broker["broker_url"],
            database_url=self.database_url,
            table=self.table,
            lease_seconds=c.lease_seconds,
            renew_seconds=c.renew_seconds,
            reaper_every=c.reaper_every,
            extra=extra,
        )
        self.workers: list[Worker] = []
        self.beat: Beat | None = None
        self.frozen: list[_Frozen] = []
        self.done_faults: Counter[str] = Counter()
        self.skipped_faults = 0
        self.unexpected_exits = 0
        self.started = time.monotonic()

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> Report:
        c = self.config
        modes = [EXACTLY_ONCE] * (c.jobs // 2) + [AT_LEAST_ONCE] * (c.jobs - c.jobs // 2)
        self.rng.shuffle(modes)
        plan = F.plan(self.rng, count=c.faults, kinds=c.kinds, lease_seconds=c.lease_seconds)
        self.out(f"chaos: seed {c.seed}")
        self.out(f"chaos: {c.describe()}")
        self.out(
            f"chaos: broker {_safe(self.broker['broker_url'])}, database "
            f"{_safe(self.database_url)}, table {self.table}"
        )
        self.out(f"chaos: logs in {self.spawner.log_dir}")
        self.out("chaos: fault plan " + ", ".join(f.describe() for f in plan))
        client = add_chaos_tasks(make_leased_app(self.env, name="chaos-client"))
        store = store_for(settings_for(client))
        log = chaos_log_for(client)
        ids = {
            f"chaos-{c.seed}-{number:05d}-{'eo' if mode == EXACTLY_ONCE else 'alo'}": mode
            for number, mode in enumerate(modes)
        }
        try:
            store.ensure_schema()
            log.create()
            checkpoint_log = install_checkpoint_log(store.engine, self.table)
            self._start_processes()
            self.started = time.monotonic()
            self._drive(client, store, log, ids, plan)
            self.out(f"chaos: [{self._clock()}] stopping every process")
            self._thaw_all()
            kill_all(self.spawner)
            seconds = time.monotonic() - self.started
            evidence = self._evidence(store, log, checkpoint_log, ids)
        finally:
            self._thaw_all()
            kill_all(self.spawner)
            with contextlib.suppress(Exception):
                remove_checkpoint_log(store.engine, self.table)
            close_app(client)
            log.dispose()
            store.engine.dispose()
        return self._report(evidence, seconds)

    def _start_processes(self) -> None:
        c = self.config
        workers = [self._new_worker() for _ in range(c.workers)]
        if str(self.broker["broker_url"]).startswith("filesystem"):
            # kombu's filesystem transport creates an exchange's binding file empty, then
            # locks and fills it: a process binding at the same moment reads "" and dies
            # (JSONDecodeError). The first worker creates the files alone.
            workers.pop(0).start(timeout=60)
        start_all([*workers, self._new_beat()], timeout=60)

    def _new_worker(self) -> Worker:
        worker = self.spawner.worker(
            CHAOS_APP, env=self.env, start=False, concurrency=self.config.concurrency
        )
        self.workers.append(worker)
        return worker

    def _new_beat(self) -> Beat:
        self.beat = self.spawner.beat(CHAOS_APP, env=self.env, start=False, max_interval=1)
        return self.beat

    def _drive(
        self, client: Any, store: Any, log: Any, ids: dict[str, str], plan: list[F.Fault]
    ) -> None:
        c = self.config
        window = c.window or 2 * c.slots
        pending = list(ids.items())
        submitted: list[str] = []
        total_units = c.jobs * c.units
        finished = committed = 0
        last_change = time.monotonic()
        last_fault = 0.0
        next_report = 0.0
        faults = list(plan)
        while True:
            now = time.monotonic()
            self._thaw_due(now)
            self._replace_dead()
            with contextlib.suppress(LeaseError, sa.exc.SQLAlchemyError):
                states = store.count_by_state()
                new_finished = sum(states.get(s, 0) for s in ("done", "failed", "cancelled"))
                new_committed = _committed_units(log)
                if (new_finished, new_committed) != (finished, committed):
                    last_change = now
                finished, committed = new_finished, new_committed
            while pending and len(submitted) - finished < window:
                job_id, mode = pending[0]
                try:
                    client.tasks[TASK_OF_MODE[mode]].apply_async(
                        (c.units, c.unit_seconds), task_id=job_id
                    )
                except Exception as exc:  # the broker or the database is restarting
                    self.out(f"chaos: [{self._clock()}] submit of {job_id} failed, again: {exc!r}")
                    break
                pending.pop(0)
                submitted.append(job_id)
            progress = min(committed / total_units, 1.0)
            if faults and faults[0].at <= progress and now - last_fault >= c.min_gap:
                self._inject(faults.pop(0), progress)
                last_fault = time.monotonic()
            if now >= next_report:
                self.out(
                    f"chaos: [{self._clock()}] submitted {len(submitted)}/{c.jobs}, "
                    f"finished {finished}, units {progress:.0%}, faults "
                    f"{sum(self.done_faults.values())}/{c.faults}"
                )
                next_report = now + 10
            if finished >= c.jobs and not pending:
                break
            if now - last_change > c.stuck_seconds:
                self.out(f"chaos: [{self._clock()}] no progress for {c.stuck_seconds:g} s: stuck")
                break
            time.sleep(0.25)
        self.skipped_faults += len(faults)
        if faults:
            self.out(f"chaos: {len(faults)} planned faults not done (the jobs ended first)")

    # -- faults ----------------------------------------------------------------------------

    def _targets(self) -> list[Worker]:
        frozen = {id(f.worker) for f in self.frozen}
        return [w for w in self.workers if w.is_alive() and id(w) not in frozen]

    def _inject(self, fault: F.Fault, progress: float) -> None:
        head = f"chaos: [{self._clock()}] fault {fault.number} {fault.kind}"
        targets = self._targets()
        if fault.kind in F.WORKER_KINDS and not targets:
            self.skipped_faults += 1
            self.out(f"{head}: skipped, no worker to target")
            return
        worker = targets[int(fault.pick * len(targets))] if targets else None
        try:
            detail = getattr(self, f"_fault_{fault.kind}")(fault, worker)
        except Exception as exc:
            self.skipped_faults += 1
            self.out(f"{head}: failed to inject: {exc!r}")
            return
        self.done_faults[fault.kind] += 1
        self.out(f"{head} at {progress:.0%}: {detail}")

    def _fault_kill_child(self, fault: F.Fault, worker: Worker) -> str:
        children = worker.children()
        if not children:
            raise RuntimeError(f"{worker.name} has no pool process")
        pid = children[int(fault.pick * 7919) % len(children)]
        F.kill_process(pid)
        return f"SIGKILL pool process {pid} of {worker.name}"

    def _fault_kill_worker(self, fault: F.Fault, worker: Worker) -> str:
        F.signal_group(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        replacement = self._replace(worker)
        return f"SIGKILL {worker.name} (pid {worker.pid}), replaced by {replacement}"

    def _fault_freeze(self, fault: F.Fault, worker: Worker) -> str:
        freeze(worker)
        self.frozen.append(_Frozen(worker, time.monotonic() + fault.seconds))
        return f"SIGSTOP {worker.name} for {fault.seconds:.1f} s"

    def _fault_sigterm(self, fault: F.Fault, worker: Worker) -> str:
        sent = time.monotonic()
        worker.terminate()
        limit = 2 * self.config.unit_seconds + 10
        try:
            worker.wait(timeout=limit)
            how = f"exited after {time.monotonic() - sent:.1f} s"
        except Exception:
            F.signal_group(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
            how = f"still running after {limit:g} s, SIGKILLed"
        replacement = self._replace(worker)
        return f"SIGTERM {worker.name}: {how}, replaced by {replacement}"

    def _fault_restart_database(self, fault: F.Fault, worker: Worker | None) -> str:
        return f"PostgreSQL restarted in {F.restart_postgres():.1f} s"

    def _fault_restart_broker(self, fault: F.Fault, worker: Worker | None) -> str:
        down = F.restart_redis(self.broker["broker_url"])
        return f"Redis shut down (nosave) and started again, down {down:.1f} s; queue lost"

    def _replace(self, worker: Worker) -> str:
        self.workers.remove(worker)
        replacement = self._new_worker()
        for attempt in (1, 2):
            try:
                replacement.start(timeout=60)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                self.workers.remove(replacement)
                replacement = self._new_worker()
        return replacement.name

    def _replace_dead(self) -> None:
        for worker in list(self.workers):
            if worker.process is not None and not worker.is_alive():
                self.unexpected_exits += 1
                self.out(
                    f"chaos: [{self._clock()}] {worker.name} exited by itself "
                    f"(status {worker.returncode}); replacing it"
                )
                self._replace(worker)
        if self.beat is not None and not self.beat.is_alive():
            self.unexpected_exits += 1
            self.out(
                f"chaos: [{self._clock()}] beat exited (status {self.beat.returncode}); "
                "restarting it"
            )
            self._new_beat().start(timeout=60)

    def _thaw_due(self, now: float) -> None:
        for frozen in [f for f in self.frozen if f.until <= now]:
            thaw(frozen.worker)
            self.frozen.remove(frozen)

    def _thaw_all(self) -> None:
        for frozen in self.frozen:
            thaw(frozen.worker)
        self.frozen.clear()

    # -- evidence and report ---------------------------------------------------------------

    def _evidence(
        self, store: Any, log: Any, checkpoint_log: sa.Table, ids: dict[str, str]
    ) -> Evidence:
        t = store.table
        with store.engine.connect() as connection:
            jobs = {
                r.id: JobRow(
                    r.id,
                    r.state,
                    r.attempts,
                    r.token,
                    _json(r.result),
                    _json(r.checkpoint),
                    r.error,
                )
                for r in connection.execute(
                    sa.select(
                        t.c.id,
                        t.c.state,
                        t.c.attempts,
                        t.c.token,
                        t.c.result,
                        t.c.checkpoint,
                        t.c.error,
                    )
                )
            }
            table_rows = connection.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
            cl = checkpoint_log
            checkpoints = [
                CheckpointRow(r.job_id, r.token, r.checkpoint)
                for r in connection.execute(
                    sa.select(cl.c.job_id, cl.c.token, cl.c.checkpoint).order_by(cl.c.id)
                )
            ]
        return Evidence(
            units=self.config.units,
            modes=ids,
            jobs=jobs,
            table_rows=int(table_rows),
            unit_rows=log.rows(),
            checkpoints=checkpoints,
        )

    def _report(self, evidence: Evidence, seconds: float) -> Report:
        checks = check_all(evidence)
        events = self._log_events()
        c = self.config
        lines = [
            f"chaos: finished in {_duration(seconds)} (seed {c.seed})",
            f"  jobs {c.jobs} x {c.units} units ({c.jobs // 2} exactly-once, "
            f"{c.jobs - c.jobs // 2} at-least-once), {c.workers} workers x {c.concurrency}",
            f"  faults {sum(self.done_faults.values())} of {c.faults} planned: "
            + ", ".join(f"{k} {self.done_faults[k]}" for k in c.kinds)
            + f"; not done {self.skipped_faults}; workers that exited by themselves "
            f"{self.unexpected_exits}",
            "  events in the worker logs: "
            + ", ".join(f"{name} {count}" for name, count in events.items()),
            "  invariants:",
            *(check.line() for check in checks),
        ]
        verdict = "all invariants hold" if all(ch.ok for ch in checks) else "INVARIANT VIOLATED"
        lines.append(f"chaos: {verdict}; replay with --seed {c.seed}")
        text = "\n".join(lines)
        self.out(text)
        return Report(
            seed=c.seed,
            checks=checks,
            faults=self.done_faults,
            skipped_faults=self.skipped_faults,
            seconds=seconds,
            figures=evidence.figures,
            events=events,
            text=text,
        )

    def _log_events(self) -> dict[str, int]:
        text = "\n".join(p.log_text() for p in self.spawner.processes)
        return {name: len(re.findall(pattern, text)) for name, pattern in LOG_EVENTS.items()}

    def _clock(self) -> str:
        return f"{time.monotonic() - self.started:7.1f}s"


def _committed_units(log: Any) -> int:
    t = log.table
    with log.engine.connect() as connection:
        stmt = sa.select(sa.func.count()).select_from(t).where(t.c.ended_at.is_not(None))
        return int(connection.execute(stmt).scalar_one())


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _safe(url: str) -> str:
    return re.sub(r"(://[^:@/]*:)[^@]*@", r"\1***@", url)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)} min {rest:.0f} s" if minutes else f"{rest:.1f} s"


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "big")


# -- command line --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.chaos.driver", description=__doc__.splitlines()[0]
    )
    d = Config()
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--units", type=int, default=20)
    parser.add_argument("--unit-seconds", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=d.workers)
    parser.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="prefork processes per worker"
    )
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None, help="random if not given")
    parser.add_argument(
        "--broker", default="redis", help="redis | rabbitmq | filesystem | a broker URL"
    )
    parser.add_argument("--database", default="postgres", help="postgres | sqlite | a URL")
    parser.add_argument("--lease", type=float, default=d.lease_seconds, help="seconds")
    parser.add_argument("--renew", type=float, default=d.renew_seconds, help="seconds")
    parser.add_argument("--reaper-every", type=float, default=d.reaper_every, help="seconds")
    parser.add_argument("--queued-timeout", type=float, default=None, help="seconds")
    parser.add_argument("--stuck-seconds", type=float, default=d.stuck_seconds)
    parser.add_argument(
        "--restart-database",
        action="store_true",
        help="restart the local PostgreSQL mid-run (disturbs its other users)",
    )
    parser.add_argument(
        "--restart-broker",
        action="store_true",
        help="restart the local Redis mid-run, losing its queues (disturbs its other users)",
    )
    parser.add_argument(
        "--log-dir", default=None, help="worker and beat logs (default: a temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the tables at the end")
    args = parser.parse_args(argv)

    kinds = list(F.WORKER_KINDS)
    if args.restart_database:
        kinds.append("restart_database")
    if args.restart_broker:
        kinds.append("restart_broker")
    config = Config(
        jobs=args.jobs,
        units=args.units,
        unit_seconds=args.unit_seconds,
        workers=args.workers,
        concurrency=args.concurrency,
        faults=args.faults,
        seed=new_seed() if args.seed is None else args.seed,
        lease_seconds=args.lease,
        renew_seconds=args.renew,
        reaper_every=args.reaper_every,
        queued_timeout=args.queued_timeout,
        kinds=tuple(kinds),
        stuck_seconds=args.stuck_seconds,
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="celery-leases-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    spawner = Spawner(log_dir=log_dir)
    table = f"leases_chaos_{uuid.uuid4().hex[:8]}"
    database_url = _database_url(args.database, log_dir)
    problems = check_restartable(config, database_url=database_url, broker=args.broker)
    if problems:
        parser.error("; ".join(problems))
    with _broker_settings(args.broker, log_dir) as broker:
        try:
            report = Chaos(config, spawner, broker, database_url, table).run()
            figures = {
                "seed": report.seed,
                "config": asdict(config),
                "seconds": round(report.seconds, 1),
                "ok": report.ok,
                "faults": dict(report.faults),
                "faults_not_done": report.skipped_faults,
                "figures": report.figures,
                "events": report.events,
                "checks": {check.name: check.ok for check in report.checks},
            }
            (log_dir / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
            print(f"chaos: figures in {log_dir / 'figures.json'}", flush=True)
        finally:
            spawner.stop_all()
            if not args.keep:
                _drop_tables(database_url, table)
    return 0 if report.ok else 1


def check_restartable(config: Config, *, database_url: str, broker: str) -> list[str]:
    """Why the service restarts asked for cannot be done here (empty when they can)."""
    from tests.support.service import REDIS_URL

    problems = []
    if "restart_database" in config.kinds and not F.can_restart_postgres(database_url):
        problems.append(
            "--restart-database needs the local PostgreSQL (127.0.0.1:5432) and pg_ctlcluster"
        )
    broker_url = REDIS_URL if broker == "redis" else broker
    if "restart_broker" in config.kinds and not F.can_restart_redis(broker_url):
        problems.append("--restart-broker needs the local Redis (127.0.0.1:6379) and redis-server")
    return problems


def _database_url(name: str, log_dir: Path) -> str:
    from tests.support.service import POSTGRES_URL

    if name == "postgres":
        return POSTGRES_URL
    if name == "sqlite":
        return f"sqlite:///{log_dir}/leases.sqlite3"
    return name


@contextlib.contextmanager
def _broker_settings(name: str, log_dir: Path) -> Iterator[dict[str, Any]]:
    from tests.support.service import RABBITMQ_URL, delete_rabbitmq_entities, private_redis_url

    queue = f"leases_q_{uuid.uuid4().hex[:8]}"
    settings: dict[str, Any] = {
        "task_default_queue": queue,
        "control_exchange": f"{queue}_control",
        "broker_connection_retry_on_startup": True,
    }
    if name == "redis":
        with private_redis_url() as url:
            yield {**settings, "broker_url": url}
        return
    if name == "filesystem":
        yield {**settings, **filesystem_broker(log_dir / "broker")}
        return
    url = RABBITMQ_URL if name == "rabbitmq" else name
    yield {**settings, "broker_url": url}
    if url.startswith("amqp"):
        control = settings["control_exchange"]
        delete_rabbitmq_entities(
            url, queues=[queue], exchanges=[queue, f"{control}.pidbox", f"reply.{control}.pidbox"]
        )


def filesystem_broker(root: Path) -> dict[str, Any]:
    """Settings of kombu's ``filesystem://`` transport in ``root`` (as the tests' fixture)."""
    folders = {name: root / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return {
        "broker_url": "filesystem://",
        "broker_transport_options": {
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "store_processed": True,
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
            "polling_interval": 0.1,
        },
    }


def _drop_tables(url: str, table: str) -> None:
    if url.startswith("sqlite"):
        return
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            for name in (f"{table}_units", f"{table}_checkpoints", table):
                sa.Table(name, sa.MetaData()).drop(connection, checkfirst=True)
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
