"""Issue 3 end to end: crashed, frozen and lost jobs come back through the reaper.

Real prefork workers (two, ``-c 1`` each) and a real ``celery beat`` sending
``celery_leases.reap`` every second; default (early) acks unless a test says otherwise; a 2 s
lease. Redis and RabbitMQ with a PostgreSQL store, and the embedded ``filesystem://`` broker
with an SQLite store.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import celery_leases
from celery_leases import Job
from celery_leases.db.statements import GAVE_UP_NO_PROGRESS
from celery_leases.settings import DEFAULTS
from tests.support.scenario import Run, Scenario, check_unit_log, freeze, thaw, wait_for
from tests.support.unit_log import Unit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MakeScenario = Callable[..., Scenario]

postgres = pytest.mark.parametrize("database_url", ["postgres"], indirect=True)

UNITS = 16
UNIT_SECONDS = 0.25
CRASH_AT_UNIT = 5


def with_reaper(scenario: MakeScenario, broker: dict[str, Any], **options: Any) -> Scenario:
    """Two workers and a beat reaping every second; a 2 s lease unless ``options`` say.
    ``result_backend=`` makes ``crash_and_resume`` check ``AsyncResult(id).get()`` too."""
    settings: dict[str, Any] = {"lease_seconds": 2.0, "renew_seconds": 0.5, "reaper_every": 1.0}
    s = scenario(broker, **(settings | options))
    s.start_workers(2)
    s.start_beat()
    return s


def crash_and_resume(
    s: Scenario, job_id: str, *, crash: Callable[[Unit], None]
) -> tuple[Job, list[Run], Unit]:
    """Run a 16-unit job, ``crash(row)`` during unit 5, wait for the job to end, and check it
    resumed once, from the unit in progress. Returns (job, runs, the row of that unit)."""
    job_id = s.send("e2e.units", UNITS, UNIT_SECONDS, task_id=job_id)
    waited: list[Any] = []
    waiter = None
    if "E2E_RESULT_BACKEND" in s.env:
        # A client already blocked in get() when the crash happens gets the final result too.
        waiter = threading.Thread(target=_get_into, args=(s, job_id, waited), daemon=True)
        waiter.start()
    row = s.wait_unit(job_id, unit=CRASH_AT_UNIT, timeout=30)
    crash(row)
    job = s.wait_finished(job_id, timeout=40)
    if waiter is not None:
        waiter.join(timeout=15)
        assert waited == [UNITS], waited
    assert (job.state, job.result, job.attempts) == ("done", UNITS, 2), job
    runs = check_unit_log(s.log.rows(job_id), UNITS, crashes=1)
    assert len(runs) == 2
    assert runs[1].first.unit == row.unit  # resumed at the unit in progress, none before
    if "E2E_RESULT_BACKEND" in s.env:
        assert s.app.AsyncResult(job_id).get(timeout=10) == UNITS  # same id, final result
    return job, runs, row


def _get_into(s: Scenario, job_id: str, out: list[Any]) -> None:
    try:
        out.append(s.app.AsyncResult(job_id).get(timeout=40))
    except Exception as exc:
        out.append(exc)


@postgres
def test_a_job_whose_pool_process_was_killed_resumes_from_its_last_checkpoint(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given two workers, early ack, a lease longer than billiard takes to notice a dead pool
    # process (its maintain_pool timer, 5 s), and no reaper pass during the test
    s = with_reaper(
        scenario,
        celery_settings,
        result_backend=result_backend,
        lease_seconds=8.0,
        reaper_every=300.0,
    )

    # When the pool process running the job is SIGKILLed during unit 5
    def kill_pool_process(row: Unit) -> None:
        os.kill(row.pid, signal.SIGKILL)

    # Then a worker resumes it from its last checkpoint, sent again by the main process of
    # the worker that saw its pool process die (no need to wait for the lease and the reaper)
    job_id = f"pool-{os.urandom(4).hex()}"
    crash_and_resume(s, job_id, crash=kill_pool_process)
    assert f"job {job_id}: pool process" in s.logs()
    # by the main process's watch over its pool, the moment the process died (billiard's own
    # report comes up to 5 s later)
    assert "died (seen at once); sent again to resume from its checkpoint" in s.logs()
    assert "re-published" not in s.logs()


@postgres
def test_a_dead_pool_process_noticed_after_its_job_resumed_elsewhere_changes_nothing(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given two workers, early ack, a beat reaping every second, a 2 s lease, a running job
    s = with_reaper(scenario, celery_settings, result_backend=result_backend)
    job_id = s.send("e2e.units", UNITS, UNIT_SECONDS, task_id=f"late-{os.urandom(4).hex()}")
    row = s.wait_unit(job_id, unit=CRASH_AT_UNIT, timeout=30)
    slow = s.worker_of(row)

    # When its pool process is SIGKILLed while its main process is stopped, and the main
    # process wakes up only after the reaper sent the job to the other worker
    slow.signal(signal.SIGSTOP)
    try:
        os.kill(row.pid, signal.SIGKILL)
        s.wait_unit(job_id, unit=CRASH_AT_UNIT + 1, run_other_than=row.run, timeout=30)
    finally:
        slow.signal(signal.SIGCONT)
    slow.wait_for_log(rf"job {job_id}: pool process \d+ died; the job lives on", timeout=15)

    # Then the late worker neither retries it nor records anything: the job ends once, with
    # its result, and Celery never saw a retry
    job = s.wait_finished(job_id, timeout=40)
    assert (job.state, job.result, job.attempts) == ("done", UNITS, 2), job
    assert s.app.AsyncResult(job_id).get(timeout=10) == UNITS
    assert s.app.AsyncResult(job_id).state == "SUCCESS"
    assert "retry: Retry in" not in s.logs()
    check_unit_log(s.log.rows(job_id), UNITS, crashes=1)


@postgres
def test_a_job_whose_whole_worker_was_killed_resumes_on_the_other_worker(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given two workers, early ack, a beat reaping every second
    s = with_reaper(scenario, celery_settings, result_backend=result_backend)

    # When the whole worker running the job (main process and pool) is SIGKILLed during unit 5
    def kill_worker(row: Unit) -> None:
        s.worker_of(row).kill()

    # Then the other worker resumes it from its last checkpoint
    _, runs, row = crash_and_resume(s, f"whole-{os.urandom(4).hex()}", crash=kill_worker)
    assert s.worker_of(runs[1].first) is not s.worker_of(row)


@pytest.mark.parametrize("database_url", ["postgres", "mariadb", "sqlite"], indirect=True)
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_killed_workers_job_resumes_at_the_next_reaper_pass_not_at_its_lease_expiry(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers, early ack, a beat reaping every second, and a 10-minute lease
    s = with_reaper(scenario, celery_settings, lease_seconds=600.0, renew_seconds=200.0)

    # When the whole worker running the job is SIGKILLed during unit 5
    def kill_worker(row: Unit) -> None:
        s.worker_of(row).kill()

    # Then the reaper sees its holder's database session gone and the other worker resumes it
    # from its last checkpoint, long before the lease would have expired
    job_id = f"bound-{os.urandom(4).hex()}"
    _, runs, row = crash_and_resume(s, job_id, crash=kill_worker)
    assert s.worker_of(runs[1].first) is not s.worker_of(row)
    logs = s.logs()
    assert f"job {job_id}: its holder's database session is gone" in logs

    # And of Celery's lines about reaper passes (one a second), only the success of a pass
    # that acted is left at INFO: no "received", no beat "Sending due task", no idle success
    succeeded = re.findall(r"Task celery_leases\.reap\[[^\]]+\] succeeded in [^:]+: (.*)", logs)
    assert succeeded, "no pass that acted logged its success"
    assert not any(_idle_report(line) for line in succeeded), succeeded
    assert not re.search(r"Task celery_leases\.reap\[[^\]]+\] received", logs)
    assert "(celery_leases.reap)" not in logs
    # and the library's lines outside a task carry no task prefix Celery cannot fill
    assert "???[???]" not in logs


def _idle_report(line: str) -> bool:
    """A reaper pass's report (its repr, as Celery logs it) that says it did nothing."""
    return line.count(": []") == line.count(": [") and "'purged': 0" in line


@pytest.mark.parametrize("database_url", ["pgbouncer"], indirect=True)
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_behind_pgbouncer_a_killed_workers_job_resumes_when_its_lease_expires(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers and a beat whose leases database is reached through PgBouncer in
    # transaction mode, where no session is the holder's own; a 2 s lease
    s = with_reaper(scenario, celery_settings)
    killed: list[float] = []

    # When the whole worker running a job is SIGKILLed during unit 5
    def kill_worker(row: Unit) -> None:
        killed.append(s.log.now())
        s.worker_of(row).kill()

    # Then the workers saw the pooler and bound nothing, and the job resumed from its last
    # checkpoint once its lease expired (not earlier, through a session seen gone)
    job_id = f"pooled-{os.urandom(4).hex()}"
    _, runs, _ = crash_and_resume(s, job_id, crash=kill_worker)
    logs = s.logs()
    assert "sits between this process and PostgreSQL" in logs
    assert "database session is gone" not in logs
    assert runs[1].first.started_at - killed[0] > 1.0  # the lease's end, not a reaper pass


@postgres
def test_a_frozen_worker_job_moves_and_the_woken_attempt_writes_nothing(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers, early ack, a beat reaping every second, and a running job
    s = with_reaper(scenario, celery_settings)
    job_id = s.send("e2e.units", UNITS, UNIT_SECONDS)
    row = s.wait_unit(job_id, unit=CRASH_AT_UNIT, timeout=30)
    frozen = s.worker_of(row)

    # When its whole worker is frozen (SIGSTOP, TCP left open) until the job resumed elsewhere,
    # then woken (SIGCONT)
    freeze(frozen)
    try:
        moved = s.wait_unit(job_id, unit=0, run_other_than=row.run, timeout=30)
    finally:
        thaw(frozen)
    frozen.wait_for_log(
        rf"job {job_id}: attempt with token {row.token} stopped, lease lost", timeout=10
    )

    # Then the job resumed on the other worker, and the woken attempt wrote nothing: its unit
    # in progress stays uncommitted, and it started no other
    job = s.wait_finished(job_id, timeout=40)
    assert (job.state, job.result, job.attempts) == ("done", UNITS, 2), job
    rows = s.log.rows(job_id)
    runs = check_unit_log(rows, UNITS, crashes=1)
    assert len(runs) == 2
    stale, resumed = runs
    assert s.worker_of(resumed.first) is not frozen and s.worker_of(moved) is not frozen
    assert stale.units[-1] == row and not row.committed
    assert resumed.first.unit == row.unit
    assert "lease lost on job" in frozen.log_text()


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_worker_frozen_inside_a_transactional_checkpoint_loses_its_job_within_its_lease(
    scenario: MakeScenario, celery_settings: dict[str, Any], tmp_path: Path
) -> None:
    # Given two workers, a 2 s lease, a beat reaping every second, and a job whose unit 5
    # transaction lingers after its checkpoint statement (the job's row is locked until commit)
    s = with_reaper(scenario, celery_settings)
    in_transaction = tmp_path / "unit-5-in-transaction"
    job_id = s.send("e2e.units", UNITS, UNIT_SECONDS, CRASH_AT_UNIT, str(in_transaction))
    wait_for(in_transaction.exists, timeout=30, what="unit 5's checkpoint in its transaction")
    row = s.wait_unit(job_id, unit=CRASH_AT_UNIT, timeout=5)
    frozen = s.worker_of(row)

    # When the whole worker is frozen there, before the commit, and woken only once the job
    # has moved
    frozen_at = s.log.now()
    freeze(frozen)
    try:
        moved = s.wait_unit(job_id, unit=0, run_other_than=row.run, timeout=30)
    finally:
        thaw(frozen)

    # Then the database ended the idle transaction after about a lease (freeing the row), the
    # reaper re-published the job and the other worker resumed it at unit 5: within lease +
    # reaper interval + a few seconds, not when the frozen worker wakes
    delay = moved.started_at - frozen_at
    print(f"frozen inside a transactional checkpoint to resumed: {delay:.2f} s")
    assert delay < 2.0 + 1.0 + 4.0
    job = s.wait_finished(job_id, timeout=40)
    assert (job.state, job.result, job.attempts) == ("done", UNITS, 2), job
    stale, resumed = check_unit_log(s.log.rows(job_id), UNITS, crashes=1)
    assert stale.units[-1] == row and not row.committed  # its transaction never committed
    assert resumed.first.unit == CRASH_AT_UNIT and s.worker_of(resumed.first) is not frozen


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_transaction_the_database_ended_for_idling_past_the_lease_is_resumed_not_failed(
    scenario: MakeScenario, celery_settings: dict[str, Any], tmp_path: Path
) -> None:
    # Given one worker, a beat reaping every second, a 2 s lease, and a job whose unit 5
    # transaction waits 3 s between its checkpoint and its commit (a slow step the task put
    # inside its transaction)
    s = scenario(celery_settings, lease_seconds=2.0, renew_seconds=0.5, reaper_every=1.0)
    (worker,) = s.start_workers(1)
    s.start_beat()
    in_transaction = tmp_path / "unit-5-in-transaction"
    job_id = s.send("e2e.units", UNITS, UNIT_SECONDS, CRASH_AT_UNIT, str(in_transaction))

    # When the database ends that transaction after the lease's length, and the commit fails
    job = s.wait_finished(job_id, timeout=40)

    # Then the job is not failed by it: the attempt ended as a crash would, and once its
    # lease expired the job resumed from the last committed checkpoint, unit 5, whose first
    # try left nothing committed
    assert (job.state, job.result, job.attempts) == ("done", UNITS, 2), job
    stale, resumed = check_unit_log(s.log.rows(job_id), UNITS, crashes=1)
    assert not stale.units[-1].committed and stale.units[-1].unit == CRASH_AT_UNIT
    assert resumed.first.unit == CRASH_AT_UNIT
    assert "sat idle longer than the lease (2 s) and the database ended it" in worker.log_text()


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
@postgres
def test_acks_late_on_redis_with_a_short_visibility_timeout_never_runs_a_job_twice_at_once(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given acks_late on Redis with a 3 s visibility timeout (unacked messages restored every
    # second), two workers and the reaper
    s = with_reaper(
        scenario, celery_settings, acks_late=True, visibility_timeout=3, restore_interval=1
    )

    # When a 10 s job runs
    job_id = s.send("e2e.units", 40, UNIT_SECONDS)
    job = s.wait_finished(job_id, timeout=40)

    # Then Redis delivered it again while it ran, the claim dropped the copies, and the body
    # ran once
    assert (job.state, job.result, job.attempts) == ("done", 40, 1), job
    logs = s.logs()
    assert f"job {job_id}: redelivered while a lease still holds it" in logs
    assert f"job {job_id}: message dropped, a live lease holds it" in logs
    runs = check_unit_log(s.log.rows(job_id), 40, crashes=0)
    assert len(runs) == 1


@pytest.mark.parametrize("database_url", ["postgres", "sqlite"], indirect=True)
def test_two_reapers_at_once_republish_an_expired_job_once(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given five jobs whose worker died holding their lease (claimed, then expired), and their
    # original messages still queued
    s = scenario(celery_settings, lease_seconds=2.0)
    jobs = [s.send("e2e.units", 2, 0.05) for _ in range(5)]
    for job_id in jobs:
        claimed = s.store.claim(s.job(job_id).message, owner="dead@host/1", duration=2.0)
        assert isinstance(getattr(claimed, "token", None), int), claimed
        assert s.store.release(job_id)
    queued_before = queue_length(s)

    # When two reapers run a pass at the same moment
    barrier = threading.Barrier(2)
    reports: list[celery_leases.ReapReport] = []

    def reaper() -> None:
        barrier.wait()
        reports.append(celery_leases.reap(s.app))

    threads = [threading.Thread(target=reaper) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    # Then each job was re-published once, by one of them
    republished = sorted(job_id for report in reports for job_id in report.republished)
    assert republished == sorted(jobs), reports
    assert queue_length(s) == queued_before + len(jobs)

    # And a worker runs each job once, dropping the extra message
    s.start_workers(1)
    for job_id in jobs:
        job = s.wait_finished(job_id, timeout=30)
        assert (job.state, job.attempts) == ("done", 2), job
        assert len(check_unit_log(s.log.rows(job_id), 2, crashes=0)) == 1


@postgres
def test_a_job_that_kills_its_worker_on_every_attempt_ends_failed_and_says_why(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given a task that SIGKILLs its own pool process before any checkpoint, a 1 s lease, and
    # leases_max_attempts_without_progress = 3
    s = with_reaper(scenario, celery_settings, lease_seconds=1.0, renew_seconds=0.3)
    assert DEFAULTS["max_attempts_without_progress"] == 3

    # When it runs
    job_id = s.send("e2e.poison")
    job = s.wait_finished(job_id, timeout=60)

    # Then after three attempts without progress the reaper marks it failed, saying why
    assert job.state == "failed", job
    assert job.error == GAVE_UP_NO_PROGRESS
    assert "without saving a checkpoint" in job.error
    assert job.attempts == 3
    assert [(r.unit, r.attempt) for r in s.log.rows(job_id)] == [(0, 1), (0, 2), (0, 3)]
    # (the reaper logs its give-up right after the row's commit)
    wait_for(
        lambda: f"job {job_id} (e2e.poison): gave up" in s.logs(),
        timeout=10,
        what="the reaper's give-up line",
    )


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_with_the_embedded_broker_a_killed_workers_lost_message_is_recovered_by_the_reaper(
    scenario: MakeScenario, filesystem_broker: dict[str, Any], queue_name: str
) -> None:
    # Given the filesystem:// broker, an SQLite store, two workers and the reaper
    broker = {
        **filesystem_broker,
        "broker_transport_options": {
            **filesystem_broker["broker_transport_options"],
            "polling_interval": 0.1,
        },
        "task_default_queue": queue_name,
    }
    s = with_reaper(scenario, broker)
    assert s.app.conf.leases_database_url.startswith("sqlite:")

    # When the worker running a job is SIGKILLed (its in-flight message dies with it: the
    # transport has no redelivery)
    def kill_worker(row: Unit) -> None:
        s.worker_of(row).kill()

    # Then the reaper re-publishes the job and the other worker resumes it
    job_id = f"embedded-{os.urandom(4).hex()}"
    _, runs, row = crash_and_resume(s, job_id, crash=kill_worker)
    assert s.worker_of(runs[1].first) is not s.worker_of(row)
    assert f"job {job_id} (e2e.units): lease expired" in s.logs()


def queue_length(s: Scenario) -> int:
    """Messages waiting in the scenario's queue (Redis list or RabbitMQ queue)."""
    queue = s.app.conf.task_default_queue
    with s.app.connection_for_write() as connection:
        channel = connection.default_channel
        if connection.transport.driver_type == "redis":
            return int(channel.client.llen(queue))
        return int(channel.queue_declare(queue, passive=True).message_count)
