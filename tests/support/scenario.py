"""Helpers for the end-to-end tests (and ``bench/recovery.py``): a scenario of real workers
running ``tests/support/apps/leased_app.py``, and the checks the unit log must pass.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, TypeVar

from celery import Celery

from celery_leases import Job, get_job
from celery_leases.config import settings_for
from celery_leases.db.store import Store, store_for
from tests.support.apps.factory import app_env
from tests.support.apps.leased_app import make_app, unit_log_for
from tests.support.service import close_app
from tests.support.unit_log import Unit, UnitLog
from tests.support.worker import REPO_ROOT, Beat, CeleryProcess, Spawner, Worker, pid_exists

LEASED_APP = "tests.support.apps.leased_app"
FINISHED = ("done", "failed", "cancelled", "superseded")

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T | None], *, timeout: float, interval: float = 0.05, what: str = ""
) -> T:
    """Call ``probe`` until it returns something truthy (returned); AssertionError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or probe}")
        time.sleep(interval)


def start_all(processes: Iterable[CeleryProcess], timeout: float = 30) -> None:
    """Start processes in parallel and wait until each is ready (seconds)."""
    processes = list(processes)
    with ThreadPoolExecutor(len(processes)) as pool:
        for future in [pool.submit(p.start, timeout) for p in processes]:
            future.result()


def freeze(process: CeleryProcess) -> None:
    """SIGSTOP the whole worker (main process and pool: its process group), like a frozen host."""
    os.killpg(process.pid, signal.SIGSTOP)


def thaw(process: CeleryProcess) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGCONT)


@dataclass
class Scenario:
    """Workers of ``tests.support.apps.leased_app`` sharing one environment, a client app configured
    the same way in this process, and the unit log."""

    spawn: Spawner
    env: dict[str, str]
    app: Celery = field(init=False)
    log: UnitLog = field(init=False)
    workers: list[Worker] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.app = make_app(self.env, name="client")
        self.log = unit_log_for(self.app).create()

    @classmethod
    def create(
        cls,
        spawn: Spawner,
        *,
        broker: Mapping[str, Any],
        database_url: str,
        table: str,
        **options: Any,
    ) -> Scenario:
        """``broker``: Celery settings with at least ``broker_url`` (e.g. the ``celery_settings``
        or ``filesystem_broker`` fixture); ``options``: keywords of ``factory.app_env``."""
        extra = {k: v for k, v in broker.items() if k != "broker_url"}
        env = app_env(
            broker_url=broker["broker_url"],
            database_url=database_url,
            table=table,
            extra=extra,
            **options,
        )
        return cls(spawn, env)

    @property
    def store(self) -> Store:
        return store_for(settings_for(self.app))

    def start_workers(self, count: int = 1, **options: Any) -> list[Worker]:
        workers = [
            self.spawn.worker(LEASED_APP, env=self.env, start=False, **options)
            for _ in range(count)
        ]
        start_all(workers)
        self.workers += workers
        return workers

    def start_beat(self) -> Beat:
        """A real ``celery beat`` sending ``celery_leases.reap`` (needs ``reaper_every``)."""
        assert "E2E_REAPER_EVERY" in self.env, "set reaper_every to schedule the reaper"
        return self.spawn.beat(LEASED_APP, env=self.env, max_interval=1)

    def send(self, task: str, *args: Any, **options: Any) -> str:
        """Publish ``task`` through its LeasedTask (so the job is recorded); return the id."""
        return str(self.app.tasks[task].apply_async(args, **options).id)

    def job(self, job_id: str) -> Job:
        job = get_job(self.app, job_id)
        assert job is not None, f"job {job_id} is not recorded"
        return job

    def wait_finished(self, job_id: str, timeout: float) -> Job:
        def finished() -> Job | None:
            job = get_job(self.app, job_id)
            return job if job is not None and job.state in FINISHED else None

        return wait_for(
            finished,
            timeout=timeout,
            interval=0.1,
            what=f"job {job_id} to finish ({self._job_line(job_id)})",
        )

    def wait_unit(
        self, job_id: str, *, unit: int, timeout: float, run_other_than: str | None = None
    ) -> Unit:
        """Wait until a unit >= ``unit`` has started (in a run other than ``run_other_than``)."""

        def probe() -> Unit | None:
            for row in reversed(self.log.rows(job_id)):
                if row.unit >= unit and row.run != run_other_than:
                    return row
            return None

        return wait_for(probe, timeout=timeout, interval=0.02, what=f"unit {unit} of {job_id}")

    def worker_of(self, row: Unit) -> Worker:
        """The worker whose pool ran ``row``."""
        node = row.host.split("@")[0]
        for worker in self.workers:
            if worker.name == node:
                return worker
        raise AssertionError(f"no worker named {node!r} in this scenario")

    def logs(self) -> str:
        return "\n".join(p.log_text() for p in self.spawn.processes)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``celery -A tests.support.apps.leased_app leases <args>`` with the workers'
        settings, as an operator would."""
        env = {k: v for k, v in os.environ.items() if k not in ("APP", "CELERY_APP", "NO_COLOR")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.update(self.env)
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", LEASED_APP, "leases", *args],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def thaw_all(self) -> None:
        for process in self.spawn.processes:
            if process.is_alive():
                thaw(process)

    def close(self) -> None:
        close_app(self.app)
        self.log.dispose()
        with contextlib.suppress(Exception):
            self.store.engine.dispose()

    def _job_line(self, job_id: str) -> str:
        job = get_job(self.app, job_id)
        if job is None:
            return "not recorded"
        return f"state {job.state}, attempts {job.attempts}, owner {job.owner}, error {job.error}"


def kill_all(spawner: Spawner) -> None:
    """SIGKILL every process ``spawner`` started (each one's whole process group), and reap."""
    for process in spawner.processes:
        if process.process is not None and process.is_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
    for process in spawner.processes:
        if process.process is not None:
            with contextlib.suppress(Exception):
                process.wait(timeout=5)


# -- unit log checks -------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """The units one execution of the task body started, in order."""

    id: str
    units: list[Unit]

    @property
    def first(self) -> Unit:
        return self.units[0]

    @property
    def committed(self) -> list[Unit]:
        return [u for u in self.units if u.committed]


def runs_of(rows: list[Unit]) -> list[Run]:
    """Group unit rows by run, runs in the order they started."""
    grouped: dict[str, list[Unit]] = {}
    for row in sorted(rows, key=lambda r: r.started_at):
        grouped.setdefault(row.run, []).append(row)
    return [Run(run, units) for run, units in grouped.items()]


def check_unit_log(rows: list[Unit], count: int, *, crashes: int) -> list[Run]:
    """Assert what every crash test promises, and return the runs:

    - every unit 0..count-1 was committed exactly once;
    - units started more than once (redone) are at most one per crash: the one in progress;
    - each run after the first starts at the unit after the last committed one;
    - no two runs ran committed units at the same time, and a run commits nothing once a
      later run has started (a stale attempt writes nothing).
    """
    table = "\n".join(
        f"  unit {r.unit:2} run {r.run[:6]} attempt {r.attempt} pid {r.pid} {r.host} "
        f"{r.started_at:.3f}-{'...' if r.ended_at is None else f'{r.ended_at:.3f}'}"
        for r in rows
    )
    committed = sorted((r for r in rows if r.committed), key=lambda r: r.started_at)
    assert sorted(r.unit for r in committed) == list(range(count)), (
        f"units not committed exactly once:\n{table}"
    )
    redone = {unit: n - 1 for unit, n in Counter(r.unit for r in rows).items() if n > 1}
    assert sum(redone.values()) <= crashes, f"redone {redone} after {crashes} crash(es):\n{table}"
    runs = runs_of(rows)
    for earlier, later in pairwise(runs):
        done_before = sum(len(r.committed) for r in runs[: runs.index(later)])
        assert later.first.unit == done_before, f"run {later.id[:6]} did not resume:\n{table}"
        assert all(
            u.ended_at is not None and u.ended_at <= later.first.started_at
            for u in earlier.committed
        ), f"run {earlier.id[:6]} committed after run {later.id[:6]} started:\n{table}"
    for a, b in pairwise(committed):
        assert a.ended_at is not None and b.started_at >= a.ended_at, (
            f"units {a.unit} and {b.unit} overlap:\n{table}"
        )
    return runs


def resume_delay(rows: list[Unit], crashed_at: float) -> float:
    """Seconds from ``crashed_at`` (epoch) to the first unit of the first run started after it."""
    later = [run for run in runs_of(rows) if run.first.started_at > crashed_at]
    assert later, "no run started after the crash"
    return later[0].first.started_at - crashed_at


def wait_gone(pid: int, timeout: float = 5) -> None:
    wait_for(lambda: not pid_exists(pid), timeout=timeout, what=f"pid {pid} to exit")
