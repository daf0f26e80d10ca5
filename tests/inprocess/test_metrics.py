"""Prometheus counters and the checkpoint histogram, labelled by task, move when leased tasks run
(in-process); the collector's gauges of job groups read the table."""

from __future__ import annotations

from collections.abc import Iterator

import prometheus_client
import pytest
from celery import Celery

import celery_leases
from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.store import store_for
from celery_leases.message import GROUP_HEADER
from celery_leases.metrics import JobsCollector
from tests.support.message import job_message


@pytest.fixture
def app(tmp_path: object) -> Iterator[Celery]:
    app = Celery("metrics", broker="memory://", set_as_current=False)
    app.conf.leases_database_url = f"sqlite:///{tmp_path}/leases.sqlite3"
    celery_leases.migrate(app)
    yield app
    store_for(settings_for(app)).engine.dispose()


def sample(name: str, task: str = "tests.metered") -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, {"task": task}) or 0.0


def test_claims_duplicates_and_checkpoint_latency_are_counted_by_task(app: Celery) -> None:
    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.metered")
    def metered(self: LeasedTask) -> int:
        self.checkpoint({"step": 1})
        self.checkpoint({"step": 2})
        return 2

    claims = sample("celery_leases_claims_total")
    dropped = sample("celery_leases_duplicates_dropped_total")
    checkpoints = sample("celery_leases_checkpoint_seconds_count")

    metered.apply(task_id="job-1")
    elsewhere = job_message("job-2", "tests.metered", recorded=False)
    metered.lease_store.claim(elsewhere, owner="elsewhere/1", duration=60.0)
    metered.apply(task_id="job-2")  # a live lease elsewhere holds it: dropped at its claim

    assert sample("celery_leases_claims_total") == claims + 1
    assert sample("celery_leases_duplicates_dropped_total") == dropped + 1
    assert sample("celery_leases_checkpoint_seconds_count") == checkpoints + 2


def test_the_collector_reports_the_busiest_groups_admitted_waiting_and_limit(app: Celery) -> None:
    # Given three groups: a (limit 1, 1 admitted, 2 waiting), b (limit 2, 1 admitted), c (no
    # limit, 1 waiting: its admission not run yet)
    store = store_for(settings_for(app))
    jobs = {"a": ["a1", "a2", "a3"], "b": ["b1"], "c": ["c1"]}
    for group, ids in jobs.items():
        for job_id in ids:
            store.register(job_message(job_id, "tests.grouped", **{GROUP_HEADER: group}))
    store.admit("a", limits=(1, None), define=True)
    store.admit("b", limits=(2, None), define=True)
    store.admit("c", limits=(None, None), define=True, most=0)

    # When a registry with a collector that exports two groups at most is scraped
    registry = prometheus_client.CollectorRegistry()
    registry.register(JobsCollector(app, max_groups=2))

    def gauge(name: str, group: str) -> float | None:
        return registry.get_sample_value(f"celery_leases_group_{name}", {"group": group})

    # Then it exports the two with the most waiting jobs, and counts all three
    assert registry.get_sample_value("celery_leases_groups") == 3.0
    assert [gauge("admitted", g) for g in "abc"] == [1.0, None, 0.0]
    assert [gauge("waiting", g) for g in "abc"] == [2.0, None, 1.0]
    assert [gauge("limit", g) for g in "abc"] == [1.0, None, None]
    assert registry.get_sample_value("celery_leases_database_up") == 1.0
