"""Every Celery control is as durable as the table: revoke, expires, Reject, cancel, a hard time
limit, a give-up and a duplicate end a leased job the same in the leases table, the result
backend and the errbacks, and it stays ended.

One bed of real processes per configuration, shared by the tests of this module (each test uses
jobs and queues of its own): two job workers (prefork, one pool process each) on the job queue,
a third worker on the reaper's queue and the plain tasks' queue (a chord's plain part and body,
``chord_unlock``), and a real ``celery beat`` sending ``celery_leases.reap`` every 0.5 s. A 2 s
lease renewed every 0.5 s, ``leases_reap_grace`` 1 s, ``leases_queued_timeout`` 1 s on the
workers, ``leases_max_attempts_without_progress`` 2. Jobs are sent from this process by a client
that leaves ``leases_queued_timeout`` off (the default), or by ``lost_client``, which sets it to
1 s like the workers (the jobs whose message is lost). A job that must wait unconsumed goes to a
queue of its own that no worker consumes until the test says so.

Configurations: PostgreSQL + Redis (Redis result backend), SQLite + the embedded
``filesystem://`` broker (Celery's SQLAlchemy result backend on an SQLite file), and PostgreSQL +
RabbitMQ (Redis result backend) for revoke and reject.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import pytest
from celery import Celery, chord
from celery.result import AsyncResult

from celery_leases import ArgumentsError, GaveUp, Job, get_job
from celery_leases.config import settings_for
from celery_leases.db.statements import GAVE_UP_NO_PROGRESS
from celery_leases.db.store import Store, store_for
from tests.support.apps.control_app import PARTIAL_ENV, add_control_tasks, call_log_for
from tests.support.apps.factory import app_env
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.apps.leased_app import unit_log_for
from tests.support.cli import migrate_table
from tests.support.scenario import Run, close_app, kill_all, runs_of, start_all, wait_for
from tests.support.service import (
    delete_rabbitmq_entities,
    drop_tables,
    private_redis_url,
    require,
    sqlite_result_backend,
)
from tests.support.unit_log import Unit
from tests.support.worker import REPO_ROOT, SHARED_LOGS, Beat, Spawner, Worker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

T = TypeVar("T")

CONTROL_APP = "tests.support.apps.control_app"
FINISHED = ("done", "failed", "cancelled", "revoked", "replaced")
#: Seconds to watch a job after it ended: six reaper passes, and more than a lease.
SETTLE = 3.0
#: Seconds the re-publish storm is watched.
STORM_WINDOW = 18.0

both = pytest.mark.parametrize(
    "bed", ["postgres-redis", "sqlite-filesystem"], indirect=True, scope="module"
)
with_rabbitmq = pytest.mark.parametrize(
    "bed",
    ["postgres-redis", "sqlite-filesystem", "postgres-rabbitmq"],
    indirect=True,
    scope="module",
)


# -- the bed -------------------------------------------------------------------------------------


@dataclass
class Bed:
    """The shared processes of one configuration, and clients configured like them."""

    kind: str
    spawner: Spawner
    env: dict[str, str]
    client: Celery
    lost_client: Celery
    queue: str
    workers: list[Worker] = field(default_factory=list)
    reaper: Worker | None = None
    beat: Beat | None = None
    queues: set[str] = field(default_factory=set)

    # -- processes ---------------------------------------------------------------------------

    def job_worker(self) -> Worker:
        return self.spawner.worker(CONTROL_APP, env=self.env, start=False, queues=[self.queue])

    def reaper_worker(self) -> Worker:
        return self.spawner.worker(
            CONTROL_APP,
            env=self.env,
            start=False,
            queues=[f"{self.queue}_reaper", f"{self.queue}_plain"],
            concurrency=2,
        )

    def start(self) -> None:
        self.workers = [self.job_worker(), self.job_worker()]
        self.reaper = self.reaper_worker()
        self.beat = self.spawner.beat(CONTROL_APP, env=self.env, start=False, max_interval=1)
        start_all([*self.workers, self.reaper, self.beat])

    def restart_workers(self) -> None:
        """Stop every worker (warm shutdown), then start new ones: nothing held in a worker's
        memory (its revoked list) survives."""
        old = [*self.workers, self.reaper]
        for worker in old:
            if worker is not None:
                worker.terminate()
        for worker in old:
            if worker is not None:
                worker.stop(timeout=15)
        self.workers = [self.job_worker(), self.job_worker()]
        self.reaper = self.reaper_worker()
        start_all([*self.workers, self.reaper])

    def ensure(self) -> None:
        """Before a test: no job of an earlier test still live, and every worker up."""
        store = self.store
        for job in store.list_jobs(states=["queued", "running"], limit=1000):
            if not store.cancel_queued(job.id):
                store.request_stop([job.id], "cancel")
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda: not store.list_jobs(states=["running"], limit=1),
                timeout=10,
                what="jobs of earlier tests to end",
            )
        dead = [w for w in self.workers if not w.is_alive()]
        fresh = [self.job_worker() for _ in dead]
        self.workers = [w for w in self.workers if w.is_alive()] + fresh
        if self.reaper is None or not self.reaper.is_alive():
            self.reaper = self.reaper_worker()
            fresh.append(self.reaper)
        if fresh:
            start_all(fresh)

    def node(self, worker: Worker) -> str:
        return worker.hostname.replace("%h", socket.gethostname())

    def consume(self, worker: Worker, queue: str) -> None:
        """Have ``worker`` start consuming ``queue``."""
        replies = self.client.control.add_consumer(
            queue, destination=[self.node(worker)], reply=True, timeout=10
        )
        assert replies, f"{worker.name} did not answer add_consumer({queue})"

    def stop_consuming(self, worker: Worker, queue: str) -> None:
        replies = self.client.control.cancel_consumer(
            queue, destination=[self.node(worker)], reply=True, timeout=10
        )
        assert replies, f"{worker.name} did not answer cancel_consumer({queue})"

    def worker_of(self, row: Unit) -> Worker:
        node = row.host.split("@")[0]
        for worker in self.workers:
            if worker.name == node:
                return worker
        raise AssertionError(f"no job worker named {node!r}")

    # -- jobs --------------------------------------------------------------------------------

    @property
    def store(self) -> Store:
        return store_for(settings_for(self.client))

    def idle_queue(self, purpose: str) -> str:
        """A queue of this test's own that no worker consumes (yet)."""
        name = f"{self.queue}_{purpose}_{uuid.uuid4().hex[:4]}"
        self.queues.add(name)
        return name

    def send(self, task: str, *args: Any, client: Celery | None = None, **options: Any) -> str:
        app = client or self.client
        return str(app.tasks[task].apply_async(args, **options).id)

    def job(self, job_id: str) -> Job:
        job = get_job(self.client, job_id)
        assert job is not None, f"job {job_id} is not recorded"
        return job

    def ended(self, job_id: str, state: str, timeout: float = 30) -> Job:
        """Wait for the job to finish; assert it finished ``state``."""

        def probe() -> Job | None:
            job = get_job(self.client, job_id)
            return job if job is not None and job.state in FINISHED else None

        job = self.wait(probe, timeout=timeout, what=f"job {job_id} to end", job_id=job_id)
        assert job.state == state, f"ended {job.state}, not {state}\n{self.evidence(job_id)}"
        return job

    def wait(self, probe: Callable[[], T | None], *, timeout: float, what: str, job_id: str) -> T:
        """``wait_for`` that adds the job's evidence when it times out."""
        try:
            return wait_for(probe, timeout=timeout, interval=0.05, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.evidence(job_id)}") from None

    def result(self, job_id: str) -> AsyncResult:
        return self.client.AsyncResult(job_id)

    def celery_state(self, job_id: str) -> str:
        return str(self.result(job_id).state)

    def becomes(self, probe: Callable[[], object], timeout: float = 15) -> bool:
        """Whether ``probe()`` turns truthy within ``timeout`` seconds."""
        try:
            wait_for(probe, timeout=timeout, interval=0.05)
        except AssertionError:
            return False
        return True

    def reaches(self, job_id: str, state: str, timeout: float = 15) -> AsyncResult:
        """Wait until the result backend holds ``state`` for the job."""
        self.wait(
            lambda: self.celery_state(job_id) == state,
            timeout=timeout,
            what=f"Celery state {state} for {job_id}",
            job_id=job_id,
        )
        return self.result(job_id)

    def runs(self, job_id: str) -> list[Run]:
        return runs_of(unit_log_for(self.client).rows(job_id))

    def wait_unit(self, job_id: str, unit: int, *, committed: bool = False) -> Unit:
        def probe() -> Unit | None:
            for row in reversed(unit_log_for(self.client).rows(job_id)):
                if row.unit >= unit and (row.committed or not committed):
                    return row
            return None

        return self.wait(probe, timeout=30, what=f"unit {unit} of {job_id}", job_id=job_id)

    def errbacks(self, job_id: str) -> list[str]:
        return [call.detail for call in call_log_for(self.client).rows(job_id, "errback")]

    def republished(self, job_id: str) -> int:
        """How many times a reaper re-published the job (its log lines)."""
        pattern = rf"job {re.escape(job_id)} \([^)]*\): lease expired"
        return len(re.findall(pattern, self.logs()))

    # -- the broker --------------------------------------------------------------------------

    def queue_length(self, queue: str) -> int:
        with self.client.connection_for_write() as connection:
            channel = connection.default_channel
            if connection.transport.driver_type == "amqp":
                return int(channel.queue_declare(queue, passive=True).message_count)
            return int(channel._size(queue))

    def purge(self, queue: str) -> None:
        with self.client.connection_for_write() as connection:
            connection.default_channel.queue_purge(queue)

    # -- the CLI and evidence ----------------------------------------------------------------

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("APP", "CELERY_APP", "NO_COLOR")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.update(self.env)
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", CONTROL_APP, "leases", *args],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def logs(self) -> str:
        return "\n".join(p.log_text() for p in self.spawner.processes)

    def evidence(self, job_id: str) -> str:
        """The job's row, its Celery state, its runs and every log line naming it."""
        job = get_job(self.client, job_id)
        row = (
            "no row"
            if job is None
            else f"state {job.state}, attempts {job.attempts}, token {job.token}, owner "
            f"{job.owner}, error {job.error!r}, result {job.result!r}, notify {job.notify}"
        )
        try:
            celery = f"{self.celery_state(job_id)} {self.result(job_id).result!r}"
        except Exception as exc:
            celery = f"unreadable: {exc!r}"
        runs = [
            (run.first.attempt, [u.unit for u in run.units], run.first.host)
            for run in self.runs(job_id)
        ]
        lines = [
            f"  {p.name}: {line}"
            for p in self.spawner.processes
            for line in p.log_text().splitlines()
            if job_id in line
        ]
        return (
            f"job {job_id}: row: {row}\n  Celery: {celery}\n  runs (attempt, units, host): "
            f"{runs}\n  log lines:\n" + "\n".join(lines[-40:])
        )

    def close(self) -> None:
        kill_all(self.spawner)
        self.spawner.stop_all(timeout=0)
        for app in (self.client, self.lost_client):
            consumer = getattr(app.backend, "result_consumer", None)
            if consumer is not None:
                with contextlib.suppress(Exception):
                    consumer.stop()
            close_app(app)
        unit_log_for(self.client).dispose()
        call_log_for(self.client).dispose()
        self.store.engine.dispose()


class Checks:
    """The independent checks of one test: every failed one is reported, together, at the end
    (``verify``), with the evidence of the jobs."""

    def __init__(self, bed: Bed) -> None:
        self.bed = bed
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        if not ok:
            self.failed.append(what)

    def verify(self, *job_ids: str) -> None:
        if self.failed:
            evidence = "\n".join(self.bed.evidence(job_id) for job_id in job_ids)
            failed = "\n  - ".join(self.failed)
            raise AssertionError(f"{len(self.failed)} check(s) failed:\n  - {failed}\n{evidence}")


def _filesystem_broker(root: Path) -> dict[str, Any]:
    folders = {name: root / "broker" / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir(parents=True)
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


@pytest.fixture(scope="module")
def bed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    queue = f"leases_q_{uuid.uuid4().hex[:8]}"
    table = f"leases_t_{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        if kind == "sqlite-filesystem":
            database = f"sqlite:///{root}/leases.sqlite3"
            broker = _filesystem_broker(root)
            backend = sqlite_result_backend(root / "results.sqlite3")
        else:
            database = require("postgres")
            stack.callback(drop_tables, database, table)
            backend = stack.enter_context(private_redis_url())
            if kind == "postgres-redis":
                broker = {"broker_url": backend}
            else:
                broker = {"broker_url": require("rabbitmq")}
        migrate_table(database, table)
        extra = {k: v for k, v in broker.items() if k != "broker_url"} | {
            "leases_reap_grace": 1.0,
            "task_routes": {
                "celery_leases.reap": {"queue": f"{queue}_reaper"},
                **{
                    name: {"queue": f"{queue}_plain"}
                    for name in ("controls.add", "controls.total", "celery.chord_unlock")
                },
            },
        }
        common = {
            "broker_url": broker["broker_url"],
            "database_url": database,
            "table": table,
            "result_backend": backend,
            "queue": queue,
            "lease_seconds": 2.0,
            "renew_seconds": 0.5,
            "max_no_progress": 2,
        }
        watched = extra | {"leases_queued_timeout": 1.0}
        env = app_env(extra=watched, reaper_every=0.5, **common)
        client = add_control_tasks(make_leased_app(app_env(extra=extra, **common), name="client"))
        lost_client = add_control_tasks(make_leased_app(env, name="lost-client"))
        unit_log_for(client).create()
        call_log_for(client).create()
        made = Bed(kind, Spawner(root / "logs"), env, client, lost_client, queue)
        made.queues |= {queue, f"{queue}_reaper", f"{queue}_plain"}
        if kind == "postgres-rabbitmq":
            control = f"{queue}_control"
            stack.callback(
                lambda: delete_rabbitmq_entities(
                    broker["broker_url"],
                    queues=sorted(made.queues),
                    exchanges=[
                        *sorted(made.queues),
                        f"{control}.pidbox",
                        f"reply.{control}.pidbox",
                    ],
                )
            )
        stack.callback(made.close)  # first: the processes go before what they use
        made.start()
        yield made


@pytest.fixture
def s(request: pytest.FixtureRequest, bed: Bed) -> Bed:
    """The bed, cleared of earlier tests' jobs, every worker up; a failed test's report shows
    the end of each of its processes' logs."""
    request.node.stash.setdefault(SHARED_LOGS, []).append(bed.spawner)
    bed.ensure()
    return bed


# -- 1. revoke -----------------------------------------------------------------------------------


@with_rabbitmq
def test_a_revoked_job_never_runs_again_after_the_workers_restart(s: Bed) -> None:
    # Given a leased job running on a worker
    job_id = s.send("e2e.units", 20, 0.25)
    s.wait_unit(job_id, 2)

    # When it is revoked with terminate=True
    with watching(lambda: s.job(job_id).state, interval=0.01) as states:
        s.result(job_id).revoke(terminate=True)
        job = s.ended(job_id, "revoked", timeout=15)

    # Then the table says revoked (never queued again on the way) and the result backend REVOKED
    check = Checks(s)
    check(
        "queued" not in states,
        f"the row went {' -> '.join(states)} after the revoke: handed back to be re-published",
    )
    check("terminated" in (job.error or ""), f"its error {job.error!r} does not say terminated")
    check(s.becomes(lambda: s.celery_state(job_id) == "REVOKED"), "the backend never said REVOKED")
    # and six reaper passes later (more than a lease) no reaper re-published it
    time.sleep(SETTLE)
    check(s.job(job_id).state == "revoked", f"{s.job(job_id).state} after six reaper passes")
    republished = s.republished(job_id)
    check(republished == 0, f"a reaper re-published the revoked job ({republished} time(s))")

    # When every worker is restarted (their in-memory revoked list is gone) and a copy of the
    # job's message reaches them (a broker redelivery, a reaper of an older version)
    s.restart_workers()
    s.job(job_id).message.send(s.client)
    dropped = f"job {job_id}: message dropped, the job is already revoked"
    check(s.becomes(lambda: dropped in s.logs()), "the copy was not dropped as revoked")
    time.sleep(SETTLE)

    # Then the job still did not run again: its body ran once, and it is revoked everywhere
    job = s.job(job_id)
    check((job.state, job.attempts) == ("revoked", 1), f"then {job.state}, {job.attempts} attempts")
    check(len(s.runs(job_id)) == 1, f"the body ran {len(s.runs(job_id))} times")
    check(s.celery_state(job_id) == "REVOKED", f"then Celery state {s.celery_state(job_id)}")
    check(s.republished(job_id) == republished, "a reaper re-published it after the restart")
    check.verify(job_id)


# -- 2. expires ----------------------------------------------------------------------------------


@both
def test_a_job_whose_expires_passed_while_it_waited_is_discarded_and_ends_revoked(s: Bed) -> None:
    # Given a job sent with expires=1 to a queue no worker consumes yet
    queue = s.idle_queue("expires")
    job_id = s.send("e2e.units", 2, 0.1, queue=queue, expires=1.0)
    time.sleep(1.5)

    # When a worker starts consuming that queue after the expiry
    worker = s.workers[0]
    s.consume(worker, queue)
    try:
        # Then the worker discards the message: the job ends revoked as expired, REVOKED in
        # the result backend, its body never ran
        job = s.ended(job_id, "revoked", timeout=15)
        assert job.error is not None and "expired" in job.error, s.evidence(job_id)
        s.reaches(job_id, "REVOKED")
        time.sleep(SETTLE)
        assert s.job(job_id).state == "revoked", s.evidence(job_id)
        assert s.runs(job_id) == [], s.evidence(job_id)
        assert s.celery_state(job_id) == "REVOKED", s.evidence(job_id)
    finally:
        s.stop_consuming(worker, queue)


@both
def test_a_lost_message_whose_expires_passed_is_ended_revoked_by_the_reaper(s: Bed) -> None:
    # Given a job sent with expires=0.8 and leases_queued_timeout 1 s to a queue no worker
    # consumes, and its message lost (the queue purged)
    queue = s.idle_queue("lost")
    job_id = s.send("e2e.units", 2, 0.1, queue=queue, expires=0.8, client=s.lost_client)
    s.purge(queue)
    assert s.queue_length(queue) == 0

    # When its queued timeout runs out (the reaper would re-publish it)
    job = s.ended(job_id, "revoked", timeout=15)

    # Then the reaper ended it revoked as expired instead, REVOKED in the result backend, and
    # published nothing
    assert job.error is not None and "expired" in job.error, s.evidence(job_id)
    s.reaches(job_id, "REVOKED")
    time.sleep(SETTLE)
    assert s.job(job_id).state == "revoked", s.evidence(job_id)
    assert s.queue_length(queue) == 0, s.evidence(job_id)
    assert s.republished(job_id) == 0, s.evidence(job_id)
    assert s.runs(job_id) == [], s.evidence(job_id)


# -- 3. Reject -----------------------------------------------------------------------------------


@with_rabbitmq
def test_a_job_that_rejects_its_message_for_good_ends_failed_and_never_runs_again(s: Bed) -> None:
    # Given a leased task that raises Reject(requeue=False)
    job_id = s.send("controls.reject", False)

    # When it runs
    job = s.ended(job_id, "failed")

    # Then the job is failed, FAILURE in the result backend
    assert job.error is not None and "Reject" in job.error, s.evidence(job_id)
    s.reaches(job_id, "FAILURE")
    # and several reaper passes later it did not run again
    time.sleep(SETTLE)
    job = s.job(job_id)
    assert (job.state, job.attempts) == ("failed", 1), s.evidence(job_id)
    assert len(s.runs(job_id)) == 1, s.evidence(job_id)
    assert s.republished(job_id) == 0, s.evidence(job_id)
    assert s.celery_state(job_id) == "FAILURE", s.evidence(job_id)


@with_rabbitmq
def test_a_job_that_rejects_with_requeue_without_acks_late_runs_again_and_ends_done(
    s: Bed,
) -> None:
    # Given a leased task (early ack) that raises Reject(requeue=True) on its first attempt
    job_id = s.send("controls.reject", True)

    # When it runs (the broker lost the message: it was acked when the attempt started)
    job = s.ended(job_id, "done")

    # Then the job ran again and ended done, SUCCESS with the second attempt's result
    assert (job.attempts, job.result) == (2, "accepted at attempt 2"), s.evidence(job_id)
    result = s.reaches(job_id, "SUCCESS")
    assert result.result == "accepted at attempt 2"
    assert len(s.runs(job_id)) == 2, s.evidence(job_id)


# -- 4. cancel -----------------------------------------------------------------------------------


@both
def test_a_cancelled_job_that_then_calls_retry_ends_cancelled_and_never_runs_to_done(
    s: Bed,
) -> None:
    # Given a running job whose task calls self.retry() as soon as it is asked to stop,
    # before its next checkpoint
    job_id = s.send("controls.retry_after_cancel", 4, 0.2)
    s.wait_unit(job_id, 0, committed=True)

    # When an operator cancels it with the CLI
    cancelled = s.cli("cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr

    # Then the retry does not run it again: the job ends cancelled, REVOKED in the result
    # backend (stored by the reaper)
    job = s.ended(job_id, "cancelled", timeout=20)
    s.reaches(job_id, "REVOKED")
    time.sleep(SETTLE)
    job = s.job(job_id)
    assert (job.state, job.attempts) == ("cancelled", 1), s.evidence(job_id)
    assert [[u.unit for u in run.units] for run in s.runs(job_id)] == [[0]], s.evidence(job_id)
    assert s.celery_state(job_id) == "REVOKED", s.evidence(job_id)


@both
def test_a_cancel_at_a_checkpoint_of_an_autoretry_task_ends_cancelled_not_retried(s: Bed) -> None:
    # Given a running job of a task with autoretry_for=(Exception,)
    job_id = s.send("controls.autoretry", 20, 0.25)
    s.wait_unit(job_id, 2)

    # When it is cancelled (Store.request_stop)
    assert s.store.request_stop([job_id], "cancel") == 1

    # Then Cancelled at its next checkpoint ends it cancelled, REVOKED, never retried
    job = s.ended(job_id, "cancelled", timeout=15)
    s.reaches(job_id, "REVOKED")
    time.sleep(SETTLE)
    job = s.job(job_id)
    assert (job.state, job.attempts) == ("cancelled", 1), s.evidence(job_id)
    assert len(s.runs(job_id)) == 1, s.evidence(job_id)
    assert not re.search(rf"controls\.autoretry\[{job_id}\] retry", s.logs()), s.evidence(job_id)
    assert s.celery_state(job_id) == "REVOKED", s.evidence(job_id)


@both
def test_a_warm_shutdown_while_a_cancel_is_pending_ends_the_job_cancelled_not_handed_off(
    s: Bed,
) -> None:
    # Given a running job whose next checkpoint is 1.5 s away, and a cancel pending on it
    job_id = s.send("e2e.units", 10, 1.5)
    holder = s.worker_of(s.wait_unit(job_id, 1))
    assert s.store.request_stop([job_id], "cancel") == 1

    # When its worker gets SIGTERM (a deploy's warm shutdown) before that checkpoint
    holder.signal(signal.SIGTERM)
    holder.wait(timeout=20)

    # Then the shutdown did not turn the cancel into a hand-off: the job ended cancelled,
    # REVOKED, and no other worker resumed it
    job = s.ended(job_id, "cancelled", timeout=15)
    s.reaches(job_id, "REVOKED")
    time.sleep(SETTLE)
    job = s.job(job_id)
    assert (job.state, job.attempts) == ("cancelled", 1), s.evidence(job_id)
    assert len(s.runs(job_id)) == 1, s.evidence(job_id)
    assert f"job {job_id}: handed back" not in holder.log_text(), s.evidence(job_id)
    assert s.celery_state(job_id) == "REVOKED", s.evidence(job_id)


# -- 5. hard time limit --------------------------------------------------------------------------


@both
def test_a_job_past_its_hard_time_limit_ends_failed_once_and_is_not_resumed(s: Bed) -> None:
    # Given a task with time_limit=2 that checkpoints every 0.5 s and would run 6 s, with an
    # errback; and a client watching its Celery state
    errback = s.client.tasks["controls.errback"]
    job_id = s.send("controls.timed", 12, 0.5, link_error=errback.s())
    with watching(lambda: s.celery_state(job_id), interval=0.1) as seen:
        # When it runs past the limit
        job = s.ended(job_id, "failed", timeout=20)

        # Then it is failed naming TimeLimitExceeded, FAILURE in the result backend,
        check = Checks(s)
        check("TimeLimitExceeded" in (job.error or ""), f"its error {job.error!r}")
        check(s.becomes(lambda: s.celery_state(job_id) == "FAILURE"), "no FAILURE in the backend")
        found = type(s.result(job_id).result).__name__
        check(found == "TimeLimitExceeded", f"the backend's exception is {found}")
        # its errback fired once, and it was not resumed (a lease and several reaper passes)
        time.sleep(SETTLE + 2.0)
    job = s.job(job_id)
    check((job.state, job.attempts) == ("failed", 1), f"then {job.state}, {job.attempts} attempts")
    check(len(s.runs(job_id)) == 1, f"the body ran {len(s.runs(job_id))} times")
    check(s.republished(job_id) == 0, f"re-published {s.republished(job_id)} time(s)")
    calls = s.errbacks(job_id)
    check(len(calls) == 1, f"the errback fired {len(calls)} times: {calls}")
    check("SUCCESS" not in seen, f"the client saw SUCCESS: states seen {seen}")
    check(seen[-1:] == ["FAILURE"], f"states seen by the client: {seen}")
    check.verify(job_id)


@contextlib.contextmanager
def watching(probe: Callable[[], str], *, interval: float) -> Iterator[list[str]]:
    """Record every change of ``probe()``, read each ``interval`` seconds, while the block runs."""
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                value = probe()
                if not seen or seen[-1] != value:
                    seen.append(value)
            stop.wait(interval)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        stop.set()
        watcher.join(10)


# -- 6. give-up and a queued cancel reach the client ---------------------------------------------


@both
def test_a_job_the_reaper_gives_up_on_fails_for_the_client_its_errback_and_its_chord(
    s: Bed,
) -> None:
    # Given a job that kills its own pool process before any checkpoint, with an errback, a
    # client blocked in get() on it, and a chord whose header holds another such job
    t = s.client.tasks
    job_id = s.send("e2e.poison", link_error=t["controls.errback"].s())
    got: list[Any] = []
    getter = threading.Thread(target=_get_into, args=(s.result(job_id), got), daemon=True)
    getter.start()
    part_id = f"chord-part-{uuid.uuid4().hex[:8]}"
    chord_result = chord([t["e2e.poison"].s().set(task_id=part_id), t["controls.add"].s(1, 2)])(
        t["controls.total"].s()
    )
    chord_got: list[Any] = []
    chord_getter = threading.Thread(target=_get_into, args=(chord_result, chord_got), daemon=True)
    chord_getter.start()

    # When both die on their first two attempts (leases_max_attempts_without_progress = 2)
    job = s.ended(job_id, "failed", timeout=40)

    # Then the reaper gave up: the row says why, the result backend holds FAILURE with GaveUp,
    check = Checks(s)
    check((job.error, job.attempts) == (GAVE_UP_NO_PROGRESS, 2), f"{job.error!r}, {job.attempts}")
    check(s.becomes(lambda: s.celery_state(job_id) == "FAILURE"), "no FAILURE in the backend")
    found = s.result(job_id).result
    check(isinstance(found, GaveUp), f"the backend's exception is {found!r}, not GaveUp")
    # the client's get() raised it instead of waiting forever,
    getter.join(15)
    check(len(got) == 1 and isinstance(got[0], GaveUp), f"the client's get() gave {got}")
    # its errback fired once,
    s.becomes(lambda: s.errbacks(job_id), timeout=10)
    # and the chord whose header holds the other one failed
    part = s.ended(part_id, "failed", timeout=30)
    check(part.error == GAVE_UP_NO_PROGRESS, f"the chord part's error is {part.error!r}")
    chord_getter.join(20)
    check(
        len(chord_got) == 1 and isinstance(chord_got[0], Exception),
        f"the chord's get() gave {chord_got}",
    )
    time.sleep(SETTLE)
    calls = s.errbacks(job_id)
    check(len(calls) == 1, f"the errback fired {len(calls)} times: {calls}")
    check(all("GaveUp" in call for call in calls), f"the errback was told {calls}")
    check(s.job(job_id).state == "failed", f"then {s.job(job_id).state}")
    check.verify(job_id, part_id)


def _get_into(result: AsyncResult, out: list[Any]) -> None:
    try:
        out.append(result.get(timeout=45, interval=0.2))
    except Exception as exc:
        out.append(exc)


@both
def test_a_queued_job_cancelled_with_the_cli_is_revoked_for_the_client_and_never_runs(
    s: Bed,
) -> None:
    # Given a job waiting in a queue no worker consumes
    queue = s.idle_queue("queued")
    job_id = s.send("e2e.units", 2, 0.1, queue=queue)

    # When an operator cancels it with the CLI
    cancelled = s.cli("cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr

    # Then it is cancelled, and REVOKED in the result backend (stored by the reaper)
    job = s.ended(job_id, "cancelled", timeout=5)
    s.reaches(job_id, "REVOKED")
    # and when a worker consumes the queue, the message is dropped: the body never runs
    worker = s.workers[0]
    s.consume(worker, queue)
    try:
        s.wait(
            lambda: f"job {job_id}: message dropped, the job is already cancelled" in s.logs(),
            timeout=15,
            what="the message to be dropped",
            job_id=job_id,
        )
    finally:
        s.stop_consuming(worker, queue)
    job = s.job(job_id)
    assert (job.state, job.attempts) == ("cancelled", 0), s.evidence(job_id)
    assert s.runs(job_id) == [], s.evidence(job_id)
    assert s.celery_state(job_id) == "REVOKED", s.evidence(job_id)


# -- 7. a duplicate on a worker that does not know the task --------------------------------------


@both
def test_a_duplicate_delivered_to_a_worker_that_does_not_know_the_task_kills_no_healthy_job(
    s: Bed,
) -> None:
    # Given a worker B of another deployment (its app lacks e2e.units), waiting on a standby
    # queue, and a job running on worker A from a queue of its own
    standby = s.idle_queue("standby")
    b = s.spawner.worker(CONTROL_APP, env=s.env | {PARTIAL_ENV: "1"}, queues=[standby])
    queue = s.idle_queue("dup")
    a = s.workers[0]
    s.consume(a, queue)
    try:
        job_id = s.send("e2e.units", 20, 0.25, queue=queue)
        s.wait_unit(job_id, 1)

        # When A takes no more from that queue, B consumes it, and a duplicate of the job's
        # message is delivered there
        s.stop_consuming(a, queue)
        s.consume(b, queue)
        s.job(job_id).message.send(s.client)
        b.wait_for_log(r"Received unregistered task of type '?e2e\.units'?", timeout=15)

        # Then the running job still ends done, at its first attempt, and SUCCESS is its final
        # Celery state (B's consumer stores FAILURE NotRegistered for the id before any signal;
        # the attempt's SUCCESS replaces it)
        job = s.ended(job_id, "done", timeout=30)
        assert (job.attempts, job.result) == (1, 20), s.evidence(job_id)
        assert len(s.runs(job_id)) == 1, s.evidence(job_id)
        assert s.reaches(job_id, "SUCCESS").result == 20
    finally:
        with contextlib.suppress(Exception):
            s.stop_consuming(a, queue)
        b.kill()
        b.wait(timeout=10)


# -- 8. re-publish storm -------------------------------------------------------------------------


@both
def test_a_job_waiting_with_no_worker_is_republished_with_doubling_waits(s: Bed) -> None:
    # Given leases_queued_timeout 1 s, leases_reap_grace 1 s, the reaper every 0.5 s, and a
    # job in a queue no worker consumes
    queue = s.idle_queue("storm")
    job_id = s.send("e2e.units", 2, 0.1, queue=queue, client=s.lost_client)
    sent = time.monotonic()

    # When the reaper has seen it waiting for 18 s (36 passes)
    grew: list[float] = [0.0]
    copies = 1
    while time.monotonic() - sent < STORM_WINDOW:
        length = s.queue_length(queue)
        if length > copies:
            grew += [time.monotonic() - sent] * (length - copies)
            copies = length
        time.sleep(0.1)
    s.store.cancel_queued(job_id)
    # A pass that marked the job just before the cancel still sends its copy: count after it.
    time.sleep(1.5)
    republished = s.republished(job_id)

    # Then it re-published a handful of copies, not one a pass: each wait doubled (1, 2, 4,
    # 8 x grace)
    gaps = [round(b - a, 2) for a, b in pairwise(grew[1:])]  # from the first re-publish on
    report = f"{republished} re-published; copies at {grew} s; gaps {gaps}\n{s.evidence(job_id)}"
    assert s.queue_length(queue) == 1 + republished, report
    assert 3 <= republished <= 6, report
    assert all(b >= a - 0.3 for a, b in pairwise(gaps)), report
    assert gaps[-1] >= 3.5, report
    s.purge(queue)


# -- 10. an id the table cannot hold, claimed by a worker -----------------------------------------


@pytest.mark.parametrize("database_url", ["postgres", "mariadb", "sqlite"], indirect=True)
def test_a_message_sent_by_name_with_an_id_too_long_for_the_table_fails_once(
    spawn: Spawner,
    database_url: str,
    table_name: str,
    filesystem_broker: dict[str, Any],
    queue_name: str,
    tmp_path: Path,
) -> None:
    # Given a worker (no reaper), and two messages sent by name: ids of 156 and 155 characters
    extra = {k: v for k, v in filesystem_broker.items() if k != "broker_url"}
    extra["broker_transport_options"] = extra["broker_transport_options"] | {
        "polling_interval": 0.1
    }
    env = app_env(
        broker_url="filesystem://",
        database_url=database_url,
        table=table_name,
        result_backend=sqlite_result_backend(tmp_path / "results.sqlite3"),
        queue=queue_name,
        extra=extra,
    )
    client = make_leased_app(env, name="client")
    unit_log_for(client).create()
    worker = spawn.worker(CONTROL_APP, env=env)
    try:
        too_long, longest = "L" * 156, "K" * 155

        # When the worker receives them
        client.send_task("e2e.units", args=(1, 0.05), task_id=too_long)
        client.send_task("e2e.units", args=(1, 0.05), task_id=longest)

        # Then the 155-character job runs and is recorded whole
        assert client.AsyncResult(longest).get(timeout=30, interval=0.1) == 1
        job = get_job(client, longest)
        assert job is not None and (job.id, job.state) == (longest, "done"), job
        # and the 156-character one fails once with ArgumentsError naming the limit
        failure = client.AsyncResult(too_long)
        wait_for(lambda: failure.state == "FAILURE", timeout=15, what="FAILURE of the long id")
        assert isinstance(failure.result, ArgumentsError), failure.result
        assert "155" in str(failure.result), failure.result
        time.sleep(2.0)
        received = re.findall(rf"Task e2e\.units\[{too_long}\] received", worker.log_text())
        assert len(received) == 1, worker.log_tail(40)
        assert client.AsyncResult(too_long).state == "FAILURE"
        with client.connection_for_write() as connection:
            assert connection.default_channel._size(queue_name) == 0
        assert get_job(client, too_long) is None
    finally:
        close_app(client)
        unit_log_for(client).dispose()
        store_for(settings_for(client)).engine.dispose()
