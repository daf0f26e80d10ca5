"""Recovery that does not wait for the lease: a dead pool process is seen at once, and a
hand-off redoes no unit. Real prefork workers on Redis with a PostgreSQL store (the hand-off
on MariaDB too, whose checkpoint reads a stop request another way: no RETURNING there)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.apps.handoff_app import add_handoff_tasks
from tests.support.scenario import Scenario, check_unit_log, resume_delay, start_all, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(90),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
]
POSTGRES = pytest.mark.parametrize("database_url", ["postgres"], indirect=True)

HANDOFF_APP = "tests.support.apps.handoff_app"
MakeScenario = Callable[..., Scenario]


def start(s: Scenario, count: int, **options: Any) -> list[Any]:
    workers = [s.spawn.worker(HANDOFF_APP, env=s.env, start=False, **options) for _ in range(count)]
    start_all(workers)
    s.workers += workers
    return workers


@POSTGRES
def test_a_killed_pool_process_job_resumes_at_once_not_when_its_lease_expires(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given one worker with two pool processes, a 60 s lease and no reaper: only the worker's
    # main process can bring the job back before the lease expires
    s = scenario(celery_settings, lease_seconds=60.0, result_backend=result_backend)
    add_handoff_tasks(s.app)
    start(s, 1, concurrency=2)
    result = s.app.tasks["e2e.units"].apply_async((12, 0.25))
    job_id = result.id

    # When the pool process running it is SIGKILLed during unit 4 (as the OOM killer does)
    row = s.wait_unit(job_id, unit=4, timeout=20)
    killed = time.time()
    os.kill(row.pid, signal.SIGKILL)

    # Then the job resumes from its checkpoint long before the lease could have expired,
    # and the client waiting on it gets the result, not WorkerLostError
    assert result.get(timeout=30) == 12
    job = s.job(job_id)
    assert (job.state, job.result, job.attempts) == ("done", 12, 2), job
    runs = check_unit_log(s.log.rows(job_id), 12, crashes=1)
    assert runs[1].first.unit == row.unit
    delay = resume_delay(s.log.rows(job_id), killed)
    print(f"pool process SIGKILL to first resumed unit: {delay:.2f} s")
    assert delay < 30  # not the 60 s lease
    # by the main process's watch over its pool, the moment the process died (billiard's own
    # report comes up to 5 s later)
    assert "died (seen at once); sent again to resume from its checkpoint" in s.logs()


@POSTGRES
def test_a_worker_whose_only_pool_process_died_replaces_it_at_once_and_resumes_the_job(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given one worker with a single pool process, a 60 s lease and no reaper: the job sent
    # again after the death can only go to this worker, which has no live process left
    s = scenario(celery_settings, lease_seconds=60.0)
    add_handoff_tasks(s.app)
    start(s, 1, concurrency=1)
    job_id = s.app.tasks["e2e.units"].apply_async((8, 0.25)).id

    # When that pool process is SIGKILLed during unit 3
    row = s.wait_unit(job_id, unit=3, timeout=20)
    os.kill(row.pid, signal.SIGKILL)

    # Then the worker's main process has its pool replace the process as soon as it hands the
    # job back (not at billiard's own check, every 5 s), and the job resumes there, in the new
    # process, from its checkpoint
    job = s.wait_finished(job_id, timeout=40)
    assert (job.state, job.attempts) == ("done", 2), job
    runs = check_unit_log(s.log.rows(job_id), 8, crashes=1)
    assert runs[1].first.unit == row.unit and runs[1].first.pid != row.pid
    assert "a pool process died; the pool replaces it now" in s.logs()


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_hand_off_saves_the_unit_it_was_given_before_it_stops(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers whose keeper sees a stop request within 0.1 s, and a job whose units
    # checkpoint on their own after committing
    s = scenario(celery_settings, lease_seconds=30.0, renew_seconds=0.1)
    add_handoff_tasks(s.app)
    start(s, 2)
    job_id = s.send("e2e.saved_units", 12, 0.5)
    row = s.wait_unit(job_id, unit=3, timeout=30)
    holder = s.worker_of(row)

    # When its worker gets SIGTERM mid-unit: the keeper learns of the preemption before the
    # unit's checkpoint is called
    holder.signal(signal.SIGTERM)

    # Then that checkpoint is saved before the attempt stops, and no unit is done twice
    job = s.wait_finished(job_id, timeout=40)
    assert (job.state, job.result, job.attempts) == ("done", 12, 2), job
    runs = check_unit_log(s.log.rows(job_id), 12, crashes=0)
    assert len(runs) == 2
    assert runs[1].first.unit == runs[0].committed[-1].unit + 1


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_deploys_stop_request_is_seen_by_the_next_checkpoint_not_the_next_renew_tick(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers with the default 30 s lease (renewed every 10 s) and a 6 s job that
    # checkpoints every 0.5 s: it would end long before its keeper's next renew tick
    s = scenario(celery_settings, lease_seconds=30.0)
    add_handoff_tasks(s.app)
    start(s, 2)
    job_id = s.send("e2e.units", 12, 0.5)
    row = s.wait_unit(job_id, unit=3, timeout=30)

    # When its worker gets SIGTERM (a deploy)
    s.worker_of(row).signal(signal.SIGTERM)

    # Then the attempt's next checkpoint saves its unit and hands the job back: it resumes on
    # the other worker instead of the warm shutdown waiting for it to end
    job = s.wait_finished(job_id, timeout=40)
    assert (job.state, job.result, job.attempts) == ("done", 12, 2), job
    runs = check_unit_log(s.log.rows(job_id), 12, crashes=0)
    assert len(runs) == 2 and runs[1].first.host != runs[0].first.host
    assert runs[1].first.unit == runs[0].committed[-1].unit + 1


@POSTGRES
def test_a_pool_process_killed_right_after_its_job_is_done_still_delivers_the_result(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given a job with a success callback whose pool process dies after the attempt marked
    # the job done and before Celery stored its result (the worst moment for a kill)
    s = scenario(celery_settings, lease_seconds=30.0, result_backend=result_backend)
    add_handoff_tasks(s.app)
    start(s, 1, concurrency=2)
    key = f"callback-{os.urandom(4).hex()}"
    result = s.app.tasks["e2e.dies_once_done"].apply_async(
        (42,), link=s.app.signature("e2e.record_callback", args=(key,))
    )

    # Then the worker's main process stores the result and sends the callback, once
    assert result.get(timeout=30) == 42
    job = s.job(result.id)
    assert (job.state, job.result, job.attempts) == ("done", 42, 1), job
    wait_for(lambda: s.log.rows(key), timeout=20, what="the success callback")
    time.sleep(1.0)  # a second callback would have come by now
    assert [row.unit for row in s.log.rows(key)] == [42]
    assert "died after the job was done; its result stored and its callbacks sent" in s.logs()
