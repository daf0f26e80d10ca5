"""The test infrastructure itself: real workers and beat on real brokers."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from tests.support.service import celery_client, celery_env
from tests.support.worker import Spawner, pid_exists

pytestmark = pytest.mark.e2e

PLAIN_APP = "tests.support.apps.plain_app"


def wait_until_gone(pids: list[int], timeout: float = 5) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if pid_exists(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_a_real_worker_runs_a_task_and_dies_with_its_pool_on_sigkill(
    spawn: Spawner, celery_settings: dict[str, Any]
) -> None:
    settings = {**celery_settings, "result_backend": "rpc://"}
    worker = spawn.worker(PLAIN_APP, env=celery_env(settings), concurrency=1)
    with celery_client(settings) as client:
        assert client.send_task("plain.add", args=(2, 3)).get(timeout=10) == 5
    pool = worker.children()
    assert len(pool) == 1

    worker.kill()

    assert worker.wait(timeout=5) == -signal.SIGKILL
    assert wait_until_gone([worker.pid, *pool]) == []


def test_a_worker_and_beat_run_on_the_filesystem_broker(
    spawn: Spawner, filesystem_broker: dict[str, Any]
) -> None:
    # Given a beat that sends plain.add(20, 22) every half second
    settings = {
        **filesystem_broker,
        "beat_schedule": {"add": {"task": "plain.add", "schedule": 0.5, "args": [20, 22]}},
    }
    worker = spawn.worker(PLAIN_APP, env=celery_env(settings))
    beat = spawn.beat(PLAIN_APP, env=celery_env(settings), max_interval=1)

    # Then the worker runs it
    worker.wait_for_log(r"Task plain\.add\[\S+\] succeeded in \S+: 42", timeout=10)
    assert "Scheduler: Sending due task add (plain.add)" in beat.log_text()
    assert beat.schedule_path.parent == worker.log_path.parent
