"""Bad input against real workers (issue 7): a leases database that is down at worker start, at
claim, during renewal and at finish, and a job whose task no worker knows.

The database outages go through a TCP proxy in this process (``tests.support.proxy``) in front
of the shared PostgreSQL: the workers' ``leases_database_url`` points at the proxy, the test reads
the table directly. Stopping the proxy refuses new connections and cuts the open ones, like a
database going down, without touching the server other tests use.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import Job, StoreUnavailable, get_job
from celery_leases.config import settings_for
from celery_leases.db.store import Store, store_for
from chaos.app import ReconnectingUnitLog, add_chaos_tasks, chaos_log_for
from tests.support.apps.factory import app_env
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.message import job_message
from tests.support.proxy import TcpProxy
from tests.support.scenario import FINISHED, check_unit_log, kill_all, wait_for
from tests.support.service import close_app
from tests.support.unit_log import Unit
from tests.support.worker import Beat, Spawner, Worker

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
]

CHAOS_APP = "chaos.app"
#: Given to the workers in their database URL; it must never show up in a log.
PASSWORD = "secret-pw-7"


@dataclass
class Outage:
    """Workers whose leases database is behind ``proxy``; ``client``, ``store`` and ``log``
    reach the database directly."""

    spawn: Spawner
    proxy: TcpProxy
    env: dict[str, str]
    client: Celery
    store: Store
    log: ReconnectingUnitLog

    def worker(self, **options: Any) -> Worker:
        return self.spawn.worker(CHAOS_APP, env=self.env, concurrency=2, **options)

    def beat(self) -> Beat:
        return self.spawn.beat(CHAOS_APP, env=self.env, max_interval=1)

    def send(self, *args: Any, **kwargs: Any) -> str:
        return str(self.client.tasks["chaos.exactly_once"].apply_async(args, kwargs).id)

    def job(self, job_id: str) -> Job:
        job = get_job(self.client, job_id)
        assert job is not None
        return job

    def finished(self, job_id: str, timeout: float) -> Job:
        def probe() -> Job | None:
            job = self.job(job_id)
            return job if job.state in FINISHED else None

        return wait_for(
            probe,
            timeout=timeout,
            interval=0.1,
            what=f"job {job_id} to finish",
        )

    def committed(self, job_id: str, unit: int, timeout: float) -> Unit:
        return wait_for(
            lambda: next(
                (r for r in self.log.rows(job_id) if r.unit == unit and r.committed), None
            ),
            timeout=timeout,
            interval=0.01,
            what=f"unit {unit} of {job_id} to commit",
        )

    def started(self, job_id: str, unit: int, timeout: float) -> Unit:
        return wait_for(
            lambda: next((r for r in self.log.rows(job_id) if r.unit == unit), None),
            timeout=timeout,
            interval=0.01,
            what=f"unit {unit} of {job_id} to start",
        )

    def logs(self) -> str:
        return "\n".join(p.log_text() for p in self.spawn.processes)


@pytest.fixture
def outage(
    spawn: Spawner, database_url: str, table_name: str, celery_settings: dict[str, Any]
) -> Iterator[Callable[..., Outage]]:
    """``outage(lease_seconds=..., renew_seconds=..., reaper_every=...)``: an Outage whose
    proxy is stopped (start it to bring the database up)."""
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    proxied = database_url.replace(
        f"@{target.hostname}:{target.port or 5432}", f":{PASSWORD}@127.0.0.1:{proxy.port}"
    )
    assert proxied != database_url
    made: list[Outage] = []

    def make(**options: Any) -> Outage:
        extra = {k: v for k, v in celery_settings.items() if k != "broker_url"}
        extra["leases_db_retry_max_delay"] = 4.0
        common = {"broker_url": celery_settings["broker_url"], "table": table_name, **options}
        env = app_env(database_url=proxied, extra=extra, **common)
        client = add_chaos_tasks(
            make_leased_app(app_env(database_url=database_url, extra=extra, **common), name="c")
        )
        log = chaos_log_for(client)
        log.create()
        made.append(Outage(spawn, proxy, env, client, store_for(settings_for(client)), log))
        return made[-1]

    yield make
    kill_all(spawn)
    proxy.close()
    for o in made:
        close_app(o.client)
        o.log.dispose()
        o.store.engine.dispose()


def assert_no_password(o: Outage) -> None:
    assert PASSWORD not in o.logs()


def test_a_worker_started_with_the_database_down_never_runs_a_job_unleased_and_runs_it_once_back(
    outage: Callable[..., Outage],
) -> None:
    # Given a worker started while its leases database is down (a port nothing listens on)
    o = outage(lease_seconds=3.0, renew_seconds=0.5)
    worker = o.worker()

    # When a job is sent
    job_id = o.send(3, 0.1)

    # Then each claim fails, and the message is delivered again later, with growing delays
    match = worker.wait_for_log(
        rf"job {job_id}: leases database unreachable, delivering "
        r"again in [\d.]+ s \(try 2\)",
        timeout=30,
    )
    tries = re.findall(
        rf"job {job_id}: leases database unreachable, delivering again in "
        r"([\d.]+) s \(try (\d)\)",
        worker.log_text()[: match.end()],
    )
    assert [int(t) for _, t in tries] == [1, 2]
    assert 1.0 <= float(tries[0][0]) <= 2.0 and 2.0 <= float(tries[1][0]) <= 4.0, tries
    assert "postgresql+psycopg://postgres:***@127.0.0.1" in worker.log_text()
    # and nothing ran without a lease
    job = o.job(job_id)
    assert (job.state, job.attempts, o.log.rows(job_id)) == ("queued", 0, []), job

    # When the database is back
    o.proxy.start()

    # Then the job runs once, from its first unit
    job = o.finished(job_id, timeout=30)
    assert (job.state, job.attempts, job.result) == ("done", 1, 3), job
    assert len(check_unit_log(o.log.rows(job_id), 3, crashes=0)) == 1
    assert_no_password(o)


def test_renewals_that_fail_for_less_than_the_lease_keep_the_attempt_and_change_nothing(
    outage: Callable[..., Outage],
) -> None:
    # Given a running job of 3 units of 3 s, a 3 s lease renewed every 0.3 s
    o = outage(lease_seconds=3.0, renew_seconds=0.3)
    o.proxy.start()
    worker = o.worker()
    job_id = o.send(3, 3.0)
    o.started(job_id, 0, timeout=30)

    # When the database is down for 1 s in the middle of unit 0 (once the unit's start has
    # its reply: stopped the moment the start's row commits, the proxy can cut the reply, and
    # the body's own write fails instead of the renewals)
    time.sleep(0.3)
    o.proxy.stop()
    time.sleep(1.0)
    o.proxy.start()

    # Then renewals failed, then worked again, and the same attempt finished the job
    job = o.finished(job_id, timeout=30)
    assert (job.state, job.attempts, job.result) == ("done", 1, 3), job
    log = worker.log_text()
    assert "cannot renew leases" in log and "renewals work again" in log
    assert "lease lost" not in log
    assert len(check_unit_log(o.log.rows(job_id), 3, crashes=0)) == 1
    assert_no_password(o)


def test_an_outage_longer_than_the_lease_stops_the_attempt_and_the_job_resumes_at_its_checkpoint(
    outage: Callable[..., Outage],
) -> None:
    # Given a running job of 2 units of 5 s, a 1.5 s lease, the reaper every 0.5 s
    o = outage(lease_seconds=1.5, renew_seconds=0.3, reaper_every=0.5)
    o.proxy.start()
    worker = o.worker()
    o.beat()
    job_id = o.send(2, 5.0)
    o.started(job_id, 1, timeout=30)

    # When the database is down for 3.5 s during unit 1 (past the lease), from 0.3 s into it
    # (once the unit's start has its reply, as above)
    time.sleep(0.3)
    o.proxy.stop()
    time.sleep(3.5)
    o.proxy.start()

    # Then the attempt counted its lease lost and committed nothing more; the reaper
    # re-published the job and it resumed at unit 1, each unit committed once
    job = o.finished(job_id, timeout=40)
    assert (job.state, job.attempts, job.result) == ("done", 2, 2), job
    log = worker.log_text()
    assert f"lease lost on job {job_id}: renewals failed until it expired" in log
    assert re.search(rf"job {job_id}: attempt with token \d+ stopped, lease lost", log), log
    runs = check_unit_log(o.log.rows(job_id), 2, crashes=1)
    assert [r.first.unit for r in runs] == [0, 1]
    assert_no_password(o)


def test_a_finish_during_a_short_outage_waits_for_the_database_and_is_recorded(
    outage: Callable[..., Outage],
) -> None:
    # Given a job whose body sleeps 2 s after its last checkpoint, and an 8 s lease
    o = outage(lease_seconds=8.0, renew_seconds=0.5)
    o.proxy.start()
    worker = o.worker()
    job_id = o.send(2, 0.2, tail_seconds=2.0)

    # When the database goes down right after the last checkpoint, for 3 s (once the
    # attempt is in its tail: stopped at the very moment of the commit, the proxy can cut the
    # COMMIT's reply, and the task's own transaction then fails instead of the finish)
    o.committed(job_id, 1, timeout=30)
    time.sleep(0.3)
    o.proxy.stop()
    time.sleep(3.0)
    o.proxy.start()

    # Then the finish waited and was recorded by the same attempt
    job = o.finished(job_id, timeout=30)
    assert (job.state, job.attempts, job.result) == ("done", 1, 2), job
    assert f"job {job_id}: done, waiting for the database to record it" in worker.log_text()
    assert len(check_unit_log(o.log.rows(job_id), 2, crashes=0)) == 1
    assert_no_password(o)


def test_a_finish_blocked_past_the_lease_runs_again_from_the_last_checkpoint_redoing_no_unit(
    outage: Callable[..., Outage],
) -> None:
    # Given a job whose body sleeps 1.5 s after its last checkpoint, a 1.5 s lease, the reaper
    o = outage(lease_seconds=1.5, renew_seconds=0.3, reaper_every=0.5)
    o.proxy.start()
    worker = o.worker()
    o.beat()
    job_id = o.send(2, 0.2, tail_seconds=1.5)

    # When the database goes down right after the last checkpoint, for 5 s (once the
    # checkpoint's COMMIT has its reply, as above)
    o.committed(job_id, 1, timeout=30)
    time.sleep(0.3)
    o.proxy.stop()
    time.sleep(5.0)
    o.proxy.start()

    # Then the attempt gave up recording its finish, and the job ran again from its final
    # checkpoint: done at attempt 2, no unit run twice
    job = o.finished(job_id, timeout=40)
    assert (job.state, job.attempts, job.result) == ("done", 2, 2), job
    assert (
        f"job {job_id}: done, but the database stayed down until the lease ended"
        in worker.log_text()
    )
    assert len(check_unit_log(o.log.rows(job_id), 2, crashes=0)) == 1
    assert_no_password(o)


def test_a_job_of_a_task_no_worker_knows_waits_queued_saying_why_and_is_not_sent_each_pass(
    outage: Callable[..., Outage],
) -> None:
    # Given a worker and a beat reaping every 0.5 s, a recorded job whose task no worker
    # knows (its message lost: the reaper re-publishes it after the queued timeout)
    o = outage(lease_seconds=2.0, reaper_every=0.5)
    o.proxy.start()
    o.worker()
    o.beat()
    unknown = "unknown-task-job"
    assert (
        o.store.register(
            job_message(
                unknown,
                "chaos.nobody_knows",
                args=[1],
                routing_key=o.client.conf.task_default_queue,
            ),
            queued_timeout=0.5,
        ).outcome
        == "new"
    )
    known = o.send(2, 0.1)

    # When the reaper re-publishes it and the worker receives it
    def waiting() -> Job | None:
        job = o.job(unknown)
        return job if job.error else None

    job = wait_for(waiting, timeout=30, what=f"job {unknown} to say why it waits")

    # Then the job waits, queued, for a worker that knows its task (a rolling deploy may bring
    # one), saying which task it is and which worker did not know it
    assert job.state == "queued", job
    reason = (
        f"waiting for a worker that knows task 'chaos.nobody_knows' ({o.spawn.processes[0].name}@"
    )
    assert job.error is not None and reason in job.error, job
    # and it is not re-published at each pass: a few reaper passes later (within
    # leases_reap_grace, 5 s, the wait before it is sent again) it was published once
    time.sleep(3.0)
    assert o.job(unknown).state == "queued"
    logs = o.logs()
    assert len(re.findall(rf"job {unknown} \(chaos\.nobody_knows\): lease expired", logs)) == 1
    said = f"job {unknown}: waiting for a worker that knows task 'chaos.nobody_knows'"
    assert logs.count(said) == 1, logs[-3000:]
    # and the other job was not disturbed
    assert (o.finished(known, timeout=30).state, o.job(known).attempts) == ("done", 1)


def test_a_transactional_checkpoint_on_a_connection_the_database_dropped_is_store_unavailable(
    outage: Callable[..., Outage],
) -> None:
    # Given a claimed job and a transaction of the caller's, whose connection is then cut
    o = outage()
    o.proxy.start()
    proxied = store_for(settings_for(make_leased_app(o.env, name="proxied")))
    try:
        sent = job_message("job-1", "t")
        proxied.register(sent)
        claimed = proxied.claim(sent, owner="me", duration=30)
        token = getattr(claimed, "token", None)
        assert isinstance(token, int), claimed

        # When the checkpoint joins that transaction
        with pytest.raises(StoreUnavailable) as raised, proxied.engine.begin() as connection:
            connection.execute(sa.text("SELECT 1"))
            o.proxy.stop()
            proxied.checkpoint("job-1", token, '{"next": 1}', connection=connection)
    finally:
        proxied.engine.dispose()

    # Then it is StoreUnavailable (a task can retry it), naming the database, not its password
    assert "checkpoint not saved, leases database postgresql+psycopg://postgres:***@" in str(
        raised.value
    )
    assert PASSWORD not in str(raised.value)
    assert o.job("job-1").checkpoint is None
