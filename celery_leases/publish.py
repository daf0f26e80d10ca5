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
from datetime import timedelta
from typing import Any

from celery import current_task

from . import groups, keys
from .errors import ArgumentsError, Cancelled, StoreUnavailable, Superseded
from .lease import held, queued_by, until_deadline
from .lease import recorded as record_end
from .log import job_fields
from .message import (
    COALESCE,
    DEBOUNCE_HEADER,
    GROUP_HEADER,
    KEY_HEADER,
    KEY_STRATEGY_HEADER,
    Message,
)
from .notice import announce_pending

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
    """Records the message one ``LeasedTask.apply_async`` publishes."""

    def __init__(self, task: Any, *, group_limit: Any = None, group_rate: Any = None) -> None:
        self.task = task
        #: The call's ``lease_group_limit`` and ``lease_group_rate`` (the task's by default).
        self.group_limit = group_limit
        self.group_rate = group_rate
        #: The group's limit and rate (admissions a second), checked.
        self.limits: tuple[int | None, float | None] = (None, None)
        self.settings = task.lease_settings
        self.store = task.lease_store
        self.registered: str | None = None
        #: The job a debounced trigger was moved into (its id is the caller's result).
        self.debounced: str | None = None

    def producer(self, publisher: Any) -> RecordingProducer:
        """``publisher`` (kombu's), recording through this recorder."""
        return RecordingProducer(publisher, self.record)

    def record(self, published: Message) -> Message | None:
        """The message to publish, recorded (its version header added); None when it is held
        back (a retry the attempt sends once its body has returned: :meth:`_retry`)."""
        try:
            return self._record(published)
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

    def _record(self, published: Message) -> Message | None:
        # A message Celery built from a recorded one (a retry, a re-send after a lost pool
        # process) carries that one's version; a fresh publish has none.
        fresh = published.version is None
        recorded = published.new_version()
        key = recorded.key or self.task.key_for(recorded.args, recorded.kwargs)
        if key is not None:
            recorded = recorded.with_headers(**{KEY_HEADER: key})
            if self.task.lease_key_strategy != COALESCE:  # unless this call says otherwise
                strategy = recorded.headers.get(KEY_STRATEGY_HEADER, self.task.lease_key_strategy)
                recorded = recorded.with_headers(**{KEY_STRATEGY_HEADER: strategy})
            if recorded.workflow:
                raise ArgumentsError(
                    f"{recorded.task} has a lease key ({key!r}), and its call carries "
                    f"{', '.join(recorded.workflow)}: a keyed call may be coalesced into "
                    f"another job of its key, which would lose that workflow. Call it "
                    f"without a lease key inside a canvas"
                )
        group = recorded.group or self.task.group_for(recorded.args, recorded.kwargs)
        if group is not None:
            recorded = recorded.with_headers(**{GROUP_HEADER: group})
            if recorded.debounce is not None or getattr(self.task, "lease_debounce", None):
                raise ArgumentsError(
                    f"{recorded.task}: a debounced call cannot have a group (lease_group "
                    f"{group!r}): its due time is the debounce's"
                )
            # Checked before anything is recorded: a bad limit or rate records nothing.
            self.limits = (
                groups.limit_of(self.group_limit, group),
                groups.rate_of(self.group_rate),
            )
        countdown = max(recorded.eta_in() or 0.0, 0.0)
        lease = held(recorded.id)
        if lease is not None:
            return self._retry(lease, recorded, countdown)
        debounce = self._debounce(recorded, key) if fresh else None
        if debounce is not None:
            countdown = debounce[0]
            recorded = self._due(recorded, debounce, countdown)
        outcome = self.store.register(
            recorded,
            countdown=countdown or None,
            queued_timeout=self._queued_timeout(key),
            fresh=fresh,
            debounce=debounce,
        )
        if outcome.outcome == "debounced":
            assert outcome.message is not None and debounce is not None
            logger.info(
                "job %s: key %s has a debounced job waiting, moved into job %s (due in %.2f s)",
                recorded.id,
                key,
                outcome.job_id,
                outcome.due_in or 0.0,
            )
            self.debounced = outcome.job_id
            return self._due(outcome.message, debounce, outcome.due_in or 0.0)
        if outcome.outcome == "coalesced":
            logger.info(
                "job %s: key %s has a live job, %s job %s",
                recorded.id,
                key,
                "superseded it: its run is" if outcome.freed else "coalesced into",
                outcome.job_id,
            )
            if outcome.freed and key is not None:
                # It superseded the key's queued job: the key is free, its run starts now.
                keys.settle(self.task.app, self.store, key)
                announce_pending(
                    self.task.app, self.store, batch=self.settings.reap_batch, max_batches=1
                )
            raise Coalesced(outcome.job_id)
        if outcome.outcome == "new":
            self.registered = recorded.id
            if debounce is not None:  # its ETA from now: the row's due time is just written
                recorded = self._due(recorded, debounce, countdown)
        if group is not None and outcome.outcome in ("new", "taken over"):
            return self._admit(recorded, group)
        if outcome.outcome not in ("new", "taken over"):
            logger.warning(
                "job %s is %s with another message: this one is a copy, dropped at its claim",
                recorded.id,
                outcome.outcome,
                extra=job_fields(recorded.id),
            )
        return recorded

    def _admit(self, recorded: Message, group: str) -> Message:
        """Admit the oldest waiting jobs of ``group``, this one recorded waiting among them,
        writing the call's limit and rate as the group's; publish the others admitted, and
        return this one to publish (with a countdown to its token's time). :class:`Waiting`
        when it was not admitted: it waits in the database."""
        limit, rate = self.limits
        try:
            admitted = self.store.admit(group, limit=limit, rate=rate, define=True)
        except StoreUnavailable:
            self.registered = None  # recorded, waiting: the reaper admits it
            logger.warning(
                "job %s: recorded in group %s, its admission failed: the reaper admits it",
                recorded.id,
                group,
                extra=job_fields(recorded.id),
            )
            raise Waiting(recorded.id) from None
        own = next((job for job in admitted if job.id == recorded.id), None)
        groups.publish(self.task.app, group, [job for job in admitted if job is not own])
        if own is None:
            self.registered = None
            logger.info(
                "job %s: recorded, waits for its admission in group %s",
                recorded.id,
                group,
                extra=job_fields(recorded.id),
            )
            raise Waiting(recorded.id)
        if own.due_in > 0:
            eta = (self.task.app.now() + timedelta(seconds=own.due_in)).isoformat()
            return recorded.with_headers(eta=eta)
        return recorded

    def _debounce(self, recorded: Message, key: str | None) -> tuple[float, float] | None:
        """The debounce of a call (``lease_debounce=`` of the call, or the task's option);
        :class:`ArgumentsError` for a debounce without a lease key or with a countdown."""
        option = recorded.headers.get(DEBOUNCE_HEADER)
        where = "lease_debounce"
        if option is None:
            option = getattr(self.task, "lease_debounce", None)
            where = f"lease_debounce of {self.task.name}"
        debounce = keys.debounce_of(option, where=where)
        if debounce is None:
            return None
        if key is None:
            raise ArgumentsError(f"{recorded.task}: a debounced call needs a lease key")
        if recorded.headers.get("eta"):
            raise ArgumentsError(
                f"{recorded.task}: a debounced call takes no countdown or eta: its quiet "
                f"period ({debounce[0]} s) is its countdown"
            )
        return debounce

    def _due(self, message: Message, debounce: tuple[float, float], due_in: float) -> Message:
        """``message`` as published: marked debounced, with an ETA ``due_in`` seconds away."""
        eta = (self.task.app.now() + timedelta(seconds=due_in)).isoformat()
        return message.with_headers(**{DEBOUNCE_HEADER: list(debounce), "eta": eta})

    def _queued_timeout(self, key: str | None) -> float | None:
        """How long the job may wait queued before the reaper re-publishes it: the setting
        (``leases_queued_timeout``); for a job of a lease key, ``leases_reap_grace`` when that
        is off: a keyed job whose message never left (its sender died between recording and
        publishing it) would otherwise hold its key, and every trigger of it, for good."""
        timeout: float | None = self.settings.queued_timeout
        if timeout is None and key is not None:
            return float(self.settings.reap_grace)
        return timeout

    def _retry(self, lease: Any, recorded: Message, countdown: float) -> Message | None:
        """A retry of the running attempt: hand the lease back before the new message can
        reach another worker, or its claim would find the lease still held. If the retry
        message is lost (its worker dies holding it until its ETA), the reaper publishes the
        job again once it is overdue; a duplicate is dropped.

        An attempt that wrote in a transaction of its caller's (``checkpoint(connection=)``,
        Django's ``atomic()``) may still be inside it, holding the job's row: the hand-back
        would wait for that transaction, which waits for the retry. The retry is then held
        back (None: nothing published now) and the attempt hands back and sends it once its
        body has raised, the caller's transaction ended (``Attempt.retry_held_back``)."""
        if lease.joined_write and lease.joined is None:
            lease.held_back = ("retry", recorded, countdown)
            return None
        wait = self.settings.queued_timeout or self.settings.reap_grace
        # Retried while the database is down or busy (SQLite's write lock, a lock timeout)
        # and the lease lasts: Celery would turn an error here into a failure of the job.
        # A soft time limit inside the hand-back does not undo the retry the task asked for
        state = record_end(
            write=lambda: until_deadline(
                lease,
                lambda: self.store.hand_back_retry(
                    lease.job_id, lease.token, recorded, reap_in=countdown + wait
                ),
                waiting=f"the retry of job {lease.job_id} waits for the database",
                lost=True,
            ),
            already=lambda: queued_by(self.store, lease),
        )
        lease.released = state is not None
        if state == "cancelled":
            raise Cancelled(f"job {lease.job_id} was cancelled; not retried")
        if state == "superseded":
            raise Superseded(f"job {lease.job_id} was superseded; not retried")
        return recorded

    def undo(self) -> None:
        """The publish failed: leave no queued row that no message will ever claim."""
        if self.registered is not None:
            self.store.forget(self.registered)


__all__ = ["Coalesced", "Recorder", "RecordingProducer", "Waiting"]
