"""Flower itself shows a leased task's progress: a real ``celery flower`` beside a real worker.

Flower lists the task as ``PROGRESS`` and shows the progress text in its Result field while
the task runs (the ``task-progress`` event, ``celery_leases.event``), then ``SUCCESS`` and
the real result. Skipped when Flower is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import html
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import migrate_table
from tests.support.service import celery_client, celery_env
from tests.support.worker import CeleryProcess, Spawner

pytest.importorskip("flower")
pytestmark = pytest.mark.e2e

PROGRESS_APP = "tests.support.apps.progress_app"


class Flower(CeleryProcess):
    """``celery -A <app_module> flower --address=127.0.0.1 --port=<port>``."""

    command_name = "flower"
    ready_pattern = re.compile(r"Visit me at http")

    def __init__(self, app_module: str, *, port: int, **options: Any) -> None:
        super().__init__(app_module, **options)
        self.port = port

    def args(self) -> list[str]:
        return ["flower", "--address=127.0.0.1", f"--port={self.port}", "--logging=info"]

    def page(self, path: str) -> str | None:
        """The page's text, or None while Flower does not know it (404)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return str(r.read().decode())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def task_page_until(flower: Flower, task_id: str, *wanted: str, timeout: float = 60) -> str:
    """Flower's page of the task once it shows every one of ``wanted`` (tags stripped)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        page = flower.page(f"/task/{task_id}")
        text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page or "")).split())
        if all(w in text for w in wanted):
            return text
        time.sleep(0.2)
    raise AssertionError(f"Flower's task page never showed {wanted}; last: {text[-2000:]}")


def test_flower_shows_the_running_tasks_progress_then_its_result(
    spawn: Spawner, celery_settings: dict[str, Any], tmp_path: Path
) -> None:
    settings = {
        **celery_settings,
        "leases_database_url": f"sqlite:///{tmp_path}/leases.sqlite3",
        "worker_send_task_events": True,
    }
    migrate_table(settings["leases_database_url"], "celery_leases_jobs")
    env = celery_env(settings)
    worker = spawn.worker(PROGRESS_APP, env=env)
    flower = Flower(PROGRESS_APP, port=free_port(), env=env, log_dir=spawn.log_dir)
    spawn.processes.append(flower)
    flower.start(timeout=60)
    # Flower lists a worker once its events reach it (heartbeats): only then does it see a
    # task's events from the start.
    deadline = time.monotonic() + 60
    while worker.name not in (flower.page("/workers?json=1") or ""):
        assert time.monotonic() < deadline, "Flower never heard from the worker"
        time.sleep(0.5)
    release = tmp_path / "release"

    with celery_client(settings) as client:
        result = client.send_task("progress.hold", args=(4, 2, str(release)))

        running = task_page_until(flower, result.id, "Status PROGRESS", "Result 50% (2/4)")
        release.touch()
        done = task_page_until(flower, result.id, "Status SUCCESS")

    assert "Name progress.hold" in running
    assert "Result 4" in done
    assert "50% (2/4)" not in done
