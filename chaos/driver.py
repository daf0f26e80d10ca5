"""Chaos driver: real ``celery worker`` (prefork) and ``celery beat`` processes on real services,
N jobs of M units, seeded random faults while they run, and the invariants checked at the end.

    python -m chaos.driver --jobs 500 --units 20 --workers 3 --faults 100 --seed 7 \\
        --broker redis --database postgres --restart-database --restart-broker

``--broker`` is ``redis`` (a Redis database no test uses), ``rabbitmq``, ``filesystem`` (the
embedded broker) or a URL; ``--database`` is ``postgres``, ``sqlite``, ``postgres-failover`` (a
private PostgreSQL primary and synchronous standby of the run's own, reached through libpq's
multi-host URL; with ``--failover``, ``failover`` faults promote the standby: see
``chaos/fault.py``) or a URL. Half the jobs
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
``--keys 0`` leaves them out. ``--debounced-keys`` and ``--newest-keys`` (default 0) add accounts
whose triggers are debounced (``chaos.keyed_debounced``) or where the newest trigger wins
(``chaos.keyed_newest``), each trigger passing its id as the run's ``marker`` argument.

The edges of real deployments (issue 23), each on by default in the long form and selectable:
``--soft-limits`` (a fraction of the jobs sent with a short ``soft_time_limit``, their row's
statements slowed on PostgreSQL so the limit lands inside them; ``0``: none);
``kill_client`` faults (``--no-dying-clients``: none): a client calling jobs and triggers over a
slow broker, SIGKILLed at a seeded moment, often between recording a job and publishing it;
``revoke_keyed`` / ``cancel_keyed`` faults and ``--key-expiring`` (``--no-keyed-controls``:
none): keyed jobs revoked or cancelled while they wait, revokes and cancels of the id triggers
wait under, triggers sent with ``expires``; ``--isolation`` (``read_committed``,
``repeatable_read``, ``mixed``: the tasks' transactional checkpoints at repeatable read, for
every job or half of them; not on SQLite); ``--namespace-reaper`` (SQLite: a second reaper in a
PID namespace of its own, via ``unshare``; ``--no-namespace-reaper``). The seed is printed
first; the same seed replays the same jobs, fault plan (kinds, moments by progress, targets,
freeze lengths), expiring and soft-limited jobs and trigger bursts. Exits 1 if an invariant
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
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa

from celery_leases import LeaseError
from celery_leases.config import settings_for
from celery_leases.db import migrations
from celery_leases.db.store import store_for
from celery_leases.groups import rate_of
from chaos import client as dying_client
from chaos import fault as F
from chaos import reaper as namespaced_reaper
from chaos import trigger as T
from chaos.app import (
    DEBOUNCE,
    DEBOUNCED_TASK,
    GROUPED_TASK,
    GROUPS,
    ISOLATION_ENV,
    ISOLATIONS,
    KEYED_TASK,
    NEWEST_TASK,
    REUSE_ERRORS,
    SLOW_STATEMENT_SECONDS,
    SOFT_SUFFIX,
    TASKS,
    add_chaos_tasks,
    callback_log_for,
    chaos_log_for,
    install_admission_log,
    install_checkpoint_log,
    install_cursor_log,
    install_slow_statements,
    install_state_log,
    remove_admission_log,
    remove_checkpoint_log,
    remove_cursor_log,
    remove_slow_statements,
    remove_state_log,
    trigger_log_for,
)
from chaos.check import (
    AT_LEAST_ONCE,
    EXACTLY_ONCE,
    Admission,
    Callback,
    Check,
    CheckpointRow,
    Control,
    CursorRow,
    Evidence,
    JobRow,
    Kill,
    Outcome,
    Pause,
    StateRow,
    Trigger,
    check_all,
)
from tests.support.apps.factory import app_env
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.scenario import freeze, kill_all, start_all, thaw
from tests.support.service import close_app, drop_tables, sqlite_result_backend
from tests.support.worker import Beat, CeleryProcess, Spawner, Worker

CHAOS_APP = "chaos.app"
TASK_OF_MODE = {EXACTLY_ONCE: "chaos.exactly_once", AT_LEAST_ONCE: "chaos.at_least_once"}
CALLBACK_TASK = "chaos.on_done"
#: The countdowns (seconds) a grouped job's retry asks for (``--grouped-retries``): at once,
#: or a little later, when other jobs of its group may be admitted before it is due.
RETRY_COUNTDOWNS = (0.0, 0.0, 0.5, 2.0)
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
    "task retries (a transient error, a soft limit, a 429)": r"Task chaos\.\w+\[[^\]]+\] retry:",
    "renewals failing": r"cannot renew leases",
    "gave up": r"gave up:",
    "revokes terminating a running job": r"Terminating \S+ \(",
    "ended revoked in a worker (revoke, expiry)": r"celery-leases: job \S+ is revoked:",
    "chaos jobs discarded as revoked or expired by Celery": r"Discarding revoked task: chaos\.",
    "cancelled at a checkpoint": r"cancelled at its checkpoint",
    "ends stored in the backend by the reaper": r"celery-leases: job \S+ \([^)]*\) stored as",
    "expired jobs ended by the reaper": r"expired \(its message's expires passed\)",
    "triggers settled by a run of their own": r"the triggers that waited on it run as job",
    "soft time limits caught by the task": r"chaos: soft time limit in ",
    "write conflicts run again (task, library)": (
        r"chaos: write conflict in job|its transaction lost to a concurrent one"
    ),
    "re-published by the namespaced reaper": r"chaos reaper: pass \{[^\n]*'republished'",
    "retries asked by a grouped job (an HTTP 429)": r"chaos: job \S+ rate-limited after unit",
}
#: Counts read from the logs into the evidence (``Evidence.log_counts``).
LOG_COUNTS = {
    "soft limit in library statement": r"chaos: soft time limit in library statement,",
    "soft limit in own statement": r"chaos: soft time limit in own statement,",
    "soft limit in library": r"chaos: soft time limit in library,",
    "soft limit in task": r"chaos: soft time limit in task,",
    "soft limits escaped": r"raised unexpected: SoftTimeLimitExceeded",
    "conflicts run again by the task": r"chaos: write conflict in job",
    "conflicts run again by the library": r"its transaction lost to a concurrent one",
}
#: Log lines that break an invariant (``Evidence.log_errors``), by kind.
LOG_ERRORS = {
    "reuse": "|".join(REUSE_ERRORS),
    "conflict_as_outage": (
        r"(unavailable|unreachable)[^\n]*(could not serialize access|deadlock detected|"
        r"Deadlock found)"
    ),
}
#: A worker's log line saying a job's renewals failed until its lease expired.
LOST_RENEWALS = r"lease lost on job (\S+): renewals failed"
#: A worker's log line saying an attempt found at its checkpoint that another held its job,
#: or that its lease had ended under it (or that it could not tell): not one whose job was
#: ended meanwhile (a revoke's terminate ends the job just before its signal stops the process).
LOST_TO_ANOTHER = (
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): [^\n]*lease lost on job (\S+) \(token "
    r"(\d+)\): (?:another attempt holds it|its lease ended before this write|its write "
    r"was refused, and the job cannot be read)"
)


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
    #: Accounts whose triggers are debounced (``chaos.keyed_debounced``, accounts ``d<n>``)
    #: and accounts whose newest trigger wins (``chaos.keyed_newest``, accounts ``n<n>``),
    #: besides the ``keys`` coalescing ones; the bursts are drawn over all of them.
    debounced_keys: int = 0
    newest_keys: int = 0
    #: Jobs (of ``jobs``) sent in job groups (``chaos.grouped_<g>``, exactly-once), spread
    #: over the groups of ``chaos.app.GROUPS`` in turn; 0: none.
    grouped_jobs: int = 0
    #: Fraction of the grouped jobs sent by name (``send_task``: no client records them, their
    #: claim does, and they start at once, counted in their group), and fraction of the grouped
    #: jobs of the groups with a rate that ask for a retry once, after a unit drawn by the seed,
    #: with a countdown of ``RETRY_COUNTDOWNS`` (as a task that met an HTTP 429 would).
    grouped_by_name: float = 0.0
    grouped_retries: float = 0.0
    #: Fraction of the jobs sent with a ``soft_time_limit`` of ``soft_limit_units`` units (a
    #: unit and half the slowest statement each); their row's updates are slowed.
    soft_limits: float = 0.0
    soft_limit_units: tuple[float, float] = (2.5, 4.5)
    #: Calls each client of a ``kill_client`` fault starts (it is killed before it makes
    #: them all, mostly), and the seconds each of its publishes waits.
    client_calls: int = 6
    publish_delay: tuple[float, float] = (0.2, 0.6)
    #: Fraction of the triggers sent with ``expires``, that many keyed-job lengths after.
    key_expiring: float = 0.0
    key_expires_after: tuple[float, float] = (0.2, 2.0)
    #: The isolation level of the tasks' transactions (``chaos.app.ISOLATIONS``; None: the
    #: database's default).
    isolation: str | None = None
    #: A second reaper in a PID namespace of its own (``chaos/reaper.py``, SQLite).
    namespace_reaper: bool = False

    @property
    def all_keys(self) -> int:
        return self.keys + self.debounced_keys + self.newest_keys

    @property
    def keyed(self) -> bool:
        return self.all_keys > 0 and self.triggers > 0

    def account(self, number: int) -> tuple[str, str]:
        """The account argument and lease key of the bursts' account ``number``."""
        return T.account_key(number, keys=self.keys, debounced=self.debounced_keys)

    @property
    def soft_limited_jobs(self) -> int:
        return round(self.jobs * self.soft_limits)

    @property
    def hold_slack(self) -> float:
        """Seconds a job may stay claimed after its attempt died or gave up its lease: the
        lease, two reaper passes, a whole job (a pass waits in the queue behind busy workers)
        and 5 s."""
        longest = max(self.job_seconds, self.key_units * self.unit_seconds)
        return self.lease_seconds + 2 * self.reaper_every + longest + 5.0

    @property
    def slots(self) -> int:
        return self.workers * self.concurrency

    @property
    def job_seconds(self) -> float:
        return self.units * self.unit_seconds

    def effective_queued_timeout(self) -> float:
        return self.queued_timeout or max(20.0, 4 * self.job_seconds)

    def client_queued_timeout(self) -> float:
        """``leases_queued_timeout`` of a dying client's (non-keyed) calls: the wait before the
        reaper re-publishes a job it recorded and never published (its keyed calls use the
        default, off: a keyed job is re-published after ``leases_reap_grace`` then)."""
        return max(10.0, 2 * self.job_seconds)

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
                f"; {self.triggers} triggers of {self.all_keys} keys in bursts of 1-{self.burst} "
                f"(<= {self.burst_gap:g} s apart), keyed jobs of {self.key_units} units"
                + (
                    f"; {self.debounced_keys} keys debounced (quiet {DEBOUNCE[0]:g} s, max wait "
                    f"{DEBOUNCE[1]:g} s)"
                    if self.debounced_keys
                    else ""
                )
                + (f"; {self.newest_keys} keys where the newest wins" if self.newest_keys else "")
                if self.keyed
                else "; no keyed jobs"
            )
            + (
                f", {self.key_expiring:.0%} of the triggers sent with expires"
                if self.keyed and self.key_expiring
                else ""
            )
            + (
                f"; {self.soft_limited_jobs} jobs sent with a soft time limit of "
                f"{self.soft_limit_units[0]:g}-{self.soft_limit_units[1]:g} units"
                if self.soft_limited_jobs
                else ""
            )
            + (
                f"; {self.grouped_jobs} jobs in groups "
                + ", ".join(
                    f"{g} (limit {limit or 'none'}, rate {rate or 'none'})"
                    for g, (limit, rate) in GROUPS.items()
                )
                + f", {self.grouped_by_name:.0%} of them sent by name, {self.grouped_retries:.0%} "
                f"of those with a rate asking for a retry once"
                if self.grouped_jobs
                else ""
            )
            + (f"; transactions at {self.isolation}" if self.isolation else "")
            + ("; a reaper in another PID namespace" if self.namespace_reaper else "")
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
    #: The processes stopped (the worker and its pool), and since when (epoch seconds).
    pids: tuple[int, ...] = ()
    since: float = 0.0


class NamespacedReaper(CeleryProcess):
    """``chaos/reaper.py`` in a PID namespace of its own (``fault.UNSHARE``)."""

    command_name = "nsreaper"
    ready_pattern = re.compile(namespaced_reaper.READY)

    def command(self) -> list[str]:
        return [*F.UNSHARE, sys.executable, "-m", "chaos.reaper"]


#: Times a keyed control looks for a keyed job waiting (one every ``Config.min_gap`` s).
KEYED_TARGET_TRIES = 8


class NoTarget(RuntimeError):
    """A keyed control found no keyed job waiting: tried again a little later."""


@dataclass(frozen=True)
class ClientKill:
    """When a dying client is SIGKILLed: ``delay`` seconds after its call number ``call``
    recorded its job (``in_window``: its publish waits at least that long, so the kill lands
    between the record and the publish) or started (otherwise: before the record, in the
    window, or after the publish). A call that records nothing (a trigger coalesced into its
    key) moves the kill to the next call."""

    call: int
    in_window: bool
    delay: float


class DyingClient(CeleryProcess):
    """``chaos/client.py`` with the plan in ``plan_path``; started without waiting for it
    (:meth:`launch`), SIGKILLed by a watcher thread as ``kill`` says."""

    command_name = "client"
    ready_pattern = re.compile(dying_client.READY)

    def __init__(self, plan_path: Path, *, kill: ClientKill, **options: Any) -> None:
        super().__init__(CHAOS_APP, **options)
        self.plan_path = plan_path
        self.kill_plan = kill
        self.killed = False
        self.how = ""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "chaos.client", str(self.plan_path)]

    def launch(self) -> None:
        """Start the process (not waiting for it to be ready)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.cwd,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def calls(self) -> dict[str, bool]:
        """The calls it started: call id -> whether the call returned."""
        text = self.log_text()
        returned = set(re.findall(rf"{dying_client.PUBLISHED} (\S+) ->", text))
        return {i: i in returned for i in re.findall(rf"{dying_client.RECORDING} (\S+)", text)}

    def watch(self, deadline: float = 90.0) -> str:
        """Wait for the moment ``kill_plan`` names (polling the log every 10 ms), then SIGKILL
        the client's process group; what the kill interrupted."""
        plan = self.kill_plan
        target = plan.call
        limit = time.monotonic() + deadline
        how = "its calls all made"
        while time.monotonic() < limit:
            text = self.log_text()
            started = re.findall(rf"{dying_client.RECORDING} (\S+)", text)
            if dying_client.DONE in text or not self.is_alive():
                break
            if len(started) > target:
                call = started[target]
                if not plan.in_window:
                    time.sleep(plan.delay)
                    how = f"{plan.delay:.2f} s after call {call} started"
                    break
                if f"{dying_client.RECORDED} {call}," in text:
                    time.sleep(plan.delay)
                    how = f"{plan.delay:.2f} s after call {call} recorded its job, publishing"
                    break
                returned = f"{dying_client.PUBLISHED} {call} "
                if returned in text or f"{dying_client.FAILED} {call}:" in text:
                    target += 1  # coalesced (nothing to publish) or failed: the next call
            time.sleep(0.01)
        else:
            how = f"not at its moment within {deadline:g} s"
        F.signal_group(self.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.wait(timeout=10)
        self.killed = True
        self.how = how
        return how


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
    #: The private primary and standby of ``--database postgres-failover``
    #: (``tests.support.replica.ReplicatedPostgres``) that ``failover`` faults act on.
    pair: Any = None
    out: Callable[[str], None] = field(default=lambda line: print(line, flush=True))

    def __post_init__(self) -> None:
        c = self.config
        self.rng = random.Random(c.seed)
        extra = {k: v for k, v in self.broker.items() if k != "broker_url"}
        extra.update(
            leases_queued_timeout=c.effective_queued_timeout(),
            leases_db_retry_max_delay=4.0,
            # What the docs ask of a result backend that can be down (a Redis restart): without
            # it Celery stores FAILURE for a task that finishes meanwhile, as its store of
            # SUCCESS first reads the task's state outside the backend's own retries (seen in a
            # long run, seed 1194495860: the table done, the backend FAILURE ConnectionError).
            result_backend_always_retry=True,
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
        #: Keyed controls, the triggers sent with ``expires`` (epoch seconds), the jobs sent
        #: with a soft time limit (seconds), the clients started, the processes stopped and
        #: when PostgreSQL restarted (epoch seconds).
        self.key_controls: list[Control] = []
        self.key_expires: dict[str, float] = {}
        self.soft_limited: dict[str, float] = {}
        #: The grouped jobs' numbers and their groups (``--grouped-jobs``); those sent by name,
        #: and those that ask for a retry: the unit after which, and its countdown.
        self.groups: dict[int, str] = {}
        self.by_name: set[str] = set()
        #: When each job sent by name was sent, and each broker restart that lost the queue
        #: (epoch seconds): the checks' excuse for a message the broker lost before any claim.
        self.by_name_sent: dict[str, float] = {}
        self.broker_restarts: list[float] = []
        self.group_retries: dict[str, tuple[int, float]] = {}
        self.clients: list[DyingClient] = []
        self.pauses: list[Pause] = []
        self.restarts: list[float] = []
        self.namespace_reaper: NamespacedReaper | None = None
        #: Times each fault found no target (keyed controls are tried again).
        self.no_target: Counter[int] = Counter()
        if c.isolation:
            self.env[ISOLATION_ENV] = c.isolation

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
                keys=c.all_keys,
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
            self.out(
                "chaos: trigger bursts "
                + ", ".join(b.describe(c.account(b.account)[0]) for b in self.bursts)
            )
        client = self.client = add_chaos_tasks(make_leased_app(self.env, name="chaos-client"))
        store = self.store = store_for(settings_for(client))
        log = chaos_log_for(client)
        callbacks = callback_log_for(client)
        triggers = trigger_log_for(client)
        # Their own generator: the other draws stay as they were for a seed.
        soft = set(random.Random(f"{c.seed}-soft").sample(range(c.jobs), c.soft_limited_jobs))
        # Their own generator too; a grouped job is exactly-once, its group in its id.
        grouped = sorted(
            random.Random(f"{c.seed}-groups").sample(range(c.jobs), min(c.grouped_jobs, c.jobs))
        )
        names = list(GROUPS)
        self.groups = {number: names[n % len(names)] for n, number in enumerate(grouped)}
        ids = {
            f"chaos-{c.seed}-{number:05d}-"
            + (
                f"eo-{self.groups[number]}"
                if number in self.groups
                else ("eo" if mode == EXACTLY_ONCE else "alo")
            )
            + (SOFT_SUFFIX if number in soft else ""): EXACTLY_ONCE
            if number in self.groups
            else mode
            for number, mode in enumerate(modes)
        }
        limits = random.Random(f"{c.seed}-soft-limits")
        self.soft_limited = {
            job_id: limits.uniform(*c.soft_limit_units)
            * (c.unit_seconds + SLOW_STATEMENT_SECONDS / 2)
            for job_id in sorted(ids)
            if job_id.endswith(SOFT_SUFFIX)
        }
        if self.soft_limited:
            self.out(
                "chaos: sent with a soft time limit "
                + ", ".join(f"{i.split('-')[2]} {s:.1f}s" for i, s in self.soft_limited.items())
            )
        self._draw_grouped(ids)
        # Drawn after the plan, so a seed's plan is the same with and without expiring jobs. A
        # job sent by name is not: it has no row until a worker claims it, so a message that
        # expired before would leave nothing recorded to end (nor anything to check).
        self.expiring = {
            job_id: self.rng.uniform(*c.expires_after) * c.job_seconds
            for job_id in sorted(self.rng.sample(sorted(ids), c.expiring_jobs))
            if job_id not in self.by_name
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
            admission_log = install_admission_log(store.engine, self.table)
            cursor_log = install_cursor_log(store.engine, self.table)
            if self.soft_limited and not install_slow_statements(store.engine, self.table):
                self.out("chaos: no slow statements on this database (PostgreSQL only)")
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
            evidence = self._evidence(
                store, log, checkpoint_log, state_log, cursor_log, admission_log, ids
            )
        finally:
            self._thaw_all()
            self._stop_sender()
            kill_all(self.spawner)
            for remove in (
                remove_checkpoint_log,
                remove_state_log,
                remove_cursor_log,
                remove_admission_log,
                remove_slow_statements,
            ):
                with contextlib.suppress(Exception):
                    remove(store.engine, self.table)
            close_app(client)
            log.dispose()
            callbacks.dispose()
            triggers.dispose()
            store.engine.dispose()
        return self._report(evidence, seconds)

    def _draw_grouped(self, ids: dict[str, str]) -> None:
        """Draw which grouped jobs are sent by name and which ask for a retry (when and with
        which countdown), each from a generator of its own: the other draws stay as they were
        for a seed."""
        c = self.config
        grouped = sorted(i for i in ids if group_of_id(i) is not None)
        by_name = random.Random(f"{c.seed}-by-name")
        self.by_name = set(by_name.sample(grouped, round(len(grouped) * c.grouped_by_name)))
        rated = [i for i in grouped if GROUPS[group_of_id(i) or ""][1] is not None]
        draw = random.Random(f"{c.seed}-retries")
        self.group_retries = {
            job_id: (draw.randint(1, max(1, c.units - 1)), draw.choice(RETRY_COUNTDOWNS))
            for job_id in sorted(draw.sample(rated, round(len(rated) * c.grouped_retries)))
        }
        if self.by_name:
            self.out(
                "chaos: grouped jobs sent by name "
                + ", ".join(i.split("-")[2] for i in sorted(self.by_name))
            )
        if self.group_retries:
            self.out(
                "chaos: grouped jobs asking for a retry (after unit, countdown) "
                + ", ".join(
                    f"{i.split('-')[2]} ({n - 1}, {s:g}s)"
                    for i, (n, s) in self.group_retries.items()
                )
            )

    def _new_sender(self, client: Any, store: Any, triggers: Any) -> T.Sender:
        c = self.config
        task = client.tasks[KEYED_TASK]

        def call(account: str, trigger_id: str) -> str:
            options: dict[str, Any] = {}
            draw = random.Random(f"{c.seed}-{trigger_id}")
            if not account.startswith("k"):
                # Debounced (d<n>) or newest-wins (n<n>): the trigger's id as its marker
                # argument, no expires (a burst's job carries its last trigger's options).
                other = client.tasks[DEBOUNCED_TASK if account.startswith("d") else NEWEST_TASK]
                args = (account, c.key_units, c.unit_seconds, trigger_id)
                return str(other.apply_async(args, task_id=trigger_id).id)
            if c.key_expiring and draw.random() < c.key_expiring:
                after = draw.uniform(*c.key_expires_after) * c.key_units * c.unit_seconds
                moment = time.time() + after
                self.key_expires[trigger_id] = moment
                options["expires"] = datetime.fromtimestamp(moment, tz=timezone.utc)
            return str(
                task.apply_async(
                    (account, c.key_units, c.unit_seconds), task_id=trigger_id, **options
                ).id
            )

        sender = T.Sender(
            call=call,
            clock=store.now,
            record=triggers.add,
            out=self.out,
            prefix=f"chaos-{c.seed}",
            accounts=c.account,
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
        extra: list[CeleryProcess] = []
        if c.namespace_reaper:
            extra.append(self._new_namespace_reaper())
        start_all([*workers, self._new_beat(), *extra], timeout=60)
        if self.namespace_reaper is not None:
            found = re.search(r"chaos reaper: ready: ([^\n]*)", self.namespace_reaper.log_text())
            self.out(
                f"chaos: namespaced reaper {self.namespace_reaper.name}: "
                f"{found.group(1) if found else '?'} (this driver: pid {os.getpid()} in "
                f"{os.readlink('/proc/self/ns/pid')})"
            )

    def _new_namespace_reaper(self) -> NamespacedReaper:
        reaper = NamespacedReaper(CHAOS_APP, env=self.env, log_dir=self.spawner.log_dir)
        self.spawner.processes.append(reaper)
        self.namespace_reaper = reaper
        return reaper

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
                new_finished, new_committed = _tally(
                    store.table, log, c.units, exclude=self._client_prefix()
                )
                if (new_finished, new_committed) != (finished, committed):
                    last_change = now
                finished, committed = new_finished, new_committed
            while pending and len(submitted) - finished < window:
                job_id, mode = pending[0]
                group = group_of_id(job_id)
                task = GROUPED_TASK.format(group=group) if group else TASK_OF_MODE[mode]
                # A grouped job sent by name goes as another language's client sends it: its
                # message alone, nothing recorded; the others through the task's apply_async.
                send = (
                    partial(client.send_task, task)
                    if job_id in self.by_name
                    else client.tasks[task].apply_async
                )
                sent_at = time.time()
                try:
                    send(
                        (c.units, c.unit_seconds),
                        {"group": group, **self._retry(job_id)} if group else None,
                        task_id=job_id,
                        link=client.signature(CALLBACK_TASK, args=(job_id,)),
                        link_error=client.signature("chaos.errback"),
                        **self._expiry(job_id),
                        **self._soft_limit(job_id),
                    )
                except Exception as exc:  # the broker or the database is restarting
                    self.out(f"chaos: [{self._clock()}] submit of {job_id} failed, again: {exc!r}")
                    break
                pending.pop(0)
                submitted.append(job_id)
                if job_id in self.by_name:
                    self.by_name_sent[job_id] = sent_at
            progress = min(committed / total_units, 1.0)
            while self.bursts and self.bursts[0].at <= progress and self.sender is not None:
                self.sender.schedule(self.bursts.pop(0))
            if faults and faults[0].at <= progress and now - last_fault >= c.min_gap:
                fault = faults.pop(0)
                if not self._inject(fault, progress):
                    # No keyed job waits now: again a little later (a few times).
                    F.try_again(faults, fault, progress)
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
        sender = self.sender is None or self.sender.idle or not self.sender.is_alive()
        return sender and all(client.killed for client in self.clients)

    def _retry(self, job_id: str) -> dict[str, Any]:
        """The arguments of a grouped job that asks for a retry: after which unit, and its
        countdown (``chaos.exactly_once``); else none."""
        if job_id not in self.group_retries:
            return {}
        after, countdown = self.group_retries[job_id]
        return {"retry_after": after, "retry_countdown": countdown}

    def _soft_limit(self, job_id: str) -> dict[str, Any]:
        limit = self.soft_limited.get(job_id)
        return {} if limit is None else {"soft_time_limit": limit}

    def _client_prefix(self) -> str:
        return f"chaos-{self.config.seed}-c"

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
        k = self.store.keys
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
        pending = sa.select(sa.func.count()).select_from(k).where(k.c.pending_id.is_not(None))
        left = None
        while time.monotonic() < deadline:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                with log.engine.connect() as connection:
                    left = int(connection.execute(waiting).scalar_one())
                    left += int(connection.execute(pending).scalar_one())
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

    def _inject(self, fault: F.Fault, progress: float) -> bool:
        """Do ``fault``; False when it is to be tried again later (a keyed control that found
        no keyed job waiting, ``KEYED_TARGET_TRIES`` times at most)."""
        head = f"chaos: [{self._clock()}] fault {fault.number} {fault.kind}"
        targets = self._targets()
        if fault.kind in F.WORKER_KINDS and not targets:
            self.skipped_faults += 1
            self.out(f"{head}: skipped, no worker to target")
            return True
        worker = targets[int(fault.pick * len(targets))] if targets else None
        try:
            detail = getattr(self, f"_fault_{fault.kind}")(fault, worker)
        except NoTarget as exc:
            self.no_target[fault.number] += 1
            if self.no_target[fault.number] < KEYED_TARGET_TRIES:
                return False
            self.skipped_faults += 1
            self.out(f"{head}: failed to inject: {exc!r} ({KEYED_TARGET_TRIES} tries)")
            return True
        except Exception as exc:
            self.skipped_faults += 1
            self.out(f"{head}: failed to inject: {exc!r}")
            return True
        self.done_faults[fault.kind] += 1
        self.out(f"{head} at {progress:.0%}: {detail}")
        return True

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
        pids = (worker.pid, *worker.children())
        since = time.time()
        freeze(worker)
        self.frozen.append(_Frozen(worker, time.monotonic() + fault.seconds, pids, since))
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
        for pid, job_id, seconds, since in F.taken_holds(self.hold_dir):
            worker = next((w for w in self.spawner.processes if w.pid == pid), None)
            if not isinstance(worker, Worker):
                continue
            pids = (worker.pid, *worker.children())
            self.frozen.append(_Frozen(worker, now + seconds, pids, since))
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
                self.kills.append(Kill(time.time(), (worker.pid, *worker.children())))
                F.signal_group(worker.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    worker.wait(timeout=10)
                how = f"still running {now - draining.sent:.1f} s after its SIGTERM: SIGKILLed"
            else:
                how = f"exited {now - draining.sent:.1f} s after its SIGTERM"
            self.draining.remove(draining)
            self.out(f"chaos: [{self._clock()}] {worker.name} {how}")

    def _fault_restart_database(self, fault: F.Fault, worker: Worker | None) -> str:
        self.restarts.append(time.time())
        try:
            return f"PostgreSQL restarted in {F.restart_postgres():.1f} s"
        finally:
            self.restarts.append(time.time())

    def _fault_failover(self, fault: F.Fault, worker: Worker | None) -> str:
        """Crash the pair's primary, promote its standby, build a new standby (see
        ``ReplicatedPostgres.fail_over``). The database was unreachable from the crash to the
        promotion: recorded as a restart (the checks' excuse for a lease lost meanwhile)."""
        if self.pair is None:
            raise RuntimeError(f"no replicated pair: run with --database {F.FAILOVER_DATABASE}")
        before = time.time()
        try:
            done = self.pair.fail_over()
        except Exception:  # it may have crashed the primary before it failed
            self.restarts += [before, time.time()]
            raise
        self.restarts += [done.crashed_at, done.promoted_at]
        return (
            f"PostgreSQL primary :{done.old_port} crashed, standby :{done.new_port} promoted "
            f"({done.down_seconds:.1f} s without a primary); a new synchronous standby streams "
            f"on :{done.old_port} after {done.seconds:.1f} s"
        )

    def _fault_restart_broker(self, fault: F.Fault, worker: Worker | None) -> str:
        keep = _redis_db(self.result_backend)
        try:
            down = F.restart_redis(self.broker["broker_url"], keep_dbs=keep)
        finally:
            self.broker_restarts.append(time.time())
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
            return bool(
                job.state == "queued" or (job.checkpoint or {}).get("next", 0) <= c.units - 2
            )

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

    def _keyed_targets(self) -> list[tuple[str, str]]:
        """(id, ``queued`` or ``pending``) of the keyed runs queued and the ids triggers wait
        under on busy keys, that no keyed control targeted yet, in id order."""
        t, k = self.store.table, self.store.keys
        with self.store.engine.connect() as connection:
            queued = connection.execute(
                sa.select(t.c.id).where(
                    t.c.lease_key.is_not(None),
                    t.c.state == "queued",
                    t.c.served_by.is_(None),
                )
            ).scalars()
            found = [(str(i), "queued") for i in queued]
            pending = connection.execute(
                sa.select(k.c.pending_id).where(k.c.pending_id.is_not(None))
            ).scalars()
            found += [(str(i), "pending") for i in pending]
        targeted = {control.job_id for control in self.key_controls}
        return sorted((i, how) for i, how in found if i not in targeted)

    def _fault_revoke_keyed(self, fault: F.Fault, worker: Worker | None) -> str:
        """``revoke(id)`` of a queued keyed job, or of the id triggers wait under (no job of
        that id yet: the revoke flags it in the live workers)."""
        found = self._keyed_targets()
        if not found:
            raise NoTarget("no queued keyed job and no waiting trigger to revoke")
        job_id, how = found[int(fault.pick * len(found))]
        at = self.store.now()
        self.key_controls.append(Control(job_id, "revoke", at, how))
        with self.client.connection_for_write() as connection:
            self.client.control.revoke(job_id, connection=connection)
        return f"revoke of {job_id} ({'queued' if how == 'queued' else 'triggers waiting'})"

    def _fault_cancel_keyed(self, fault: F.Fault, worker: Worker | None) -> str:
        """``Store.cancel_queued`` of a queued keyed job, or of the id triggers wait under
        (nothing to cancel: no job of that id yet)."""
        found = self._keyed_targets()
        if not found:
            raise NoTarget("no queued keyed job and no waiting trigger to cancel")
        job_id, how = found[int(fault.pick * len(found))]
        at = self.store.now()
        try:
            cancelled = self.store.cancel_queued(job_id)
        except LeaseError:
            self.key_controls.append(Control(job_id, "cancel", at, "uncertain"))
            raise
        self.key_controls.append(Control(job_id, "cancel", at, "queued" if cancelled else "none"))
        what = "queued" if how == "queued" else "triggers waiting"
        return f"cancel of {job_id} ({what}): {'cancelled' if cancelled else 'nothing to cancel'}"

    def _fault_kill_client(self, fault: F.Fault, worker: Worker | None) -> str:
        """Start a client that calls jobs and triggers over a slow broker; it is SIGKILLed a
        seeded moment (:class:`ClientKill`) by a thread of its own (:meth:`DyingClient.watch`)."""
        c = self.config
        rng = random.Random(f"{c.seed}-client-{fault.number}")
        calls = []
        for index in range(c.client_calls):
            if c.keyed and c.keys and index % 2 == 1:
                call_id = f"{self._client_prefix()}{fault.number:03d}k{index}"
                calls.append({"kind": "trigger", "id": call_id, "account": rng.randrange(c.keys)})
            else:
                mode = rng.choice((EXACTLY_ONCE, AT_LEAST_ONCE))
                suffix = "eo" if mode == EXACTLY_ONCE else "alo"
                call_id = f"{self._client_prefix()}{fault.number:03d}{index}-{suffix}"
                calls.append({"kind": "job", "id": call_id, "mode": mode})
        plan = {
            "seed": f"{c.seed}-client-{fault.number}",
            "calls": calls,
            "units": c.units,
            "unit_seconds": c.unit_seconds,
            "key_units": c.key_units,
            "publish_delay": list(c.publish_delay),
        }
        path = Path(self.spawner.log_dir) / f"client-{fault.number:03d}.json"
        path.write_text(json.dumps(plan))
        low, high = c.publish_delay
        in_window = rng.random() < 0.7
        kill = ClientKill(
            call=rng.randrange(c.client_calls),
            in_window=in_window,
            delay=rng.uniform(0.0, 0.8 * low) if in_window else rng.uniform(0.0, high + 0.1),
        )
        settings = json.loads(self.env.get("TEST_CELERY_CONFIG") or "{}")
        settings["leases_queued_timeout"] = c.client_queued_timeout()
        env = {**self.env, "TEST_CELERY_CONFIG": json.dumps(settings)}
        client = DyingClient(path, kill=kill, env=env, log_dir=self.spawner.log_dir)
        self.spawner.processes.append(client)
        self.clients.append(client)
        client.launch()
        threading.Thread(
            target=self._kill_client, args=(client,), name=f"kill-{client.name}", daemon=True
        ).start()
        moment = "recorded its job" if kill.in_window else "started"
        return (
            f"client {client.name} (pid {client.pid}) calls {len(calls)} jobs and triggers, "
            f"SIGKILLed {kill.delay:.2f} s after its call #{kill.call} {moment}"
        )

    def _kill_client(self, client: DyingClient) -> None:
        how = client.watch()
        self.kills.append(Kill(time.time(), (client.pid,)))
        calls = client.calls()
        cut = [i for i, returned in calls.items() if not returned]
        self.out(
            f"chaos: [{self._clock()}] {client.name} SIGKILLed {how}; "
            f"{len(calls) - len(cut)} of its calls returned"
            + (f", {cut[0]} did not" if cut else "")
        )

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
                self._start_tending(replacement)
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                self.workers.remove(replacement)
                replacement = self._new_worker()
        return replacement.name

    def _start_tending(self, process: CeleryProcess, timeout: float = 60) -> None:
        """Start ``process`` and wait until it is ready, thawing the frozen workers whose time
        has come meanwhile: a worker frozen inside a write transaction (on SQLite, any frozen
        writer) would otherwise keep the new process from getting ready, and the run would
        wait for both."""
        failure: list[BaseException] = []

        def start() -> None:
            try:
                process.start(timeout=timeout)
            except BaseException as exc:
                failure.append(exc)

        starting = threading.Thread(target=start, name=f"start-{process.name}", daemon=True)
        starting.start()
        while starting.is_alive():
            now = time.monotonic()
            self._take_holds(now)
            self._thaw_due(now)
            starting.join(0.1)
        if failure:
            raise failure[0]

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
            self._start_tending(self._new_beat())
        reaper = self.namespace_reaper
        if reaper is not None and not reaper.is_alive():
            self.unexpected_exits += 1
            self.out(
                f"chaos: [{self._clock()}] the namespaced reaper exited (status "
                f"{reaper.returncode}); restarting it"
            )
            self._start_tending(self._new_namespace_reaper())

    def _thaw_due(self, now: float) -> None:
        for frozen in [f for f in self.frozen if f.until <= now]:
            self._thaw(frozen)
            self.frozen.remove(frozen)

    def _thaw_all(self) -> None:
        self._take_holds(time.monotonic())
        for frozen in self.frozen:
            self._thaw(frozen)
        self.frozen.clear()

    def _thaw(self, frozen: _Frozen) -> None:
        thaw(frozen.worker)
        self.pauses.append(Pause(frozen.pids, frozen.since, time.time()))

    # -- evidence and report ---------------------------------------------------------------

    def _evidence(
        self,
        store: Any,
        log: Any,
        checkpoint_log: sa.Table,
        state_log: sa.Table,
        cursor_log: sa.Table,
        admission_log: sa.Table,
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
                    t.c.started_at,
                    t.c.served_by,
                    t.c.message,
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
            al = admission_log
            admissions = [
                Admission(r.job_id, r.lease_group, r.at, r.run_after, r.kind)
                for r in connection.execute(
                    sa.select(
                        al.c.job_id, al.c.lease_group, al.c.at, al.c.run_after, al.c.kind
                    ).order_by(al.c.id)
                )
            ]
            k = store.keys
            saved = {
                r.lease_key: _json(r.cursor_state)
                for r in connection.execute(sa.select(k.c.lease_key, k.c.cursor_state))
            }
            pending = {
                r.lease_key: r.pending_id
                for r in connection.execute(
                    sa.select(k.c.lease_key, k.c.pending_id).where(k.c.pending_id.is_not(None))
                )
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
                r.started_at,
                r.served_by,
                _carries_expires(r.message),
            )
            for r in rows
        }
        callbacks = callback_log_for(self.client)
        c = self.config
        client_calls: dict[str, bool] | None = None
        if self.clients:
            client_calls = {}
            for dying in self.clients:
                client_calls.update(dying.calls())
            # Its recorded jobs are jobs of the run: every check of a job applies to them.
            ids = {
                **ids,
                **{
                    i: EXACTLY_ONCE if i.endswith("-eo") else AT_LEAST_ONCE
                    for i in client_calls
                    if i in jobs and jobs[i].key is None
                },
            }
        logs = {p.name: p.log_text() for p in self.spawner.processes}
        text = "\n".join(logs.values())
        triggers = self._trigger_rows() if c.keyed or self.clients else []
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
                [
                    Trigger(key, i, served, at, answered)
                    for key, i, served, at, answered, _ in triggers
                ]
                if c.keyed
                else None
            ),
            key_units=c.key_units,
            debounced_keys={c.account(n)[1] for n in range(c.keys, c.keys + c.debounced_keys)},
            newest_keys={c.account(n)[1] for n in range(c.keys + c.debounced_keys, c.all_keys)},
            debounce=DEBOUNCE,
            groups={i: g for i in ids if (g := group_of_id(i)) is not None},
            group_limits={g: limit for g, (limit, _) in GROUPS.items()},
            group_rates={g: rate_of(rate) for g, (_, rate) in GROUPS.items()},
            admissions=admissions,
            by_name=set(self.by_name),
            by_name_sent=dict(self.by_name_sent),
            broker_restarts=list(self.broker_restarts),
            group_retries={j: after for j, (after, _) in self.group_retries.items()},
            cursors=saved,
            cursor_log=cursors,
            key_controls=list(self.key_controls),
            key_expires=dict(self.key_expires),
            pending=pending,
            key_backend=(
                self._backend_outcomes(
                    sorted({served for _, _, served, *_ in triggers if served is not None})
                )
                if self.result_backend and c.keyed
                else None
            ),
            soft_limited=dict(self.soft_limited),
            log_counts={name: len(re.findall(p, text)) for name, p in LOG_COUNTS.items()},
            log_errors={
                kind: [
                    f"{name}: {line.strip()}"
                    for name, log in logs.items()
                    for line in log.splitlines()
                    if re.search(pattern, line)
                ]
                for kind, pattern in LOG_ERRORS.items()
            },
            client_calls=client_calls,
            pauses=list(self.pauses),
            restarts=list(self.restarts),
            lost_renewals=set(re.findall(LOST_RENEWALS, text)),
            lost_to_another=[
                (job, int(token), _log_time(stamp, ms))
                for stamp, ms, job, token in re.findall(LOST_TO_ANOTHER, text, re.MULTILINE)
            ],
            lease_seconds=c.lease_seconds,
            global_lock=self.database_url.startswith("sqlite"),
            hold_slack=c.hold_slack,
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
            f"  keyed: {f.get('triggers', 0)} triggers of {c.all_keys} keys (and "
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
            f"done {f.get('controls_expires_done', 0)}); keyed: revoke "
            f"{sum(1 for k in self.key_controls if k.kind == 'revoke')}, cancel "
            f"{sum(1 for k in self.key_controls if k.kind == 'cancel')}, triggers sent with "
            f"expires {len(self.key_expires)}",
            f"  dying clients {len(self.clients)}: {f.get('client_calls', 0)} calls started, "
            f"{f.get('client_recorded', 0)} recorded a job, "
            f"{f.get('client_interrupted_after_record', 0)} killed after recording (publish "
            f"unconfirmed); soft-limited jobs {len(self.soft_limited)}; pauses recorded "
            f"{len(self.pauses)}",
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


def _tally(jobs: sa.Table, log: Any, units: int, *, exclude: str = "") -> tuple[int, int]:
    """(chaos jobs finished, units done): committed units, plus the units a job that stopped
    early (revoked, cancelled, failed) will never commit; keyed jobs, and jobs whose id starts
    with ``exclude`` (the dying clients'), left out."""
    u = log.table
    chaos: sa.ColumnElement[bool] = jobs.c.task.in_(TASKS)
    if exclude:
        chaos = sa.and_(chaos, ~jobs.c.id.startswith(exclude, autoescape=True))
    ours = sa.select(jobs.c.id).where(chaos)
    committed = sa.and_(u.c.ended_at.is_not(None), u.c.job_id.in_(ours))
    stopped = sa.select(jobs.c.id).where(chaos, jobs.c.state.in_(STOPPED))
    with log.engine.connect() as connection:
        states = dict(
            connection.execute(
                sa.select(jobs.c.state, sa.func.count()).where(chaos).group_by(jobs.c.state)
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


def group_of_id(job_id: str) -> str | None:
    """The group of a job of the run, from its id (``...-eo-<group>``, then maybe the soft
    limit's suffix); None for a job of no group."""
    parts = job_id.removesuffix(SOFT_SUFFIX).split("-")
    return parts[-1] if len(parts) >= 5 and parts[-1] in GROUPS else None


def _redis_db(url: str | None) -> tuple[int, ...]:
    """The database number of a Redis URL on the Redis a restart fault restarts, else ()."""
    if not url or not F.local_redis(url):
        return ()
    return (int(urlsplit(url).path.strip("/") or 0),)


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _log_time(stamp: str, milliseconds: str) -> float:
    """Epoch seconds of a Celery log line's time (this machine's local time)."""
    moment = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S")  # local time, as Celery logs it
    return moment.timestamp() + int(milliseconds) / 1000


def _carries_expires(message: str | None) -> bool:
    """Whether a job's recorded message (Celery's JSON) carries ``expires``."""
    if not message:
        return False
    try:
        headers = json.loads(message).get("headers") or {}
    except (ValueError, AttributeError):
        return False
    return headers.get("expires") is not None


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
        "--debounced-keys",
        type=int,
        default=0,
        help=f"accounts (besides --keys) whose triggers are debounced (quiet {DEBOUNCE[0]:g} s, "
        f"max wait {DEBOUNCE[1]:g} s)",
    )
    parser.add_argument(
        "--newest-keys",
        type=int,
        default=0,
        help="accounts (besides --keys) whose newest trigger wins (lease_key_strategy=newest)",
    )
    parser.add_argument(
        "--grouped-jobs",
        type=int,
        default=0,
        help="jobs (of --jobs, exactly-once) sent in job groups, in turn: "
        + ", ".join(
            f"{g} (limit {limit or 'none'}, rate {rate or 'none'})"
            for g, (limit, rate) in GROUPS.items()
        ),
    )
    parser.add_argument(
        "--grouped-by-name",
        type=float,
        default=0.0,
        help="fraction of the grouped jobs sent by name (send_task: nothing recorded by the "
        "client; they start at once, counted in their group); 0: none",
    )
    parser.add_argument(
        "--grouped-retries",
        type=float,
        default=0.0,
        help="fraction of the grouped jobs of the groups with a rate that ask for a retry once "
        "(self.retry, as after an HTTP 429); 0: none",
    )
    parser.add_argument(
        "--soft-limits",
        type=float,
        default=0.1,
        help="fraction of the jobs sent with a short soft_time_limit (landing inside "
        "statements: their row's statements are slowed on PostgreSQL); 0: none",
    )
    parser.add_argument(
        "--no-dying-clients",
        action="store_true",
        help="no kill_client faults (a client SIGKILLed between recording and publishing)",
    )
    parser.add_argument(
        "--no-keyed-controls",
        action="store_true",
        help="no revoke_keyed / cancel_keyed faults and no triggers sent with expires",
    )
    parser.add_argument(
        "--key-expiring",
        type=float,
        default=0.1,
        help="fraction of the triggers sent with expires (0.2-2 keyed-job lengths after)",
    )
    parser.add_argument(
        "--isolation",
        choices=ISOLATIONS,
        default="mixed",
        help="isolation level of the tasks' transactional checkpoints (mixed: repeatable read "
        "for half the jobs); not on SQLite",
    )
    parser.add_argument(
        "--namespace-reaper",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a second reaper in a PID namespace of its own via unshare (default: on SQLite, "
        "where unshare works; asked for and not possible: an error)",
    )
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated fault kinds: only those of the run's kinds (to replay one kind)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random if not given")
    parser.add_argument(
        "--broker", default="redis", help="redis | rabbitmq | filesystem | a broker URL"
    )
    parser.add_argument(
        "--database",
        default="postgres",
        help=f"postgres | sqlite | {F.FAILOVER_DATABASE} (a private primary and synchronous "
        "standby of the run's own, on /dev/shm) | a URL",
    )
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
        "--failover",
        action="store_true",
        help=f"crash the primary and promote the standby mid-run, then build a new standby "
        f"(--database {F.FAILOVER_DATABASE} only; disturbs nobody else)",
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
        debounced_keys=args.debounced_keys,
        newest_keys=args.newest_keys,
        grouped_jobs=args.grouped_jobs,
        grouped_by_name=args.grouped_by_name,
        grouped_retries=args.grouped_retries,
        soft_limits=args.soft_limits,
        key_expiring=0.0 if args.no_keyed_controls or args.no_controls else args.key_expiring,
        isolation=None if args.database.startswith("sqlite") else args.isolation,
        namespace_reaper=namespace_reaper(args),
    )


def namespace_reaper(args: argparse.Namespace) -> bool:
    """Whether the run has a reaper in another PID namespace: asked for (``--namespace-reaper``:
    SQLite only), or by default on SQLite where ``unshare`` works."""
    sqlite = args.database.startswith("sqlite")
    if args.namespace_reaper is False:
        return False
    if args.namespace_reaper is None:
        return sqlite and F.unshare_error() is None
    if not sqlite:
        raise SystemExit("--namespace-reaper: SQLite only (its holders' liveness is the machine's)")
    error = F.unshare_error()
    if error is not None:
        raise SystemExit(f"--namespace-reaper: unshare cannot run here: {error}")
    return True


def fault_kinds(args: argparse.Namespace) -> tuple[str, ...]:
    """The fault kinds of a run with the command line ``args``: the worker faults, the
    frozen-in-transaction one where the database bounds an idle transaction (not SQLite), the
    service restarts and failovers asked for, the controls unless ``--no-controls`` (with
    keyed jobs, the keyed controls too unless ``--no-keyed-controls``), and the dying clients
    unless ``--no-dying-clients``."""
    kinds = list(F.WORKER_KINDS)
    if not args.database.startswith("sqlite"):
        kinds += F.TRANSACTION_KINDS
    if args.restart_database:
        kinds.append("restart_database")
    if args.restart_broker:
        kinds.append("restart_broker")
    if args.failover:
        kinds.append("failover")
    if not args.no_controls:
        kinds += F.CONTROL_KINDS
        all_keys = args.keys + args.debounced_keys + args.newest_keys
        if all_keys and args.triggers and not args.no_keyed_controls:
            # No revoke on the filesystem broker: its broadcast rarely reaches a worker.
            kinds += [
                k
                for k in F.KEYED_CONTROL_KINDS
                if k != "revoke_keyed" or args.broker != "filesystem"
            ]
    if not args.no_dying_clients:
        kinds += F.CLIENT_KINDS
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
    problems = check_restartable(
        config, database_url=database_url, broker=args.broker, database=args.database
    )
    if problems:
        parser.error("; ".join(problems))
    pair = start_failover_pair() if args.database == F.FAILOVER_DATABASE else None
    if isinstance(pair, str):
        parser.error(pair)
    if pair is not None:
        database_url = pair.url
        print(f"chaos: leases database: a private primary and synchronous standby in {pair.root}")
    with (
        _closing_pair(pair),
        _broker_settings(args.broker, log_dir) as broker,
        _result_backend(args.result_backend, args.broker, log_dir) as backend,
    ):
        try:
            report = Chaos(config, spawner, broker, database_url, table, backend, pair).run()
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
            if not args.keep and pair is None:  # the pair is removed whole
                _drop_tables(database_url, table)
    return 0 if report.ok else 1


def check_restartable(
    config: Config, *, database_url: str, broker: str, database: str = ""
) -> list[str]:
    """Why the service restarts and failovers asked for cannot be done here (empty when they
    can). Whether the pair of ``--database postgres-failover`` starts is
    :func:`start_failover_pair`'s to say."""
    from tests.support.service import REDIS_URL

    problems = []
    if "failover" in config.kinds and database != F.FAILOVER_DATABASE:
        problems.append(
            f"--failover needs --database {F.FAILOVER_DATABASE} (a primary and standby of the "
            "run's own: the shared PostgreSQL is never failed over)"
        )
    if "restart_database" in config.kinds and not F.can_restart_postgres(database_url):
        problems.append(
            "--restart-database needs the local PostgreSQL (127.0.0.1:5432) and pg_ctlcluster"
        )
    broker_url = REDIS_URL if broker == "redis" else broker
    if "restart_broker" in config.kinds and not F.can_restart_redis(broker_url):
        problems.append("--restart-broker needs the local Redis (127.0.0.1:6379) and redis-server")
    return problems


def start_failover_pair() -> Any:
    """The started primary and synchronous standby of ``--database postgres-failover``
    (``tests.support.replica.ReplicatedPostgres``), or why they cannot start here (a str:
    no PostgreSQL server binaries, or binaries that cannot run them)."""
    from tests.support.replica import ClusterError, scratch_dir, start_pair

    where = "" if scratch_dir() else " (no room in /dev/shm: on disk, slower)"
    try:
        return start_pair(synchronous=True, max_connections=F.FAILOVER_CONNECTIONS)
    except ClusterError as exc:
        return (
            f"--database {F.FAILOVER_DATABASE}: cannot run a private PostgreSQL primary and "
            f"synchronous standby here{where}: {exc}"
        )


@contextlib.contextmanager
def _closing_pair(pair: Any) -> Iterator[None]:
    """Stop and remove ``pair`` (None: nothing) at exit."""
    try:
        yield
    finally:
        if pair is not None:
            pair.close()


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
