"""The main process's watch over pool processes (request.Deaths): a death is seen at once,
for the last job the process took, once; a process that lives is left alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

from celery_leases.worker.deaths import Deaths

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="pidfd_open is Linux-only"
)


class Job:
    """Stands in for a LeasedRequest: records that the watch asked it to resume."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.resumed = threading.Event()
        self.calls = 0

    def resume_after_death(self) -> None:
        self.calls += 1
        self.resumed.set()


@pytest.fixture
def deaths() -> Deaths:
    """A watch of this process's own (it would be the worker's main process)."""
    watch = Deaths()
    watch.start()
    return watch


def sleeper() -> subprocess.Popen[Any]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_killed_process_has_its_last_job_resumed_once(deaths: Deaths) -> None:
    # Given a process that took one job, then another
    process = sleeper()
    first, second = Job("first"), Job("second")
    deaths.watch(first, process.pid)  # type: ignore[arg-type]
    deaths.watch(second, process.pid)  # type: ignore[arg-type]
    try:
        # When it is SIGKILLed
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

        # Then the job it ran last is resumed, once; the one it had finished is not
        assert second.resumed.wait(timeout=10)
    finally:
        process.kill()
    assert second.calls == 1
    assert first.calls == 0


def test_a_living_process_is_left_alone_and_each_process_is_watched_apart(
    deaths: Deaths,
) -> None:
    living, dying = sleeper(), sleeper()
    kept, lost = Job("kept"), Job("lost")
    deaths.watch(kept, living.pid)  # type: ignore[arg-type]
    deaths.watch(lost, dying.pid)  # type: ignore[arg-type]
    try:
        dying.send_signal(signal.SIGKILL)
        dying.wait(timeout=10)
        assert lost.resumed.wait(timeout=10)
        assert not kept.resumed.is_set()
    finally:
        living.kill()
        living.wait(timeout=10)
    assert kept.resumed.wait(timeout=10)  # and its death, when it comes, is seen too


def test_a_process_already_gone_is_not_watched(deaths: Deaths) -> None:
    process = sleeper()
    process.kill()
    process.wait(timeout=10)  # reaped: its pid names no process now
    job = Job("gone")
    deaths.watch(job, process.pid)  # type: ignore[arg-type]
    assert not job.resumed.wait(timeout=0.5)
