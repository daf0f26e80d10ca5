"""Chaos driver: real ``celery worker`` (prefork) and ``celery beat`` processes on real services,
N jobs of M units, seeded random faults while they run, and the invariants checked at the end.

    python -m chaos.driver --jobs 500 --units 20 --workers 3 --faults 100 --seed 7 \\
        --broker redis --database postgres --restart-database --restart-broker

``--broker`` is ``redis`` (a Redis database no test uses), ``rabbitmq``, ``filesystem`` (the
embedded broker) or a URL; ``--database`` is ``postgres``, ``sqlite`` or a URL. Half the jobs
run ``chaos.exactly_once`` (unit row and checkpoint in one transaction), half
``chaos.at_least_once`` (unit row committed, then the checkpoint): see
``chaos/app.py``. Every job is sent with a ``link`` callback and a
``link_error`` errback that record their calls; a fraction (``--expiring``) is sent with an
``expires`` some seconds after it is sent, so some expire while they wait or while they are
resumed and others end done first. The result backend (``--result-backend``) is a Redis
database of its own (an SQLite file with the embedded broker). Besides the process and service
faults, the plan revokes running jobs (``revoke(terminate=True)``) and cancels queued or
running ones (``celery leases cancel``, through the store); ``--no-controls`` leaves revokes,
cancels and expiring jobs out. Keyed jobs (``--keys``, ``--triggers``): bursts of triggers
(calls of ``chaos.keyed``, one account each, as a webhook provider sends them) go out during the
run while the faults happen, from a thread of their own (``chaos/trigger.py``);
``--keys 0`` leaves them out. The seed is printed first; the same seed replays the same jobs,
fault plan (kinds, moments by progress, targets, freeze lengths), expiring jobs and trigger
bursts. Exits 1 if an invariant failed.
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa

from celery_leases import LeaseError
from celery_leases.config import settings_for
from celery_leases.db import migrations
from celery_leases.db.store import store_for
from chaos import fault as F
from chaos import trigger as T
from chaos.app import (
    KEYED_TASK,
    TASKS,
    add_chaos_tasks,
    callback_log_for,
    chaos_log_for,
    install_checkpoint_log,
    install_cursor_log,
    install_state_log,
    remove_checkpoint_log,
    remove_cursor_log,
    remove_state_log,
    trigger_log_for,
)
from chaos.check import (
    AT_LEAST_ONCE,
    EXACTLY_ONCE,
    Callback,
    Check,
    CheckpointRow,
    Control,
    CursorRow,
    Evidence,
    JobRow,
    Kill,
    Outcome,
    StateRow,
    Trigger,
    check_all,
)
from tests.support.apps.factory import app_env
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.scenario import freeze, kill_all, start_all, thaw
from tests.support.service import close_app, drop_tables, sqlite_result_backend
from tests.support.worker import Beat, Spawner, Worker

CHAOS_APP = "chaos.app"
TASK_OF_MODE = {EXACTLY_ONCE: "chaos.exactly_once", AT_LEAST_ONCE: "chaos.at_least_once"}
CALLBACK_TASK = "chaos.on_done"
#: Finished states of a job; those a job stops in before its last unit.
FINISHED = ("done", "failed", "cancelled", "revoked", "replaced")
STOPPED = ("failed", "cancelled", "revoked")

#: Log lines counted in every worker and beat log at the end, as figures.
LOG_EVENTS = {
    "claims refused, duplicate message dropped": r"message dropped",
    "retries of stale attempts dropped": r"asked for a retry after losing its lease",
    "transactions the database ended (idle past the lease)": r"sat idle longer than the lease",
    "resumed attempts": r": resumed, attempt",
    "re-published by the reaper": r"lease expired \(owner",
    "leases lost (renewals failed or another attempt)": r"lease lost on job",
    "attempts stopped on a lost lease": r"stopped, lease lost",
    "handed back at shutdown": r"handed back at its checkpoint",
    "claims delayed, database unreachable": r"leases database unreachable, delivering again",
    "task retries (transient database error)": r"Task chaos\.\w+\[[^\]]+\] retry:",
    "renewals failing": r"cannot renew leases",
    "gave up": r"gave up:",
    "revokes terminating a running job": r"Terminating \S+ \(",
    "ended revoked in a worker (revoke, expiry)": r"celery-leases: job \S+ is revoked:",
    "chaos jobs discarded as revoked or expired by Celery": r"Discarding revoked task: chaos\.",
    "cancelled at a checkpoint": r"cancelled at its checkpoint",
    "ends stored in the backend by the reaper": r"celery-leases: job \S+ \([^)]*\) stored as",
    "expired jobs ended by the reaper": r"expired \(its message's expires passed\)",
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
    #: Fraction of the jobs sent with ``expires``, that many seconds after they are sent: a
    #: random multiple of a job's length in ``expires_after``.
    expiring: float = 0.0
    expires_after: tuple[float, float] = (0.1, 2.5)
    #: Accounts (lease keys) of the keyed jobs, and the triggers sent for them in bursts of 1
    #: to ``burst``, at most ``burst_gap`` seconds apart; 0 keys: no keyed jobs.
    keys: int = 0
    triggers: int = 0
    burst: int = 6
    burst_gap: float = 1.0
    #: Units of a keyed job (of ``unit_seconds`` each).
    key_units: int = 5

    @property
    def keyed(self) -> bool:
        return self.keys > 0 and self.triggers > 0

    @property
    def slots(self) -> int:
        return self.workers * self.concurrency

    @property
    def job_seconds(self) -> float:
        return self.units * self.unit_seconds

    def effective_queued_timeout(self) -> float:
        return self.queued_timeout or max(20.0, 4 * self.job_seconds)

    @property
    def expiring_jobs(self) -> int:
        return round(self.jobs * self.expiring)

    @property
    def longest_freeze(self) -> float:
        """Seconds a ``freeze`` fault lasts at most (``fault.plan``)."""
        return 3.0 * self.lease_seconds

    def describe(self) -> str:
        low, high = (self.job_seconds * f for f in self.expires_after)
        return (
            f"jobs {self.jobs} x {self.units} units of {self.unit_seconds:g} s, "
            f"{self.workers} workers x {self.concurrency} prefork processes, "
            f"{self.faults} faults ({', '.join(self.kinds)}), {self.expiring_jobs} jobs sent "
            f"with expires {low:g}-{high:g} s after they are sent, lease {self.lease_seconds:g} s "
            f"renewed every {self.renew_seconds:g} s, reaper every {self.reaper_every:g} s, "
            f"queued timeout {self.effective_queued_timeout():g} s"
            + (
                f"; {self.triggers} triggers of {self.keys} keys in bursts of 1-{self.burst} "
                f"(<= {self.burst_gap:g} s apart), keyed jobs of {self.key_units} units"
                if self.keyed
                else "; no keyed jobs"
            )
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
class _Draining:
    """A worker sent SIGTERM: its warm shutdown goes on while the run does; SIGKILLed at
    ``until`` (monotonic seconds) if still alive."""

    worker: Worker
    sent: float
    until: float


@dataclass
class Chaos:
    """One chaos run against ``broker`` (Celery settings with ``broker_url``) and
    ``database_url``, on the leases table ``table``, with the result backend
    ``result_backend`` (None: none, and the checks that read it say so); processes are made by
    ``spawner``."""

    config: Config
    spawner: Spawner
    broker: Mapping[str, Any]
    database_url: str
    table: str
    result_backend: str | None = None
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
            result_backend=self.result_backend,
            database_url=self.database_url,
            table=self.table,
            lease_seconds=c.lease_seconds,
            renew_seconds=c.renew_seconds,
            reaper_every=c.reaper_every,
            extra=extra,
        )
        #: Where ``freeze_in_transaction`` requests wait for a checkpoint to take them.
        self.hold_dir = Path(self.spawner.log_dir) / "holds"
        self.hold_dir.mkdir(parents=True, exist_ok=True)
        self.env[F.HOLD_DIR_ENV] = str(self.hold_dir)
        self.workers: list[Worker] = []
        self.beat: Beat | None = None
        self.frozen: list[_Frozen] = []
        #: ``freeze_in_transaction`` requests taken: (epoch seconds, worker, job id).
        self.holds: list[tuple[float, str, str]] = []
        self.draining: list[_Draining] = []
        self.done_faults: Counter[str] = Counter()
        self.skipped_faults = 0
        self.unexpected_exits = 0
        self.started = time.monotonic()
        #: The revokes and cancels sent, and the jobs sent with ``expires`` (epoch seconds).
        self.controls: list[Control] = []
        #: The SIGKILLs sent: when (epoch seconds) and to which pids.
        self.kills: list[Kill] = []
        self.expires: dict[str, float] = {}
        self.expiring: dict[str, float] = {}
        self.client: Any = None
        self.store: Any = None
        self.bursts: list[T.Burst] = []
        self.sender: T.Sender | None = None

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> Report:
        c = self.config
        modes = [EXACTLY_ONCE] * (c.jobs // 2) + [AT_LEAST_ONCE] * (c.jobs - c.jobs // 2)
        self.rng.shuffle(modes)
        plan = F.plan(self.rng, count=c.faults, kinds=c.kinds, lease_seconds=c.lease_seconds)
        if c.keyed:  # a generator of their own: the other draws stay as they were for a seed
            self.bursts = T.plan(
                random.Random(f"{c.seed}-keys"),
                triggers=c.triggers,
                keys=c.keys,
                largest=c.burst,
                gap=c.burst_gap,
            )
        self.out(f"chaos: seed {c.seed}")
        self.out(f"chaos: {c.describe()}")
        self.out(
            f"chaos: broker {_safe(self.broker['broker_url'])}, database "
            f"{_safe(self.database_url)}, table {self.table}"
        )
        self.out(f"chaos: logs in {self.spawner.log_dir}")
        self.out("chaos: fault plan " + ", ".join(f.describe() for f in plan))
        if self.bursts:
            self.out("chaos: trigger bursts " + ", ".join(b.describe() for b in self.bursts))
        client = self.client = add_chaos_tasks(make_leased_app(self.env, name="chaos-client"))
        store = self.store = store_for(settings_for(client))
        log = chaos_log_for(client)
        callbacks = callback_log_for(client)
        triggers = trigger_log_for(client)
        ids = {
            f"chaos-{c.seed}-{number:05d}-{'eo' if mode == EXACTLY_ONCE else 'alo'}": mode
            for number, mode in enumerate(modes)
        }
        # Drawn after the plan, so a seed's plan is the same with and without expiring jobs.
        self.expiring = {
            job_id: self.rng.uniform(*c.expires_after) * c.job_seconds
            for job_id in sorted(self.rng.sample(sorted(ids), c.expiring_jobs))
        }
        if self.expiring:
            self.out(
                "chaos: sent with expires (seconds after sending) "
                + ", ".join(f"{i.split('-')[2]} +{s:.1f}" for i, s in self.expiring.items())
            )
        try:
            migrations.upgrade(store)
            log.create()
            callbacks.create()
            triggers.create()
            checkpoint_log = install_checkpoint_log(store.engine, self.table)
            state_log = install_state_log(store.engine, self.table)
            cursor_log = install_cursor_log(store.engine, self.table)
            self._start_processes()
            self.started = time.monotonic()
            if self.bursts:
                self.sender = self._new_sender(client, store, triggers)
            self._drive(client, store, log, ids, plan)
            self._stop_sender()
            self._settle(log)
            self.out(f"chaos: [{self._clock()}] stopping every process")
            self._thaw_all()
            kill_all(self.spawner)
            seconds = time.monotonic() - self.started
            evidence = self._evidence(store, log, checkpoint_log, state_log, cursor_log, ids)
        finally:
            self._thaw_all()
            self._stop_sender()
            kill_all(self.spawner)
            for remove in (remove_checkpoint_log, remove_state_log, remove_cursor_log):
                with contextlib.suppress(Exception):
                    remove(store.engine, self.table)
            close_app(client)
            log.dispose()
            callbacks.dispose()
            triggers.dispose()
            store.engine.dispose()
        return self._report(evidence, seconds)

    def _new_sender(self, client: Any, store: Any, triggers: Any) -> T.Sender:
        c = self.config
        task = client.tasks[KEYED_TASK]

        def call(account: str, trigger_id: str) -> str:
            return str(
                task.apply_async((account, c.key_units, c.unit_seconds), task_id=trigger_id).id
            )

        sender = T.Sender(
            call=call,
            clock=store.now,
            record=triggers.add,
            out=self.out,
            prefix=f"chaos-{c.seed}",
        )
        sender.start()
        return sender

    def _stop_sender(self) -> None:
        if self.sender is not None and self.sender.is_alive() and not self.sender.stop(30):
            self.out(f"chaos: [{self._clock()}] a trigger call was still waiting after 30 s")

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
            self._take_holds(now)
            self._thaw_due(now)
            self._reap_draining(now)
            self._replace_dead()
            with contextlib.suppress(LeaseError, sa.exc.SQLAlchemyError):
                new_finished, new_committed = _tally(store.table, log, c.units)
                if (new_finished, new_committed) != (finished, committed):
                    last_change = now
                finished, committed = new_finished, new_committed
            while pending and len(submitted) - finished < window:
                job_id, mode = pending[0]
                try:
                    client.tasks[TASK_OF_MODE[mode]].apply_async(
                        (c.units, c.unit_seconds),
                        task_id=job_id,
                        link=client.signature(CALLBACK_TASK, args=(job_id,)),
                        link_error=client.signature("chaos.errback"),
                        **self._expiry(job_id),
                    )
                except Exception as exc:  # the broker or the database is restarting
                    self.out(f"chaos: [{self._clock()}] submit of {job_id} failed, again: {exc!r}")
                    break
                pending.pop(0)
                submitted.append(job_id)
            progress = min(committed / total_units, 1.0)
            while self.bursts and self.bursts[0].at <= progress and self.sender is not None:
                self.sender.schedule(self.bursts.pop(0))
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
            if finished >= c.jobs and not pending and not self.bursts and self._sent_all():
                break
            if now - last_change > c.stuck_seconds:
                self.out(f"chaos: [{self._clock()}] no progress for {c.stuck_seconds:g} s: stuck")
                break
            time.sleep(0.25)
        untaken = F.drop_holds(self.hold_dir)
        if untaken:
            self.skipped_faults += untaken
            self.done_faults["freeze_in_transaction"] -= untaken
            self.out(f"chaos: {untaken} freeze_in_transaction requests not taken (no checkpoint)")
        self.skipped_faults += len(faults)
        if faults:
            self.out(f"chaos: {len(faults)} planned faults not done (the jobs ended first)")

    def _sent_all(self) -> bool:
        return self.sender is None or self.sender.idle or not self.sender.is_alive()

    def _expiry(self, job_id: str) -> dict[str, Any]:
        """``expires`` for a job chosen to expire (the moment is recorded), else nothing."""
        if job_id not in self.expiring:
            return {}
        moment = time.time() + self.expiring[job_id]
        self.expires[job_id] = moment
        return {"expires": datetime.fromtimestamp(moment, tz=timezone.utc)}

    def _settle(self, log: Any) -> None:
        """Wait for what follows the last job's end: its callback job, the reaper storing
        the Celery state of jobs ended outside any attempt (cancelled while queued, expired),
        the keyed jobs and their follow-ups. At most twice the queued timeout (a callback whose
        message was lost), in seconds."""
        c = self.config
        t = self.store.table
        deadline = time.monotonic() + 2 * c.effective_queued_timeout() + 10
        time.sleep(1.0)
        waiting = (
            sa.select(sa.func.count())
            .select_from(t)
            .where(
                sa.or_(
                    t.c.notify.is_not(None),
                    t.c.followup_id.is_not(None),
                    t.c.state.in_(("queued", "running")),
                )
            )
        )
        left = None
        while time.monotonic() < deadline:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                with log.engine.connect() as connection:
                    left = int(connection.execute(waiting).scalar_one())
                if left == 0:
                    break
            time.sleep(0.5)
        time.sleep(2 * c.reaper_every)
        self.out(
            f"chaos: [{self._clock()}] settled: "
            + ("nothing left to run or to announce" if left == 0 else f"{left} jobs still live")
        )

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
        self.kills.append(Kill(time.time(), (pid,)))
        return f"SIGKILL pool process {pid} of {worker.name}"

    def _fault_kill_worker(self, fault: F.Fault, worker: Worker) -> str:
        pids = (worker.pid, *worker.children())
        F.signal_group(worker.pid, signal.SIGKILL)
        self.kills.append(Kill(time.time(), pids))
        worker.wait(timeout=10)
        replacement = self._replace(worker)
        return f"SIGKILL {worker.name} (pid {worker.pid}), replaced by {replacement}"

    def _fault_freeze(self, fault: F.Fault, worker: Worker) -> str:
        freeze(worker)
        self.frozen.append(_Frozen(worker, time.monotonic() + fault.seconds))
        return f"SIGSTOP {worker.name} for {fault.seconds:.1f} s"

    def _fault_freeze_in_transaction(self, fault: F.Fault, worker: Worker | None) -> str:
        # In a run with keyed jobs, every other request waits for a keyed job's transaction.
        keyed = self.config.keyed and self.done_faults["freeze_in_transaction"] % 2 == 1
        F.ask_for_hold(self.hold_dir, fault.number, fault.seconds, keyed=keyed)
        return (
            f"the next transactional checkpoint ({'of a keyed job' if keyed else 'any'}) "
            f"freezes its worker for {fault.seconds:.1f} s"
        )

    def _take_holds(self, now: float) -> None:
        """Workers that froze themselves inside a transactional checkpoint: thaw them later."""
        for pid, job_id, seconds in F.taken_holds(self.hold_dir):
            worker = next((w for w in self.spawner.processes if w.pid == pid), None)
            if not isinstance(worker, Worker):
                continue
            self.frozen.append(_Frozen(worker, now + seconds))
            self.holds.append((time.time(), worker.name, job_id))
            self.out(
                f"chaos: [{self._clock()}] {worker.name} froze inside the transaction of "
                f"{job_id}'s checkpoint, for {seconds:.1f} s"
            )

    def _fault_sigterm(self, fault: F.Fault, worker: Worker) -> str:
        """Warm shutdown, as a deploy does it: the replacement starts while the worker drains
        (its exit is reported when it comes; SIGKILL if it takes over two units + 10 s)."""
        sent = time.monotonic()
        worker.terminate()
        limit = 2 * self.config.unit_seconds + 10
        self.draining.append(_Draining(worker, sent, sent + limit))
        replacement = self._replace(worker)
        return f"SIGTERM {worker.name} (warm shutdown), replaced by {replacement}"

    def _reap_draining(self, now: float) -> None:
        for draining in list(self.draining):
            worker = draining.worker
            if worker.is_alive() and now < draining.until:
                continue
            if worker.is_alive():
                F.signal_group(worker.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    worker.wait(timeout=10)
                how = f"still running {now - draining.sent:.1f} s after its SIGTERM: SIGKILLed"
            else:
                how = f"exited {now - draining.sent:.1f} s after its SIGTERM"
            self.draining.remove(draining)
            self.out(f"chaos: [{self._clock()}] {worker.name} {how}")

    def _fault_restart_database(self, fault: F.Fault, worker: Worker | None) -> str:
        return f"PostgreSQL restarted in {F.restart_postgres():.1f} s"

    def _fault_restart_broker(self, fault: F.Fault, worker: Worker | None) -> str:
        keep = _redis_db(self.result_backend)
        down = F.restart_redis(self.broker["broker_url"], keep_dbs=keep)
        kept = f"; result backend (db {keep[0]}) kept" if keep else ""
        return f"Redis shut down (nosave) and started again, down {down:.1f} s; queue lost{kept}"

    def _fault_revoke(self, fault: F.Fault, worker: Worker | None) -> str:
        """``revoke(terminate=True)`` of a job running under a live lease in a live pool
        process of a live, unfrozen worker, three units or more from its end."""
        c = self.config
        live = {w.name: w for w in self._targets()}

        def running_here(job: Any) -> bool:
            host, _, pid = (job.owner or "").rpartition("/")
            found = live.get(host.split("@")[0])
            return (
                found is not None
                and pid.isdigit()
                and int(pid) in found.children()
                and (job.expires_in or 0.0) > 1.0
                and (job.checkpoint or {}).get("next", 0) <= c.units - 3
            )

        job = self._pick_job(fault, ("running",), running_here)
        at = self.store.now()
        try:
            # A connection of its own: the app's pooled one may be dead after a Redis restart.
            with self.client.connection_for_write() as connection:
                replies = self.client.control.revoke(
                    job.id, terminate=True, reply=True, timeout=1.0, connection=connection
                )
        except Exception:
            # The broadcast may have gone out before the error (collecting the replies):
            # whether a worker terminated the job is unknown.
            self.controls.append(Control(job.id, "revoke", at, None))
            raise
        terminated_by = None
        for reply in replies or []:
            for host, answer in reply.items():
                said = str((answer or {}).get("ok", ""))
                if said.startswith("terminate:") and job.id in said:
                    terminated_by = host
        self.controls.append(Control(job.id, "revoke", at, terminated_by))
        how = f"terminated by {terminated_by}" if terminated_by else "running nowhere: flagged"
        return (
            f"revoke(terminate=True) of {job.id} (running on {job.owner}, checkpoint "
            f"{job.checkpoint}): {how}; {len(replies or [])} workers answered"
        )

    def _fault_cancel(self, fault: F.Fault, worker: Worker | None) -> str:
        """``celery leases cancel`` (through the store) of a queued job, or of a running one
        two units or more from its end."""
        c = self.config

        def cancellable(job: Any) -> bool:
            return job.state == "queued" or (job.checkpoint or {}).get("next", 0) <= c.units - 2

        job = self._pick_job(fault, ("queued", "running"), cancellable)
        at = self.store.now()
        try:
            if job.state == "queued" and self.store.cancel_queued(job.id):
                how = "queued"
            elif self.store.request_stop([job.id], "cancel") == 1:
                how = "running"
            elif self.store.cancel_queued(job.id):
                how = "queued"
            else:
                raise RuntimeError(f"{job.id} ended before the cancel reached it")
        except LeaseError:
            # The update may have committed before the error: it may or may not stand.
            self.controls.append(Control(job.id, "cancel", at, "uncertain"))
            raise
        self.controls.append(Control(job.id, "cancel", self.store.now(), how))
        where = f" on {job.owner}, checkpoint {job.checkpoint}" if how == "running" else ""
        return f"cancel of {job.id} ({how}{where})"

    def _pick_job(
        self, fault: F.Fault, states: tuple[str, ...], fits: Callable[[Any], bool]
    ) -> Any:
        """One of the submitted jobs in ``states`` that ``fits`` and no control targeted yet,
        chosen by ``fault.pick``; RuntimeError when there is none."""
        targeted = {control.job_id for control in self.controls}
        found = [
            job
            for job in self.store.list_jobs(states=states, limit=10_000)
            if job.task in TASKS and job.id not in targeted and fits(job)
        ]
        if not found:
            raise RuntimeError(f"no {' or '.join(states)} job to target")
        found.sort(key=lambda job: job.id)
        return found[int(fault.pick * len(found))]

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
        self._take_holds(time.monotonic())
        for frozen in self.frozen:
            thaw(frozen.worker)
        self.frozen.clear()

    # -- evidence and report ---------------------------------------------------------------

    def _evidence(
        self,
        store: Any,
        log: Any,
        checkpoint_log: sa.Table,
        state_log: sa.Table,
        cursor_log: sa.Table,
        ids: dict[str, str],
    ) -> Evidence:
        t = store.table
        # The unit log's engine pings its connections: the store's may be stale after a
        # PostgreSQL restart (the library's own calls retry; a plain read does not).
        with log.engine.connect() as connection:
            rows = connection.execute(
                sa.select(
                    t.c.id,
                    t.c.task,
                    t.c.state,
                    t.c.attempts,
                    t.c.token,
                    t.c.result,
                    t.c.checkpoint,
                    t.c.error,
                    t.c.finished_at,
                    t.c.lease_key,
                )
            ).all()
            cl = checkpoint_log
            checkpoints = [
                CheckpointRow(r.job_id, r.token, r.checkpoint, r.at)
                for r in connection.execute(
                    sa.select(cl.c.job_id, cl.c.token, cl.c.checkpoint, cl.c.at).order_by(cl.c.id)
                )
            ]
            sl = state_log
            history = [
                StateRow(r.job_id, r.token, r.state, r.at)
                for r in connection.execute(
                    sa.select(sl.c.job_id, sl.c.token, sl.c.state, sl.c.at).order_by(sl.c.id)
                )
            ]
            ku = cursor_log
            cursors = [
                CursorRow(r.lease_key, r.job_id, r.token, r.cursor_state, r.at)
                for r in connection.execute(
                    sa.select(
                        ku.c.lease_key, ku.c.job_id, ku.c.token, ku.c.cursor_state, ku.c.at
                    ).order_by(ku.c.id)
                )
            ]
            k = store.keys
            saved = {
                r.lease_key: _json(r.cursor_state)
                for r in connection.execute(sa.select(k.c.lease_key, k.c.cursor_state))
            }
        jobs = {
            r.id: JobRow(
                r.id,
                r.state,
                r.attempts,
                r.token,
                _json(r.result),
                _json(r.checkpoint),
                r.error,
                r.finished_at,
                r.lease_key,
            )
            for r in rows
        }
        callbacks = callback_log_for(self.client)
        c = self.config
        return Evidence(
            units=c.units,
            modes=ids,
            jobs=jobs,
            table_rows=sum(1 for r in rows if r.task in TASKS),
            unit_rows=log.rows(),
            checkpoints=checkpoints,
            controls=list(self.controls),
            kills=list(self.kills),
            expires=dict(self.expires),
            expiry_slack=c.longest_freeze + 2.0,
            history=history,
            backend=self._backend_outcomes(ids) if self.result_backend else None,
            callbacks=[Callback(*row) for row in callbacks.rows()],
            callback_jobs=[r.id for r in rows if r.task == CALLBACK_TASK],
            triggers=(
                [Trigger(key, i, served, at) for key, i, served, at, *_ in self._trigger_rows()]
                if c.keyed
                else None
            ),
            key_units=c.key_units,
            cursors=saved,
            cursor_log=cursors,
        )

    def _trigger_rows(self) -> list[tuple[Any, ...]]:
        return trigger_log_for(self.client).rows()

    def _backend_outcomes(self, ids: Iterable[str]) -> dict[str, Outcome]:
        """What the result backend holds for each job (PENDING: nothing)."""
        backend = self.client.backend
        found: dict[str, Outcome] = {}
        for job_id in ids:
            meta = backend.get_task_meta(job_id)
            result = meta.get("result")
            if isinstance(result, BaseException):
                result = f"{type(result).__name__}: {result}"
            found[job_id] = Outcome(str(meta.get("status")), result)
        return found

    def _report(self, evidence: Evidence, seconds: float) -> Report:
        checks = check_all(evidence)
        events = self._log_events()
        c = self.config
        f = evidence.figures
        revokes = [k for k in self.controls if k.kind == "revoke"]
        cancels = [k for k in self.controls if k.kind == "cancel"]
        sender = self.sender
        keyed = (
            f"  keyed: {f.get('triggers', 0)} triggers of {c.keys} keys (and "
            f"{f.get('triggers_failed_calls', 0)} calls that raised) -> "
            f"{f.get('keyed_jobs', 0)} keyed jobs; the longest call took "
            f"{sender.longest if sender else 0.0:.2f} s"
            if c.keyed
            else "  keyed: none"
        )
        lines = [
            f"chaos: finished in {_duration(seconds)} (seed {c.seed})",
            f"  jobs {c.jobs} x {c.units} units ({c.jobs // 2} exactly-once, "
            f"{c.jobs - c.jobs // 2} at-least-once), {c.workers} workers x {c.concurrency}; "
            f"result backend {_safe(self.result_backend or 'none')}",
            f"  faults {sum(self.done_faults.values())} of {c.faults} planned: "
            + ", ".join(f"{k} {self.done_faults[k]}" for k in c.kinds)
            + f"; not done {self.skipped_faults}; workers that exited by themselves "
            f"{self.unexpected_exits}; froze inside a transaction {len(self.holds)}",
            f"  controls: revoke {len(revokes)} ({sum(1 for k in revokes if k.detail)} "
            f"terminated a running job), cancel {len(cancels)} "
            f"({sum(1 for k in cancels if k.detail == 'queued')} queued); jobs sent with "
            f"expires {len(self.expires)} (ended revoked {f.get('controls_expires_revoked', 0)}, "
            f"done {f.get('controls_expires_done', 0)})",
            keyed,
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


def _tally(jobs: sa.Table, log: Any, units: int) -> tuple[int, int]:
    """(chaos jobs finished, units done): committed units, plus the units a job that stopped
    early (revoked, cancelled, failed) will never commit; keyed jobs left out."""
    u = log.table
    ours = sa.select(jobs.c.id).where(jobs.c.task.in_(TASKS))
    committed = sa.and_(u.c.ended_at.is_not(None), u.c.job_id.in_(ours))
    stopped = sa.select(jobs.c.id).where(jobs.c.task.in_(TASKS), jobs.c.state.in_(STOPPED))
    with log.engine.connect() as connection:
        states = dict(
            connection.execute(
                sa.select(jobs.c.state, sa.func.count())
                .where(jobs.c.task.in_(TASKS))
                .group_by(jobs.c.state)
            ).all()
        )
        units_done = connection.execute(
            sa.select(sa.func.count()).select_from(u).where(committed)
        ).scalar_one()
        units_stopped = connection.execute(
            sa.select(sa.func.count()).select_from(u).where(committed, u.c.job_id.in_(stopped))
        ).scalar_one()
    finished = sum(int(states.get(s, 0)) for s in FINISHED)
    ended_early = sum(int(states.get(s, 0)) for s in STOPPED)
    return finished, int(units_done) - int(units_stopped) + units * ended_early


def _redis_db(url: str | None) -> tuple[int, ...]:
    """The database number of a Redis URL on the Redis a restart fault restarts, else ()."""
    if not url or not F.local_redis(url):
        return ()
    return (int(urlsplit(url).path.strip("/") or 0),)


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


def build_parser() -> argparse.ArgumentParser:
    """The command line of the long form (``make chaos``)."""
    parser = argparse.ArgumentParser(
        prog="python -m chaos.driver", description=__doc__.splitlines()[0]
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
    parser.add_argument(
        "--expiring",
        type=float,
        default=0.08,
        help="fraction of the jobs sent with expires (0.1-2.5 job lengths after sending)",
    )
    parser.add_argument(
        "--no-controls",
        action="store_true",
        help="no revoke or cancel faults and no expiring jobs",
    )
    parser.add_argument(
        "--keys", type=int, default=6, help="accounts (lease keys) of the keyed jobs; 0: none"
    )
    parser.add_argument(
        "--triggers", type=int, default=240, help="triggers of keyed jobs, sent in bursts"
    )
    parser.add_argument("--burst", type=int, default=d.burst, help="triggers of a burst, at most")
    parser.add_argument("--key-units", type=int, default=12, help="units of a keyed job")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated fault kinds: only those of the run's kinds (to replay one kind)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random if not given")
    parser.add_argument(
        "--broker", default="redis", help="redis | rabbitmq | filesystem | a broker URL"
    )
    parser.add_argument("--database", default="postgres", help="postgres | sqlite | a URL")
    parser.add_argument(
        "--result-backend",
        default="default",
        help="a URL, or none; default: a Redis database of its own (an SQLite file with the "
        "filesystem broker)",
    )
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
    return parser


def config_of(args: argparse.Namespace) -> Config:
    """The run the command line ``args`` asks for (a random seed if none was given)."""
    return Config(
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
        kinds=fault_kinds(args),
        stuck_seconds=args.stuck_seconds,
        expiring=0.0 if args.no_controls else args.expiring,
        keys=args.keys,
        triggers=args.triggers,
        burst=args.burst,
        key_units=args.key_units,
    )


def fault_kinds(args: argparse.Namespace) -> tuple[str, ...]:
    """The fault kinds of a run with the command line ``args``: the worker faults, the
    frozen-in-transaction one where the database bounds an idle transaction (not SQLite), the
    service restarts asked for, and the controls unless ``--no-controls``."""
    kinds = list(F.WORKER_KINDS)
    if not args.database.startswith("sqlite"):
        kinds += F.TRANSACTION_KINDS
    if args.restart_database:
        kinds.append("restart_database")
    if args.restart_broker:
        kinds.append("restart_broker")
    if not args.no_controls:
        kinds += F.CONTROL_KINDS
    if args.only:
        only = set(args.only.split(","))
        unknown = only - set(kinds)
        if unknown:
            raise SystemExit(f"--only: {sorted(unknown)} not among this run's kinds {kinds}")
        kinds = [k for k in kinds if k in only]
    return tuple(kinds)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_of(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="celery-leases-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    spawner = Spawner(log_dir=log_dir)
    table = f"leases_chaos_{uuid.uuid4().hex[:8]}"
    database_url = _database_url(args.database, log_dir)
    problems = check_restartable(config, database_url=database_url, broker=args.broker)
    if problems:
        parser.error("; ".join(problems))
    with (
        _broker_settings(args.broker, log_dir) as broker,
        _result_backend(args.result_backend, args.broker, log_dir) as backend,
    ):
        try:
            report = Chaos(config, spawner, broker, database_url, table, backend).run()
            figures = {
                "seed": report.seed,
                "config": asdict(config),
                "seconds": round(report.seconds, 1),
                "ok": report.ok,
                "faults": dict(report.faults),
                "result_backend": _safe(backend or "none"),
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


@contextlib.contextmanager
def _result_backend(name: str, broker: str, log_dir: Path) -> Iterator[str | None]:
    """The result backend URL ``name`` asks for (see ``--result-backend``)."""
    from tests.support.service import private_redis_url

    if name == "none":
        yield None
    elif name != "default":
        yield name
    elif broker == "filesystem":
        yield sqlite_result_backend(log_dir / "results.sqlite3")
    else:
        with private_redis_url() as url:
            yield url


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
    if not url.startswith("sqlite"):
        drop_tables(url, table)  # the jobs table, its migrations' objects and the test logs


if __name__ == "__main__":
    sys.exit(main())
