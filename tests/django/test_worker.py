"""A real worker of the example project, its pool process killed mid-batch: the job resumes
and every invoice is written exactly once (SQLite, PostgreSQL, MariaDB; Redis)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import pytest

from celery_leases.db.rows import Job
from tests.django.conftest import PROJECT, Shop
from tests.support.service import private_redis_url
from tests.support.worker import Spawner

T = TypeVar("T")
TASK = "billing.invoice_orders"


def wait_for(what: str, check: Callable[[], T | None], *, timeout: float = 60) -> T:
    """Poll ``check`` until it returns something (seconds ``timeout`` at most)."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.1)


def job_of(shop: Shop, batch: str) -> Job | None:
    for job in shop.store.list_jobs(task=TASK, limit=1000):
        if job.args[:1] == [batch]:
            return job
    return None


@pytest.mark.e2e
def test_a_killed_pool_process_job_resumes_and_every_invoice_is_written_once(
    shop: Shop, spawn: Spawner, queue_name: str
) -> None:
    batch = f"crash-{uuid.uuid4().hex[:8]}"
    with private_redis_url() as broker:
        celery = {"CELERY_BROKER_URL": broker, "CELERY_TASK_DEFAULT_QUEUE": queue_name}
        worker = spawn.worker("shop", env=shop.environment(**celery), cwd=PROJECT)

        # Given a batch of 12 invoices queued on commit and running, 4 of them committed
        shop.manage("invoice", batch, "12", "--pause", "0.3", **celery)
        started = wait_for(
            "4 invoices committed",
            lambda: j if (j := job_of(shop, batch)) and (j.progress_done or 0) >= 4 else None,
        )
        assert started.owner is not None and started.owner.startswith(worker.name)

        # When its pool process is killed
        (pool,) = worker.children()
        os.kill(pool, signal.SIGKILL)

        # Then the job resumes after its last checkpoint and ends done
        done = wait_for(
            "the job done", lambda: j if (j := job_of(shop, batch)) and j.state == "done" else None
        )
    invoices = shop.invoices(batch)
    numbers = [number for number, _, _ in invoices]
    assert sorted(numbers) == list(range(12)), invoices  # each once, none lost
    assert done.attempts == 2 and done.result == 12
    resumed = [number for number, attempt, _ in invoices if attempt == 2]
    assert resumed and min(resumed) == max(n for n, a, _ in invoices if a == 1) + 1
