"""Issue 2 end to end: LeasedTask in real prefork workers on Redis and RabbitMQ, PostgreSQL store.

Every test here runs with ``task_acks_late`` + ``task_reject_on_worker_lost`` and no reaper:
the broker's own redelivery is the only way back for a killed attempt.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.scenario import Scenario, check_unit_log, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(90),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
]

MakeScenario = Callable[..., Scenario]


def acks_late(
    scenario: MakeScenario, broker: dict[str, Any], *, lease: float = 1.0, renew: float = 0.3
) -> Scenario:
    return scenario(
        broker,
        lease_seconds=lease,
        renew_seconds=renew,
        acks_late=True,
        reject_on_worker_lost=True,
    )


def test_a_killed_pool_process_job_is_delivered_again_and_resumes_from_its_checkpoint(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given one worker, acks_late + task_reject_on_worker_lost, a 1 s lease, a 12-unit job
    s = acks_late(scenario, celery_settings)
    s.start_workers(1)
    job_id = s.send("e2e.units", 12, 0.25)

    # When the pool process running it is SIGKILLed during unit 4
    row = s.wait_unit(job_id, unit=4, timeout=20)
    os.kill(row.pid, signal.SIGKILL)

    # Then the broker delivers the message again and the job resumes from its checkpoint
    job = s.wait_finished(job_id, timeout=30)
    assert (job.state, job.result, job.attempts) == ("done", 12, 2), job
    runs = check_unit_log(s.log.rows(job_id), 12, crashes=1)
    assert len(runs) == 2
    assert runs[1].first.unit == row.unit  # the unit in progress, and none before it


def test_a_duplicate_delivery_while_the_lease_is_live_does_not_run_the_body_twice(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given two idle workers and a running 8-unit job
    s = scenario(
        celery_settings,
        lease_seconds=1.0,
        renew_seconds=0.3,
        acks_late=True,
        reject_on_worker_lost=True,
        result_backend=result_backend,
    )
    s.start_workers(2)
    result = s.app.tasks["e2e.units"].apply_async((8, 0.25))
    job_id = result.id
    s.wait_unit(job_id, unit=1, timeout=20)

    # When the same task id is sent again while it runs (the other worker is idle), and once
    # more after it finished
    s.app.send_task("e2e.units", args=(8, 0.25), task_id=job_id)
    wait_for(
        lambda: "a live lease holds it" in s.logs(), timeout=10, what="the duplicate to be dropped"
    )
    assert result.get(timeout=30) == 8
    s.app.send_task("e2e.units", args=(8, 0.25), task_id=job_id)
    wait_for(lambda: "already done" in s.logs(), timeout=10, what="the late duplicate dropped")

    # Then the body ran once, and the result of the real run stands
    job = s.job(job_id)
    assert (job.state, job.result, job.attempts) == ("done", 8, 1), job
    runs = check_unit_log(s.log.rows(job_id), 8, crashes=0)
    assert len(runs) == 1
    assert s.app.AsyncResult(job_id).get(timeout=10) == 8


def test_renewal_keeps_a_1s_lease_alive_through_a_4s_task(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given a 1 s lease renewed every 0.2 s and a task that sleeps 4 s before its checkpoint
    s = acks_late(scenario, celery_settings, lease=1.0, renew=0.2)
    s.start_workers(2)
    job_id = s.send("e2e.units", 1, 4.0)
    s.wait_unit(job_id, unit=0, timeout=20)

    # When we watch the lease from the database while it runs, and send a duplicate at 2 s
    seen: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            job = s.job(job_id)
            if job.state != "running":
                return
            seen.append(job.expires_in or 0.0)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        time.sleep(2.0)
        s.app.send_task("e2e.units", args=(1, 4.0), task_id=job_id)
        job = s.wait_finished(job_id, timeout=20)
    finally:
        stop.set()
        watcher.join()

    # Then the lease never expired: the duplicate was refused, the job ended done at attempt 1
    assert (job.state, job.attempts) == ("done", 1), job
    assert "a live lease holds it" in s.logs()
    assert len(seen) > 20 and min(seen) > 0, f"lease seconds left seen: {seen}"
    check_unit_log(s.log.rows(job_id), 1, crashes=0)


def test_a_checkpoint_that_is_not_json_fails_the_job_with_checkpoint_error(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given a task that saves {"next": 1}, then checkpoints a state holding an object()
    s = acks_late(scenario, celery_settings)
    s.start_workers(1)

    # When it runs
    job_id = s.send("e2e.bad_checkpoint")
    job = s.wait_finished(job_id, timeout=20)

    # Then the job failed with the documented error, and the previous checkpoint is kept
    assert job.state == "failed", job
    assert job.error is not None
    assert job.error.startswith("celery_leases.errors.CheckpointError: "), job.error
    assert "is not JSON-serializable" in job.error
    assert "the previous checkpoint is kept" in job.error
    assert job.checkpoint == {"next": 1}
    assert job.attempts == 1
