"""Structured log fields, the jobs-by-state collector, and the progress event's text."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import prometheus_client
import pytest
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.schema import STATES
from celery_leases.db.store import store_for
from celery_leases.event import progress_text
from celery_leases.log import ATTEMPT, JOB_ID, OWNER, TOKEN
from celery_leases.metrics import JobsCollector
from tests.support.message import job_message


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("monitoring", broker="memory://", set_as_current=False)
    app.conf.update(leases_database_url=database_url, leases_table=table_name)
    yield app
    store_for(settings_for(app)).engine.dispose()


def leased(app: Celery) -> LeasedTask:
    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.monitored")
    def monitored(self: LeasedTask) -> int:
        self.checkpoint({"page": 1}, progress=(1, 2))
        return 1

    return monitored


def test_a_claims_log_record_carries_the_job_id_token_and_attempt_as_fields(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    task = leased(app)
    caplog.set_level(logging.INFO, logger="celery_leases")

    task.apply(task_id="job-fields")

    claimed = [r for r in caplog.records if "claimed" in r.getMessage()]
    assert len(claimed) == 1
    record = claimed[0]
    token = getattr(record, TOKEN)
    assert record.getMessage() == f"job job-fields: claimed, token {token}"
    assert (getattr(record, JOB_ID), getattr(record, ATTEMPT)) == ("job-fields", 1)
    assert isinstance(token, int) and token > 0
    assert getattr(record, OWNER).endswith(f"/{record.process}")


def test_a_dropped_duplicate_is_logged_with_its_job_id_only(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    task = leased(app)
    task.lease_store.claim(
        job_message("job-held", "tests.monitored", recorded=False), owner="elsewhere/1", duration=60
    )
    caplog.set_level(logging.INFO, logger="celery_leases")

    task.apply(task_id="job-held")

    dropped = [r for r in caplog.records if "message dropped" in r.getMessage()]
    assert len(dropped) == 1
    assert getattr(dropped[0], JOB_ID) == "job-held"
    assert not hasattr(dropped[0], TOKEN)  # not this delivery's: it claimed nothing


def test_the_collector_reports_every_state_from_the_table(app: Celery) -> None:
    task = leased(app)
    task.apply(task_id="job-done")
    task.lease_store.claim(
        job_message("job-running", "tests.monitored", recorded=False), owner="w/1", duration=60
    )
    registry = prometheus_client.CollectorRegistry()
    registry.register(JobsCollector(app))

    values = {
        state: registry.get_sample_value("celery_leases_jobs", {"state": state}) for state in STATES
    }

    assert values == {state: 0.0 for state in STATES} | {"done": 1.0, "running": 1.0}
    assert registry.get_sample_value("celery_leases_database_up") == 1.0


def test_the_collector_says_the_database_is_down_instead_of_reporting_zero_jobs() -> None:
    app = Celery("monitoring_down", set_as_current=False)
    app.conf.leases_database_url = "postgresql+psycopg://nobody@127.0.0.1:9/none"
    registry = prometheus_client.CollectorRegistry()
    registry.register(JobsCollector(app))  # registering runs no query

    assert registry.get_sample_value("celery_leases_database_up") == 0.0
    assert registry.get_sample_value("celery_leases_jobs", {"state": "queued"}) is None


@pytest.mark.parametrize(
    ("done", "total", "text"),
    [(733, 1200, "61% (733/1,200)"), (0, 10, "0% (0/10)"), (5, None, "5 done"), (3, 0, "3 done")],
)
def test_the_progress_text_flower_shows_reads_as_a_percentage(
    done: int, total: int | None, text: str
) -> None:
    assert progress_text(done, total) == text
