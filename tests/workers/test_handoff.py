"""Issue 6 end to end: stalled attempts move, deploys hand jobs off fast, every pool renews.

Real ``celery worker`` subprocesses on Redis with a PostgreSQL store.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.apps.handoff_app import add_handoff_tasks
from tests.support.scenario import Scenario, check_unit_log, runs_of, start_all, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
]

HANDOFF_APP = "tests.support.apps.handoff_app"
MakeScenario = Callable[..., Scenario]


def handoff(
    scenario: MakeScenario,
    broker: dict[str, Any],
    *,
    extra: dict[str, Any] | None = None,
    **options: Any,
) -> Scenario:
    s = scenario({**broker, **(extra or {})}, **options)
    add_handoff_tasks(s.app)
    return s


def start(s: Scenario, count: int, **options: Any) -> list[Any]:
    workers = [s.spawn.worker(HANDOFF_APP, env=s.env, start=False, **options) for _ in range(count)]
    start_all(workers)
    s.workers += workers
    return workers


def test_a_sigterm_hands_a_running_job_to_another_worker_at_its_next_checkpoint(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers, a 30 s lease (expiry cannot be what moves the job) and no reaper
    s = handoff(scenario, celery_settings, lease_seconds=30.0)
    start(s, 2)
    job_id = s.send("e2e.units", 20, 0.25)
    row = s.wait_unit(job_id, unit=5, timeout=30)
    holder = s.worker_of(row)

    # When its worker gets SIGTERM (a deploy's warm shutdown)
    sent = time.time()
    holder.signal(signal.SIGTERM)

    # Then that worker exits within seconds instead of draining the whole task,
    holder.wait(timeout=15)
    exited = time.time() - sent
    # and the other worker resumes from the checkpoint saved at the preemption
    job = s.wait_finished(job_id, timeout=30)
    assert (job.state, job.result, job.attempts) == ("done", 20, 2), job
    runs = check_unit_log(s.log.rows(job_id), 20, crashes=0)
    assert len(runs) == 2
    assert runs[1].first.host != row.host
    handoff_seconds = runs[1].first.started_at - sent
    print(f"SIGTERM to exit {exited:.2f} s, to first resumed unit {handoff_seconds:.2f} s")
    assert exited < 10
    assert "handed back at its checkpoint" in holder.log_text()


def test_a_stalled_attempt_stops_renewing_and_its_job_resumes_elsewhere(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given a 1 s lease, a 2 s stall timeout, the reaper every 0.5 s, two workers
    s = handoff(
        scenario,
        celery_settings,
        lease_seconds=1.0,
        renew_seconds=0.25,
        reaper_every=0.5,
        extra={"leases_stall_timeout": 2.0},
    )
    start(s, 2)
    s.start_beat()
    job_id = s.send("e2e.stuck", 8, 0.1, 2)

    # When the first attempt hangs in time.sleep(3600) after unit 2
    row = s.wait_unit(job_id, unit=2, timeout=30)
    hung_from = time.time()

    # Then within stall timeout + lease + reaper interval (plus delivery) it moves on
    job = s.wait_finished(job_id, timeout=30)
    assert (job.state, job.result) == ("done", 8), job
    runs = runs_of(s.log.rows(job_id))
    assert len(runs) == 2
    assert runs[1].first.unit == 3
    moved_after = runs[1].first.started_at - hung_from
    print(f"stalled attempt moved after {moved_after:.2f} s")
    assert moved_after < 2.0 + 1.0 + 0.5 + 5.0
    assert "stalled" in s.worker_of(row).log_text()


def test_with_the_default_30_s_lease_a_stall_moves_the_job_when_it_happens_not_at_a_renewal(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given the default 30 s lease (renewed every 10 s), a 2 s stall timeout, the reaper every
    # second, and two workers with one pool process each
    s = handoff(scenario, celery_settings, reaper_every=1.0, extra={"leases_stall_timeout": 2.0})
    start(s, 2)
    s.start_beat()
    job_id = s.send("e2e.stuck", 8, 0.1, 2)

    # When the first attempt hangs after unit 2
    s.wait_unit(job_id, unit=2, timeout=30)

    # Then its keeper acts at the stall deadline: it hands the job back and ends its pool
    # process, the next reaper pass sends the job again, and it resumes at unit 3 within
    # stall timeout + reaper interval of the last checkpoint, not at the keeper's next
    # renewal up to 10 s later
    job = s.wait_finished(job_id, timeout=40)
    assert (job.state, job.result) == ("done", 8), job
    runs = runs_of(s.log.rows(job_id))
    assert len(runs) == 2 and runs[1].first.unit == 3
    last_checkpoint = runs[0].committed[-1].ended_at
    assert runs[0].committed[-1].unit == 2 and last_checkpoint is not None
    moved_after = runs[1].first.started_at - last_checkpoint
    print(f"stalled attempt moved {moved_after:.2f} s after its last checkpoint")
    assert moved_after < 2.0 + 1.0 + 2.0


def test_a_stalled_pool_process_is_terminated_when_kill_stalled_is_on(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given leases_kill_stalled, one worker with one pool process
    s = handoff(
        scenario,
        celery_settings,
        lease_seconds=1.0,
        renew_seconds=0.25,
        reaper_every=0.5,
        extra={"leases_stall_timeout": 1.0, "leases_kill_stalled": True},
    )
    (worker,) = start(s, 1)
    s.start_beat()
    job_id = s.send("e2e.stuck", 6, 0.1, 1)

    # When its attempt hangs
    row = s.wait_unit(job_id, unit=1, timeout=30)

    # Then the stuck pool process is ended, its slot is replaced, and the job finishes there
    wait_for(lambda: not _alive(row.pid), timeout=15, what="the stuck pool process to end")
    job = s.wait_finished(job_id, timeout=30)
    assert (job.state, job.result) == ("done", 6), job
    assert worker.is_alive()
    assert "terminating pool process" in worker.log_text()


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_one_process_keeps_fifty_concurrent_leases_alive(
    scenario: MakeScenario, celery_settings: dict[str, Any], pool: str
) -> None:
    # Given a 1 s lease renewed every 0.3 s and a reaper every 0.5 s that would re-publish
    # any lease that expired
    s = handoff(scenario, celery_settings, lease_seconds=1.0, renew_seconds=0.3, reaper_every=0.5)
    start(s, 1, pool=pool, concurrency=50)
    s.start_beat()

    # When 50 jobs each hold their lease 4 s without a checkpoint, all at once
    ids = [s.send("e2e.hold", 4.0) for _ in range(50)]

    # Then every one ends done at its first attempt, under the token it was claimed with (it
    # returns it): no lease expired
    jobs = [s.wait_finished(job_id, timeout=60) for job_id in ids]
    assert [(j.state, j.attempts, j.result) for j in jobs] == [("done", 1, j.token) for j in jobs]


def test_a_gevent_worker_that_ran_a_leased_job_still_shuts_down_on_sigterm(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given a gevent worker that has run a leased job (its keeper started: a greenlet of the
    # main thread, where the library must not block the process's signals)
    s = handoff(scenario, celery_settings, lease_seconds=30.0)
    [worker] = start(s, 1, pool="gevent", concurrency=5)
    job_id = s.send("e2e.units", 2, 0.1)
    assert s.wait_finished(job_id, timeout=30).state == "done"
    blocked = blocked_signals(worker.pid)

    # When it gets SIGTERM (a deploy's warm shutdown)
    worker.signal(signal.SIGTERM)

    # Then its main thread never blocked SIGTERM, and it shuts down
    assert signal.SIGTERM not in blocked, blocked
    assert worker.wait(timeout=30) == 0


def blocked_signals(pid: int) -> set[signal.Signals]:
    """The signals the main thread of process ``pid`` blocks (Linux: /proc/<pid>/status)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    mask = int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)
    return {s for s in signal.Signals if mask >> (s - 1) & 1}


def test_a_celery_retry_hands_the_lease_back_and_the_retry_resumes_from_the_checkpoint(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given one worker and a task that calls self.retry() after its third checkpoint
    s = handoff(scenario, celery_settings, lease_seconds=30.0)
    start(s, 1)

    # When it runs
    job_id = s.send("e2e.flaky", 6)

    # Then the retry message claims the lease the first attempt handed back (no waiting for a
    # 30 s expiry) and resumes after unit 2
    job = s.wait_finished(job_id, timeout=20)
    assert (job.state, job.attempts) == ("done", 2), job
    assert job.result == {"resumed_from": 3, "retries": 1}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
