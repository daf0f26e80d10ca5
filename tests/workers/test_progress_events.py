"""Progress reaches event monitors as Flower sees it: a real worker sends ``task-progress``
events, and Celery's event state (what Flower is built on) shows the task as PROGRESS with the
progress text as its result, until it succeeds."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.events.state import State

from tests.support.service import celery_client, celery_env
from tests.support.worker import Spawner

pytestmark = pytest.mark.e2e

PROGRESS_APP = "tests.support.apps.progress_app"


class Monitor:
    """What a Flower-like monitor sees: every event applied to a ``State``, and the task's
    (state, result) right after each one.

    Entering returns once an event this monitor sent itself has come back: kombu's Redis
    transport subscribes to the events channel only at the first poll after the consumer is
    ready, and an event published before that is lost to the monitor."""

    def __init__(self, app: Any) -> None:
        self.state = State()
        self.seen: list[tuple[str, dict[str, Any], str, Any]] = []
        self.ready = threading.Event()
        self.listening = threading.Event()
        self.done = threading.Event()
        self.progressed = threading.Event()  # ``progress_wanted`` task-progress events seen
        self.progress_wanted = 0
        self._app = app
        self._connection = app.connection_for_read()
        self.receiver = app.events.Receiver(self._connection, handlers={"*": self.on_event})
        self.receiver.on_consume_ready = lambda *a, **k: self.ready.set()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def on_event(self, event: dict[str, Any]) -> None:
        if event["type"] == "monitor-probe":
            self.listening.set()
            return
        self.state.event(event)
        if event["type"].startswith("task-"):
            task = self.state.tasks[event["uuid"]]
            self.seen.append((event["type"], event, task.state, task.result))
            if sum(kind == "task-progress" for kind, *_ in self.seen) == self.progress_wanted:
                self.progressed.set()
            if event["type"] == "task-succeeded":
                self.done.set()
                self.receiver.should_stop = True

    def _run(self) -> None:
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> Monitor:
        self.thread.start()
        assert self.ready.wait(30), "the event receiver never started consuming"
        with self._app.events.default_dispatcher() as dispatcher:
            for _ in range(300):
                dispatcher.send("monitor-probe")
                if self.listening.wait(0.1):
                    return self
        raise AssertionError("the event receiver never received its own probe event")

    def __exit__(self, *exc: object) -> None:
        self.receiver.should_stop = True
        self.thread.join(10)
        self._connection.release()


@pytest.fixture
def settings(
    celery_settings: dict[str, Any], database_url: str, table_name: str
) -> Iterator[dict[str, Any]]:
    yield {
        **celery_settings,
        "leases_database_url": database_url,
        "leases_table": table_name,
        "worker_send_task_events": True,  # -E, as Flower wants (task-progress goes anyway)
    }


def test_each_checkpoint_with_progress_shows_in_the_event_state_as_progress(
    spawn: Spawner, settings: dict[str, Any], tmp_path: Path
) -> None:
    spawn.worker(PROGRESS_APP, env=celery_env(settings))
    release = tmp_path / "release"
    with celery_client(settings) as client, Monitor(client) as monitor:
        monitor.progress_wanted = 4
        # The task waits after its last checkpoint until the monitor has seen the four events:
        # the pool process sends task-progress and the main process task-succeeded, over two
        # broker connections, so a task that ends at once can have its last progress event
        # arrive after task-succeeded (as the module's docstring says).
        result = client.send_task("progress.hold", args=(4, 4, str(release)))
        assert monitor.progressed.wait(60), f"not four task-progress events; saw {monitor.seen}"
        release.touch()
        assert monitor.done.wait(60), f"no task-succeeded event; saw {monitor.seen}"

    progress = [
        (e, state, shown) for kind, e, state, shown in monitor.seen if kind == "task-progress"
    ]
    assert [(e["done"], e["total"], e["percent"]) for e, _, _ in progress] == [
        (1, 4, 25.0),
        (2, 4, 50.0),
        (3, 4, 75.0),
        (4, 4, 100.0),
    ]
    assert {(e["attempt"], e["uuid"]) for e, _, _ in progress} == {(1, result.id)}
    tokens = {e["token"] for e, _, _ in progress}  # one attempt: one token
    assert len(tokens) == 1 and all(isinstance(t, int) and t > 0 for t in tokens), tokens
    assert [(state, shown) for _, state, shown in progress] == [
        ("PROGRESS", "25% (1/4)"),
        ("PROGRESS", "50% (2/4)"),
        ("PROGRESS", "75% (3/4)"),
        ("PROGRESS", "100% (4/4)"),
    ]
    task = monitor.state.tasks[result.id]
    assert (task.state, task.result, task.name) == ("SUCCESS", "4", "progress.hold")


def test_no_progress_event_is_sent_when_progress_events_are_off(
    spawn: Spawner, settings: dict[str, Any]
) -> None:
    settings = {**settings, "leases_progress_events": False}
    spawn.worker(PROGRESS_APP, env=celery_env(settings))
    with celery_client(settings) as client, Monitor(client) as monitor:
        result = client.send_task("progress.count", args=(3,))
        assert monitor.done.wait(60), f"no task-succeeded event; saw {monitor.seen}"

    kinds = [kind for kind, event, _, _ in monitor.seen if event["uuid"] == result.id]
    assert kinds == ["task-received", "task-started", "task-succeeded"]
