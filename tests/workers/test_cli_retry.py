"""``celery -A app leases retry`` with a real worker: the retried job resumes in it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.support.cli import APP, Cli, claim, record, store_of
from tests.support.service import celery_env
from tests.support.worker import Spawner


@pytest.mark.e2e
def test_a_retried_failed_job_resumes_from_its_checkpoint_in_a_worker(
    spawn: Spawner, sqlite_settings: dict[str, Any]
) -> None:
    # Given a job that failed after saving the checkpoint of step 3 of 5
    store = store_of(sqlite_settings)
    try:
        job_id = record(store)
        token = claim(store, job_id)
        store.checkpoint(job_id, token, json.dumps({"i": 3, "sum": 3}), progress=(3, 5))
        store.fail(job_id, token, error="RuntimeError: disk full")
        spawn.worker(APP, env=celery_env(sqlite_settings), pool="solo")

        # When an operator retries it (a `celery leases` process of its own, as in production)
        Cli(sqlite_settings, process=True).ok("retry", job_id)

        # Then a worker runs it again from step 3
        deadline = time.monotonic() + 30
        while (job := store.get(job_id)) is not None and job.state != "done":
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        assert job is not None
        assert job.result == {"started_from": 3, "i": 5, "sum": 10}
        assert (job.attempts, job.progress_done, job.progress_total) == (2, 5, 5)
    finally:
        store.engine.dispose()
