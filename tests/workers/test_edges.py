"""The edges of real deployments, end to end (issue "Every promise holds at the edges"): a soft
time limit that lands inside a checkpoint, a trigger of a lease key whose job ends before it
starts, a rolling deploy whose older workers do not know a task, and two workers started with
one node name.

Real prefork workers (``-c 1``) of ``tests.support.apps.leased_app`` on Redis with a PostgreSQL
store; a real ``celery beat`` reaping every second where a test needs the reaper.
"""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases import Job
from tests.support.apps.control_app import PARTIAL_ENV
from tests.support.scenario import LEASED_APP, Scenario, start_all, wait_for
from tests.support.worker import Worker

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(90),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
]

MakeScenario = Callable[..., Scenario]

CONTROL_APP = "tests.support.apps.control_app"
#: Reaper passes (seconds apart) and the wait before a queued job is sent again (seconds).
REAPER_EVERY = 1.0
REAP_GRACE = 1.0


def with_beat(s: Scenario, *workers: Worker) -> None:
    """Start ``workers`` and a beat reaping every second, all at once."""
    beat = s.spawn.beat(LEASED_APP, env=s.env, max_interval=1, start=False)
    start_all([*workers, beat])
    s.workers += workers


def ended(s: Scenario, job_id: str, states: tuple[str, ...], timeout: float = 30) -> Job:
    """The job once its state is one of ``states``."""

    def probe() -> Job | None:
        job = s.job(job_id)
        return job if job.state in states else None

    return wait_for(probe, timeout=timeout, interval=0.1, what=f"job {job_id} in {states}")


# -- 1. a soft time limit inside a statement -----------------------------------------------------


def test_a_soft_time_limit_inside_a_checkpoint_leaves_the_process_fit_for_its_next_jobs(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given a prefork worker with one pool process running a leased task with
    # soft_time_limit=1 that checkpoints in a loop
    s = scenario(celery_settings, lease_seconds=4.0, renew_seconds=0.5)
    (worker,) = s.start_workers(1)
    pool = worker.children()
    job_id = s.send("e2e.time_limited", 0.05)
    wait_for(lambda: s.job(job_id).state == "running", timeout=30, interval=0.01, what="claim")

    # When another connection holds the job's row locked from then until after the limit, so
    # that the limit lands inside the statement of a checkpoint
    t = s.store.table
    with s.store.engine.connect() as connection, connection.begin():
        connection.execute(sa.select(t.c.id).where(t.c.id == job_id).with_for_update())
        worker.wait_for_log(r"Soft time limit \([\d.]+s\) exceeded for e2e\.time_limited")

    # Then the task's last checkpoint, saved after it caught the limit, is saved, and the job
    # ends done at its first attempt
    job = s.wait_finished(job_id, timeout=30)
    assert (job.state, job.attempts) == ("done", 1), job
    # (else the lock came after the limit: nothing was interrupted mid-statement)
    assert job.result["landed"] == "checkpoint", job.result
    assert job.checkpoint == job.result, job
    # and a second leased job sent to the same worker runs at once, in the same pool process,
    # at its first attempt (no renewal, claim or redelivery failed on a connection left busy)
    second = s.send("e2e.units", 2, 0.05)
    job = s.wait_finished(second, timeout=20)
    assert (job.state, job.attempts) == ("done", 1), job
    assert {row.pid for row in s.log.rows(second)} <= set(pool), (pool, s.log.rows(second))
    log = worker.log_text()
    assert "unreachable" not in log and "lease lost" not in log, worker.log_tail(40)


def test_a_soft_time_limit_the_task_caught_is_not_raised_again_when_the_worker_shuts_down(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given a prefork worker running a leased task with soft_time_limit=1 that catches the
    # limit, saves a last checkpoint and then cleans up for 4 s
    s = scenario(celery_settings, lease_seconds=4.0, renew_seconds=0.5)
    (worker,) = s.start_workers(1)
    job_id = s.send("e2e.time_limited", 0.05, 4.0)
    wait_for(
        lambda: (s.job(job_id).checkpoint or {}).get("last") is True,
        timeout=30,
        interval=0.02,
        what="the task to catch its soft time limit",
    )

    # When the worker is told to shut down (warm: it waits for the task) during the cleanup,
    # and billiard's pool checks the running job's limits once more as it closes
    worker.signal(signal.SIGTERM)

    # Then the second limit is not raised into the task's cleanup: the job ends as its
    # handler decided, done at its first attempt (it failed with the limit it had caught)
    job = s.wait_finished(job_id, timeout=30)
    assert (job.state, job.attempts) == ("done", 1), (job, worker.log_tail(30))
    assert job.result == job.checkpoint and job.result["last"] is True, job
    worker.wait(timeout=30)
    sent = re.findall(r"Soft time limit \([\d.]+s\) exceeded", worker.log_text())
    assert len(sent) == 2, f"the limit was sent {len(sent)} time(s): {worker.log_tail(30)}"
    assert "soft time limit came a second time" in worker.log_text()


@pytest.mark.parametrize(
    ("joined", "said"),
    [
        (True, "came after it returned or raised"),  # handed back after the body raised
        (False, "the soft time limit came while the attempt's end was recorded"),  # inside it
    ],
    ids=["held-back", "in-retry"],
)
def test_a_soft_time_limit_inside_the_hand_back_for_a_retry_still_hands_it_back(
    scenario: MakeScenario, celery_settings: dict[str, Any], tmp_path: Any, joined: bool, said: str
) -> None:
    # Given a leased task with soft_time_limit=1 whose first attempt checkpoints, then asks
    # for a retry once the test says so: held back until its body has raised (it wrote in a
    # transaction of its own), or handed back inside self.retry()
    s = scenario(celery_settings, lease_seconds=30.0, renew_seconds=0.5)
    (worker,) = s.start_workers(1)
    marker = tmp_path / "retry"
    job_id = s.send("e2e.retry_at", str(marker), joined)
    wait_for(lambda: s.job(job_id).checkpoint is not None, timeout=30, interval=0.01, what="ckpt")

    # When the hand-back of its lease for that retry waits behind a lock on the job's row
    # until the soft time limit has come (it lands inside the hand-back's statement)
    t = s.store.table
    with s.store.engine.connect() as connection, connection.begin():
        connection.execute(sa.select(t.c.id).where(t.c.id == job_id).with_for_update())
        marker.touch()
        worker.wait_for_log(r"Soft time limit \([\d.]+s\) exceeded for e2e\.retry_at")

    # Then the hand-back is made once the lock is gone, and the retry runs at once (not after
    # its 30 s lease): done at the second attempt, and Celery was told of a retry, not of a
    # failure with the limit
    job = s.wait_finished(job_id, timeout=20)
    assert (job.state, job.attempts, job.result) == ("done", 2, {"asked": "retry"}), job
    log = worker.log_text()
    assert "raised unexpected: SoftTimeLimitExceeded" not in log, worker.log_tail(40)
    assert said in log, log[-3000:]


def test_a_soft_time_limit_after_the_task_returned_leaves_celery_its_success(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given a leased task with soft_time_limit=1 that returns at once, sent with a link to a
    # leased task whose record, when Celery's trace publishes it, waits behind an uncommitted
    # row of the same id (so the limit comes there, after the job's end is recorded)
    s = scenario(celery_settings, result_backend=result_backend)
    (worker,) = s.start_workers(1)
    link_id = f"link-{uuid.uuid4().hex}"
    t = s.store.table
    with s.store.engine.connect() as connection, connection.begin() as blocking:
        row = {"id": link_id, "task": "e2e.echo", "message": "{}", "state": "done"}
        connection.execute(sa.insert(t).values(row | {"created_at": 0.0}))
        link = s.app.signature("e2e.echo").set(task_id=link_id)
        job_id = s.app.tasks["e2e.slow_success"].apply_async(link=link).id
        worker.wait_for_log(r"Soft time limit \([\d.]+s\) exceeded for e2e\.slow_success")
        blocking.rollback()

    # Then the limit is not raised into Celery's work: the caller gets SUCCESS, as the table
    # says, and the link runs with the result
    job = s.wait_finished(job_id, timeout=20)
    assert (job.state, job.result) == ("done", "ok"), job
    result = s.app.AsyncResult(job_id)
    wait_for(lambda: result.state != "PENDING", timeout=10, what="the job's result")
    assert (result.state, result.result) == ("SUCCESS", "ok"), (result.state, worker.log_tail(30))
    assert s.wait_finished(link_id, timeout=20).result == "ok"
    assert "came after it returned or raised" in worker.log_text()


# -- 5. a trigger of a lease key whose job ends before it starts ---------------------------------


def test_a_trigger_coalesced_into_a_job_that_ends_before_starting_still_runs_for_its_caller(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given a worker, a beat reaping every second, and three keyed jobs that have not started
    # (a countdown: the worker holds them), each with a trigger of its key coalesced into it
    s = scenario(
        celery_settings,
        result_backend=result_backend,
        lease_seconds=2.0,
        renew_seconds=0.5,
        reaper_every=REAPER_EVERY,
    )
    with_beat(s, s.spawn.worker(LEASED_APP, env=s.env, start=False))
    keyed = s.app.tasks["e2e.keyed_units"]
    held = {
        "expired": keyed.apply_async(("exp", 2, 0.05), countdown=2, expires=1),
        "revoked": keyed.apply_async(("rev", 2, 0.05), countdown=2),
        # (longer: the CLI that cancels it takes a few seconds to start)
        "cancelled": keyed.apply_async(("can", 2, 0.05), countdown=60),
    }
    triggers = {
        end: keyed.delay(account, 2, 0.05)
        for end, account in (("expired", "exp"), ("revoked", "rev"), ("cancelled", "can"))
    }

    # When those jobs end before they start: one's message expires, one is revoked, one is
    # cancelled with the CLI while queued
    s.app.control.revoke(held["revoked"].id)
    cancelled = s.cli("cancel", held["cancelled"].id)
    assert cancelled.returncode == 0, cancelled.stderr

    # Then no trigger is lost: each caller's result is that of a run made for it
    results = {}
    for end, trigger in triggers.items():
        try:
            results[end] = trigger.get(timeout=30, interval=0.1)
        except Exception as exc:
            results[end] = f"{type(exc).__name__}: {exc}"
    assert results == {"expired": 2, "revoked": 2, "cancelled": 2}, s.logs()[-4000:]
    for end, trigger in triggers.items():
        job = s.job(trigger.id)
        assert (job.state, job.served_by) == ("done", None), (end, job)
        assert len(s.log.rows(trigger.id)) == 2, (end, s.log.rows(trigger.id))
    # and the jobs they were coalesced into ended as asked, never having run
    for end, state in (("expired", "revoked"), ("revoked", "revoked"), ("cancelled", "cancelled")):
        job = ended(s, held[end].id, (state,))
        assert s.log.rows(job.id) == [], (end, s.log.rows(job.id))


# -- 12b. a rolling deploy: a worker that does not know the task ---------------------------------


def test_a_job_received_by_a_worker_without_its_task_waits_and_runs_on_one_that_knows_it(
    scenario: MakeScenario, celery_settings: dict[str, Any], result_backend: str
) -> None:
    # Given an older worker of a rolling deploy, whose app lacks e2e.units, alone on the
    # queue, and a beat reaping every second
    s = scenario(
        celery_settings | {"leases_reap_grace": REAP_GRACE},
        result_backend=result_backend,
        reaper_every=REAPER_EVERY,
    )
    older = s.spawn.worker(CONTROL_APP, env=s.env | {PARTIAL_ENV: "1"}, start=False)
    with_beat(s, older)

    # When a leased job of that task reaches it
    job_id = s.send("e2e.units", 2, 0.05)
    older.wait_for_log(r"Received unregistered task of type '?e2e\.units'?", timeout=15)

    # Then the job waits, queued (not failed), and says for what
    def with_error() -> Job | None:
        job = s.job(job_id)
        return job if job.error else None

    job = wait_for(with_error, timeout=15, what="the job's error")
    assert job.state == "queued", job
    assert "waiting for a worker that knows task 'e2e.units'" in (job.error or ""), job

    # When the older worker is replaced by one that knows the task
    older.terminate()
    older.wait(timeout=15)
    s.start_workers(1)

    # Then the job runs there, at its first attempt, and its caller gets its result
    job = s.wait_finished(job_id, timeout=30)
    assert (job.state, job.attempts, job.result) == ("done", 1, 2), job
    # The older worker stored an interim FAILURE (NotRegistered, docs/operating.md); the
    # worker that ran the job replaces it with SUCCESS right after the job's row ends done
    # (a fresh AsyncResult each read: one caches the first ready state it reads, and the
    # interim FAILURE is one, read between the row's end and Celery's store of SUCCESS)
    wait_for(
        lambda: s.app.AsyncResult(job_id).state == "SUCCESS",
        timeout=10,
        what="the job's SUCCESS",
    )
    assert s.app.AsyncResult(job_id).get(timeout=10) == 2


# -- 12d. two workers started with one node name --------------------------------------------------


def test_a_warm_shutdown_preempts_only_its_own_jobs_when_another_worker_has_its_node_name(
    scenario: MakeScenario, celery_settings: dict[str, Any], queue_name: str
) -> None:
    # Given two workers started with one node name (two containers of one image), each
    # running a job from a queue of its own
    s = scenario(celery_settings, lease_seconds=2.0, renew_seconds=0.5)
    queues = [f"{queue_name}_a", f"{queue_name}_b"]
    leaving, staying = (
        s.spawn.worker(LEASED_APP, env=s.env, start=False, hostname="same@%h", queues=[queue])
        for queue in queues
    )
    start_all([leaving, staying])
    s.workers += [leaving, staying]
    moved = s.send("e2e.units", 20, 0.2, queue=queues[0])
    kept = s.send("e2e.units", 20, 0.2, queue=queues[1])
    for job_id in (moved, kept):
        s.wait_unit(job_id, unit=1, timeout=30)

    # When one of them gets SIGTERM (a warm shutdown)
    leaving.signal(signal.SIGTERM)
    leaving.wait(timeout=30)

    # Then it handed its own job back at its checkpoint
    job = ended(s, moved, ("queued",), timeout=5)
    assert job.checkpoint is not None and job.checkpoint["next"] < 20, job
    assert "handed back at its checkpoint" in leaving.log_text(), leaving.log_tail(40)
    # and the other worker's job went on undisturbed: one run, done at its first attempt
    job = s.wait_finished(kept, timeout=30)
    assert (job.state, job.attempts, job.result) == ("done", 1, 20), job
    assert len({row.run for row in s.log.rows(kept)}) == 1, s.log.rows(kept)
    assert not re.search(rf"job {kept}: handed back", staying.log_text()), staying.log_tail(40)
