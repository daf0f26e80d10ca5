"""Prometheus counters and the checkpoint histogram, labelled by task, move when leased tasks run
(in-process)."""

from __future__ import annotations

from collections.abc import Iterator

import prometheus_client
import pytest
from celery import Celery

import celery_leases
from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.store import store_for
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
