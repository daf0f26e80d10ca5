"""Recovery that does not wait for the lease: a dead pool process is seen at once, and a
hand-off redoes no unit. Real prefork workers on Redis with a PostgreSQL store."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.apps.handoff_app import add_handoff_tasks
from tests.support.scenario import Scenario, check_unit_log, resume_delay, start_all

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(90),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
]

HANDOFF_APP = "tests.support.apps.handoff_app"
MakeScenario = Callable[..., Scenario]


def start(s: Scenario, count: int, **options: Any) -> list[Any]:
    workers = [s.spawn.worker(HANDOFF_APP, env=s.env, start=False, **options) for _ in range(count)]
    start_all(workers)
    s.workers += workers
    return workers


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
    assert "died; sent again to resume from its checkpoint" in s.logs()


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
