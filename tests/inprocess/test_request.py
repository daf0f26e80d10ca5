"""LeasedRequest as Celery's worker really builds it (``create_request_cls``), on a real
in-process broker (kombu's ``memory://``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery.worker.request import create_request_cls
from celery.worker.state import reserved_requests, task_reserved
from kombu import Consumer, Message

from celery_leases import LeasedTask
from celery_leases.worker.request import LeasedRequest
from celery_leases.worker.signals import SHUTTING_DOWN


class Pool:
    """Records what the worker would hand its pool (no process is started)."""

    def __init__(self) -> None:
        self.applied: list[Any] = []

    def apply_async(self, *args: Any, **kwargs: Any) -> None:
        self.applied.append((args, kwargs))


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("request-tests", broker="memory://", set_as_current=False)
    # A queue of its own: kombu's memory transport is one per process, shared by every test
    app.conf.task_default_queue = f"request-tests-{uuid.uuid4().hex[:8]}"

    def leased(self: Any) -> None:
        return None

    app.task(leased, base=LeasedTask, bind=True, name="tests.leased", shared=False)
    yield app
    app.close()


def received(app: Celery, connection: Any) -> Message:
    """The next message of the default queue, unacknowledged, as the worker receives it."""
    got: list[Message] = []
    queue = app.amqp.queues[app.conf.task_default_queue]
    with Consumer(connection, [queue], callbacks=[lambda _, message: got.append(message)]):
        connection.drain_events(timeout=5)
    assert len(got) == 1
    return got[0]


def request(app: Celery, message: Message, pool: Pool) -> Any:
    task = app.tasks["tests.leased"]
    cls = create_request_cls(LeasedRequest, task, pool, "w@host", None, app=app)
    return cls(
        message,
        on_reject=message.reject_log_error,
        app=app,
        hostname="w@host",
        task=task,
        connection_errors=(),
    )


def test_a_job_received_while_the_worker_shuts_down_goes_back_to_the_queue_and_never_runs(
    app: Celery,
) -> None:
    with app.connection_for_write() as connection:
        # Given a worker that is shutting down, and a leased job's message it then receives
        app.send_task("tests.leased", task_id="job-1")
        message = received(app, connection)
        pool = Pool()
        SHUTTING_DOWN.set()
        try:
            req = request(app, message, pool)
            task_reserved(req)

            # When the worker hands it to its pool, as Celery's own request class does
            with pytest.raises(TaskRevokedError):
                req.execute_using_pool(pool)
        finally:
            SHUTTING_DOWN.clear()

        # Then nothing ran here, the worker no longer counts it as reserved, and its message
        # is back in the queue for another worker
        assert pool.applied == []
        assert req not in reserved_requests
        again = received(app, connection)
        assert again.headers["id"] == "job-1"


def test_a_job_received_by_a_running_worker_goes_to_its_pool(app: Celery) -> None:
    with app.connection_for_write() as connection:
        app.send_task("tests.leased", task_id="job-2")
        pool = Pool()

        request(app, received(app, connection), pool).execute_using_pool(pool)

        assert len(pool.applied) == 1
