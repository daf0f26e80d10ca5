"""Recording what a client publishes: a leased job's message is written to its row before it
goes to the broker, so the row is the truth from the first moment.

``LeasedTask.apply_async`` hands Celery a :class:`RecordingProducer`: it sees the message
exactly as Celery sends it (after ``before_task_publish`` receivers such as stamping have
changed it), and :class:`Recorder` records it, hands a retry's lease back, or coalesces a
trigger of a busy lease key (:class:`Coalesced`: nothing is published then).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import current_task

from . import lifecycle, routes
from .errors import ArgumentsError, StoreUnavailable
from .log import job_fields
from .message import GROUP_HEADER, KEY_HEADER, ROUTE_HEADER, Message

logger = logging.getLogger("celery_leases")


class Coalesced(Exception):
    """Raised through Celery's publish: the call was coalesced into job ``job_id``."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


class Waiting(Coalesced):
    """Raised through Celery's publish: job ``job_id`` is recorded and waits in the database
    for its admission in its group (its limit or its rate is reached): nothing is published
    now; its admission publishes it."""


class RecordingProducer:
    """A kombu ``Producer`` that hands each task message to ``record`` before publishing it,
    and publishes the message ``record`` returns (it adds the version header). An error from
    ``record`` stops the publish. Publish retries record once."""

    def __init__(self, producer: Any, record: Callable[[Message], Message | None]) -> None:
        self._producer = producer
        self._record = record
        self.recorded: Message | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(
        self,
        body: Any,
        *,
        exchange: str | None = None,
        routing_key: str | None = None,
        headers: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        headers = dict(headers or {})
        if self.recorded is None:
            serializer = options.get("serializer") or "json"
            if serializer != "json":
                raise ArgumentsError(
                    f"task {headers.get('task')} is sent with the {serializer!r} serializer: "
                    f"celery-leases stores a job's message as JSON only, and a resumed attempt "
                    f"must get the values the first one got; send leased tasks with the json "
                    f"serializer (task_serializer = 'json', Celery's default, or "
                    f"serializer='json' on the task)"
                )
            recorded = self._record(
                Message.published(
                    body=body,
                    headers=headers,
                    properties=options,
                    exchange=exchange,
                    routing_key=routing_key,
                    declare=options.get("declare"),
                )
            )
            if recorded is None:
                return None  # a retry held back until the attempt's body has returned
            self.recorded = recorded
        if headers.get("id") != self.recorded.id:  # a debounced trigger, moved into its job
            options["correlation_id"] = self.recorded.id
        headers.update(self.recorded.headers)
        return self._producer.publish(
            body, exchange=exchange, routing_key=routing_key, headers=headers, **options
        )


class Recorder:
    """Records the message one ``LeasedTask.apply_async`` publishes (``lifecycle.record``)."""

    def __init__(self, task: Any, *, group_limit: Any = None, group_rate: Any = None) -> None:
        self.task = task
        #: The call's ``lease_group_limit`` and ``lease_group_rate`` (the task's by default).
        self.group_limit = group_limit
        self.group_rate = group_rate
        #: The job recorded for this very message (deleted if its publish fails).
        self.registered: str | None = None
        #: The job a debounced trigger was moved into (its id is the caller's result).
        self.debounced: str | None = None
        #: The leases database the job is recorded in (``routes``; None: the only one).
        self.route: str | None = None

    def producer(self, publisher: Any) -> RecordingProducer:
        """``publisher`` (kombu's), recording through this recorder."""
        return RecordingProducer(publisher, self.record)

    def record(self, published: Message) -> Message | None:
        """The message to publish, recorded (its version header added); None when nothing is
        published now (a retry held back until the attempt's body has returned, or one its
        group's admission publishes). :class:`Coalesced` when another job serves the call,
        :class:`Waiting` when it waits in its group."""
        self.route = self.route_of(published)
        if self.route is not None:
            published = published.with_headers(**{ROUTE_HEADER: self.route})
        try:
            with routes.using(self.route):
                recording = lifecycle.record(
                    self.task, published, group_limit=self.group_limit, group_rate=self.group_rate
                )
        except StoreUnavailable as exc:
            if not current_task or current_task.request.called_directly:
                raise  # a client outside any task: nothing is published, the caller decides
            # Inside a task (a chain's next step, a chord body, a callback, a retry), failing
            # would break the workflow: the message goes out unrecorded, and its claim records
            # it, as for a message sent by name.
            logger.warning(
                "job %s: leases database unreachable, published without being recorded "
                "(its claim records it): %s",
                published.id,
                exc,
                extra=job_fields(published.id),
            )
            return published
        if recording.recorded:
            self.registered = recording.job_id
        if recording.coalesced:
            raise Coalesced(recording.job_id)
        if recording.waiting and recording.message is None:
            raise Waiting(recording.job_id)
        if recording.job_id != published.id:
            self.debounced = recording.job_id
        return recording.message

    def route_of(self, published: Message) -> str | None:
        """The leases database of the published message's job (None without routes): the one
        its header names, the running attempt's for a retry of it, else its route."""
        task = self.task
        settings = task._lease_cache().settings
        if not routes.routed(settings):
            return None
        named = routes.named(settings, published.headers)
        if named is not None:
            return named
        running = routes.active()
        if running is not None and current_task and current_task.request.id == published.id:
            return running  # a retry of the running attempt: its job lives where it runs
        queue = routes.queue_of(task.app, published.exchange, published.routing_key)
        routed_to = routes.route(settings, task.name, queue)
        name = routes.of_message(
            settings,
            published.id,
            routed_to=routed_to,
            recorded=published.version is not None,
        )
        if name != routed_to or published.version is not None:
            return name  # the job exists: it stays where it lives
        shared = task.lease_key or task.lease_group or published.headers.get(KEY_HEADER)
        if (shared or published.headers.get(GROUP_HEADER)) and name != task.lease_home():
            raise routes.split_call(task.name, queue, name, task.lease_home())
        return name

    def undo(self) -> None:
        """The publish failed: leave no queued row that no message will ever claim."""
        if self.registered is not None:
            with routes.using(self.route):
                lifecycle.forget(self.task, self.registered)


__all__ = ["Coalesced", "Recorder", "RecordingProducer", "Waiting"]
