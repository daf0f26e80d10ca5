"""One run per resource, end to end: triggers of a lease key coalesce into one follow-up run,
two runs of a key never overlap, a crash loses no trigger, and the key's cursor advances by
exactly the units committed, whatever is killed or frozen.

Real prefork workers (two, ``-c 1`` each) running ``e2e.keyed_units`` (lease key
``account:<account>``, cursor ``{"units": n}`` saved with each unit's checkpoint).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest

from tests.support.scenario import Scenario, check_unit_log, freeze, thaw, wait_for
from tests.support.unit_log import Unit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

MakeScenario = Callable[..., Scenario]
UNITS = 8
UNIT_SECONDS = 0.2

stacks = pytest.mark.parametrize(
    ("broker_url", "database_url"),
    [("redis", "postgres"), ("rabbitmq", "mariadb")],
    indirect=True,
)


def trigger(s: Scenario, account: str) -> str:
    """What a webhook does: ask for a sync of ``account``; the id of the job serving it."""
    return str(s.app.tasks["e2e.keyed_units"].delay(account, UNITS, UNIT_SECONDS).id)


def jobs_of_key(s: Scenario, key: str) -> list[str]:
    return sorted(j.id for j in s.store.list_jobs(limit=500) if j.lease_key == key)


def check_one_run_at_a_time(s: Scenario, job_ids: list[str]) -> list[Unit]:
    """No two jobs of a key ran committed units at the same time, and each job started after
    the one before it had committed its last unit. Returns the first unit of each job."""
    committed = sorted(
        (u for job_id in job_ids for u in s.log.rows(job_id) if u.committed),
        key=lambda u: u.started_at,
    )
    for a, b in pairwise(committed):
        assert a.ended_at is not None and b.started_at >= a.ended_at, (a, b)
    firsts = [min(s.log.rows(job_id), key=lambda u: u.started_at) for job_id in job_ids]
    for earlier, later in pairwise(job_ids):
        last = max(u.ended_at or 0.0 for u in s.log.rows(earlier) if u.committed)
        assert firsts[job_ids.index(later)].started_at >= last, (earlier, later)
    return firsts


@stacks
def test_triggers_during_a_run_start_exactly_one_followup_after_the_last_of_them(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers and a sync of one account running
    s = scenario(celery_settings, lease_seconds=2.0, renew_seconds=0.5)
    s.start_workers(2)
    first = trigger(s, "a1")
    s.wait_unit(first, unit=1, timeout=30)

    # When twenty webhooks for that account arrive during the run (a second worker is idle)
    served = {trigger(s, "a1") for _ in range(20)}
    last_trigger = s.store.now()

    # Then they are all served by one follow-up job, which runs once the first has ended,
    # after the last trigger, from the cursor the first run left
    assert len(served) == 1 and first not in served, served
    (followup,) = served
    job = s.wait_finished(followup, timeout=60)
    assert (job.state, job.result) == ("done", 2 * UNITS), job
    assert jobs_of_key(s, "account:a1") == sorted([first, followup])
    firsts = check_one_run_at_a_time(s, [first, followup])
    assert firsts[1].started_at > last_trigger
    assert s.job(first).state == "done" and s.job(first).followup_id is None
    assert s.store.cursor("account:a1") == {"units": 2 * UNITS}
    # and a trigger once the key is idle starts a new run at once
    third = trigger(s, "a1")
    assert third not in (first, followup)
    assert s.wait_finished(third, timeout=60).result == 3 * UNITS


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_debounced_burst_runs_once_a_quiet_period_after_its_last_trigger_with_its_args(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given a worker, and a webhook burst of one account debounced by 0.4 s (max 5 s)
    s = scenario(celery_settings, lease_seconds=2.0, renew_seconds=0.5)
    s.start_workers(1)
    task = s.app.tasks["e2e.keyed_units"]

    # When five triggers come 0.05 s apart, each asking for one unit more than the last
    served = set()
    for count in range(1, 6):
        result = task.apply_async(("d1", count, 0.01), lease_debounce=(0.4, 5.0))
        served.add(str(result.id))
        time.sleep(0.05)
    last_trigger = s.store.now()

    # Then one job ran, with the last trigger's arguments, once 0.4 s had passed without one
    (job_id,) = served
    job = s.wait_finished(job_id, timeout=30)
    assert (job.state, job.result, job.attempts) == ("done", 5, 1), job
    assert jobs_of_key(s, "account:d1") == [job_id]
    assert job.claimed_at is not None and job.claimed_at >= last_trigger + 0.4 - 0.06


@stacks
def test_a_killed_run_resumes_and_its_pending_followup_still_runs(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers, a beat reaping every second, and a sync running with a trigger
    # waiting for it to end
    s = scenario(celery_settings, lease_seconds=2.0, renew_seconds=0.5, reaper_every=1.0)
    s.start_workers(2)
    s.start_beat()
    first = trigger(s, "b1")
    row = s.wait_unit(first, unit=3, timeout=30)
    followup = trigger(s, "b1")

    # When the worker running it is SIGKILLed (main process and pool), and more webhooks
    # arrive while the job waits to resume
    os.killpg(s.worker_of(row).pid, signal.SIGKILL)
    late = {trigger(s, "b1") for _ in range(5)}
    last_trigger = s.store.now()

    # Then the killed run resumes from its checkpoint on the other worker, the one follow-up
    # (which serves the late triggers too) runs after it, and the key's cursor counts every
    # committed unit exactly once
    assert late == {followup}
    assert s.wait_finished(followup, timeout=90).result == 2 * UNITS
    resumed = s.job(first)
    assert (resumed.state, resumed.result, resumed.attempts) == ("done", UNITS, 2), resumed
    check_unit_log(s.log.rows(first), UNITS, crashes=1)
    check_unit_log(s.log.rows(followup), UNITS, crashes=0)
    firsts = check_one_run_at_a_time(s, [first, followup])
    assert firsts[1].started_at > last_trigger
    assert jobs_of_key(s, "account:b1") == sorted([first, followup])
    assert s.store.cursor("account:b1") == {"units": 2 * UNITS}


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_frozen_run_that_wakes_after_its_job_moved_cannot_move_the_cursor(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers, a beat reaping every second, a 2 s lease and a sync running
    s = scenario(celery_settings, lease_seconds=2.0, renew_seconds=0.5, reaper_every=1.0)
    s.start_workers(2)
    s.start_beat()
    first = trigger(s, "c1")
    row = s.wait_unit(first, unit=3, timeout=30)
    holder = s.worker_of(row)

    # When its worker freezes mid-unit until the job has resumed elsewhere, then wakes up
    freeze(holder)
    try:
        s.wait_unit(first, unit=row.unit, timeout=30, run_other_than=row.run)
    finally:
        thaw(holder)
    job = s.wait_finished(first, timeout=60)
    wait_for(
        lambda: "stopped, lease lost" in holder.log_text(),
        timeout=30,
        what="the woken attempt to stop",
    )

    # Then the woken attempt committed nothing, cursor included: it counts each unit once
    assert (job.state, job.result) == ("done", UNITS), job
    check_unit_log(s.log.rows(first), UNITS, crashes=1)
    assert s.store.cursor("account:c1") == {"units": UNITS}


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_newest_trigger_supersedes_the_run_and_its_arguments_run_next(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given one worker running a long sync of an account
    s = scenario(
        celery_settings, lease_seconds=2.0, renew_seconds=0.5, result_backend=result_backend
    )
    s.start_workers(1)
    keyed = s.app.tasks["e2e.keyed_units"]
    first = keyed.delay("n1", 50, UNIT_SECONDS).id
    s.wait_unit(first, unit=1, timeout=30)

    # When two calls whose newest wins come while it runs
    calls = [
        keyed.apply_async(("n1", count, UNIT_SECONDS), lease_key_strategy="newest").id
        for count in (7, 2)
    ]

    # Then the run stops at its next checkpoint, superseded (REVOKED in Celery), its cursor
    # as committed; the next run answers both calls, with the newest one's arguments
    assert calls[0] == calls[1] != first
    stopped = s.wait_finished(first, timeout=30)
    assert stopped.state == "superseded", stopped
    # (the row is the truth and ends first; the backend is told right after it)
    s.app.AsyncResult(first).get(timeout=10, propagate=False)
    assert s.app.AsyncResult(first).state == "REVOKED"
    committed = len([u for u in s.log.rows(first) if u.committed])
    assert 2 <= committed <= 4, committed  # stopped within about one unit of the calls
    followup = s.wait_finished(calls[0], timeout=30)
    assert (followup.state, followup.result) == ("done", committed + 2), followup
    check_one_run_at_a_time(s, [first, calls[0]])
