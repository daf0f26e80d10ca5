"""A client's transitions: recording the job of a message about to be published (a new job, a
trigger of a busy lease key, a debounced trigger, a job of a group), and a running attempt's
retry (its lease handed back, the retry's message the job's).

``publish.Recorder`` calls :func:`record` with the message exactly as Celery publishes it, and
publishes what :class:`Recording` says (or nothing: the call was coalesced, or waits in its
group).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import groups, keys
from ..db.rows import Recorded
from ..db.store.base import Limits
from ..errors import ArgumentsError, Cancelled, Superseded
from ..lease import Lease, held, queued_by, until_deadline
from ..lease import recorded as record_end
from ..log import job_fields
from ..message import (
    COALESCE,
    DEBOUNCE_HEADER,
    GROUP_HEADER,
    KEY_HEADER,
    KEY_STRATEGY_HEADER,
    Message,
)
from ..states import State
from . import handon, run

logger = logging.getLogger("celery_leases")


@dataclass(frozen=True)
class Recording:
    """What a client's call comes to. ``message``: what to publish now (None: nothing);
    ``job_id``: the job that serves the call (another job's when coalesced or debounced);
    ``recorded``: a row was written for this very message (a publish that fails deletes it);
    ``coalesced``: served by another job, nothing published; ``waiting``: recorded in its
    group, nothing published until its admission."""

    message: Message | None
    job_id: str
    recorded: bool = False
    coalesced: bool = False
    waiting: bool = False


#: A call's option left to the task's own.
TASKS_OWN: Any = object()


def record(
    task: Any,
    published: Message,
    *,
    group_limit: Any = TASKS_OWN,
    group_rate: Any = TASKS_OWN,
) -> Recording:
    """Record the job of ``published`` (a message of ``task`` as Celery publishes it) and say
    what to publish. ``group_limit``, ``group_rate``: the call's (the task's by default)."""
    if group_limit is TASKS_OWN:
        group_limit = task.lease_group_limit
    if group_rate is TASKS_OWN:
        group_rate = task.lease_group_rate
    if inspect.ismethod(group_limit) and group_limit.__self__ is task:
        group_limit = group_limit.__func__  # a function given as the option became a method
    # A message Celery built from a recorded one (a retry, a re-send after a lost pool
    # process) carries that one's version; a fresh publish has none.
    fresh = published.version is None
    message = published.new_version()
    key = message.key or task.key_for(message.args, message.kwargs)
    if key is not None:
        message = message.with_headers(**{KEY_HEADER: key})
        if task.lease_key_strategy != COALESCE:  # unless this call says otherwise
            strategy = message.headers.get(KEY_STRATEGY_HEADER, task.lease_key_strategy)
            message = message.with_headers(**{KEY_STRATEGY_HEADER: strategy})
        if message.workflow:
            raise ArgumentsError(
                f"{message.task} has a lease key ({key!r}), and its call carries "
                f"{', '.join(message.workflow)}: a keyed call may be coalesced into "
                f"another job of its key, which would lose that workflow. Call it "
                f"without a lease key inside a canvas"
            )
    group = message.group or task.group_for(message.args, message.kwargs)
    limits: Limits = (None, None)
    if group is not None:
        message = message.with_headers(**{GROUP_HEADER: group})
        # Checked before anything is recorded: a bad limit or rate records nothing.
        limits = (groups.limit_of(group_limit, group), groups.rate_of(group_rate))
    countdown = max(message.eta_in() or 0.0, 0.0)
    lease = held(message.id)
    if lease is not None:
        return retry(task, lease, message, countdown)
    debounce = _debounce(task, message, key) if fresh else None
    if debounce is not None:
        countdown = debounce[0]
        message = _due(task, message, debounce, countdown)
    settings, store = task.lease_settings_and_store()
    if group is not None:
        # The group's row before its job: a client that dies between recording and admitting
        # leaves a waiting job whose group the reaper finds (and the limits this call gives).
        store.define_group(group, limits)
    outcome = store.register(
        message,
        countdown=countdown or None,
        queued_timeout=_queued_timeout(settings, key),
        fresh=fresh,
        debounce=debounce,
        # A plain job's message, published next, is its second copy: if a database crash
        # lost its unflushed record, its claim records it (docs/guarantees.md). A keyed or
        # grouped job's record decides what is published, so it is flushed.
        flush=settings.record_sync_commit or not (fresh and key is None and group is None),
    )
    if outcome.outcome == Recorded.DEBOUNCED:
        assert outcome.message is not None and debounce is not None
        logger.info(
            "job %s: key %s has a debounced job waiting, moved into job %s (due in %.2f s)",
            message.id,
            key,
            outcome.job_id,
            outcome.due_in or 0.0,
        )
        # Its job's message with the new due time (for a job waiting in its group: the
        # message that asks for its admission then); the copies sent before it are stale.
        moved = _due(task, outcome.message, debounce, outcome.due_in or 0.0)
        return Recording(moved, outcome.job_id)
    if outcome.outcome == Recorded.COALESCED:
        logger.info(
            "job %s: key %s has a live job, %s job %s",
            message.id,
            key,
            "its run is" if outcome.freed else "coalesced into",
            outcome.job_id,
        )
        if outcome.freed and key is not None:
            superseded = outcome.superseded
            handon.hand_on(
                task.app,
                store,
                handon.Ended(
                    key=key,
                    group=superseded.group if superseded and superseded.admitted else None,
                    task=message.task,
                    notices=superseded is not None,
                ),
            )
        return Recording(None, outcome.job_id, coalesced=True)
    if outcome.outcome in (Recorded.NEW, Recorded.TAKEN_OVER):
        if debounce is not None:  # its ETA from now: the row's due time is just written
            message = _due(task, message, debounce, countdown)
        if group is not None:
            return _admit(task, message, group, countdown, new=outcome.outcome == Recorded.NEW)
        return Recording(message, message.id, recorded=outcome.outcome == Recorded.NEW)
    logger.warning(
        "job %s is %s with another message: this one is a copy, dropped at its claim",
        message.id,
        outcome.outcome,
        extra=job_fields(message.id),
    )
    return Recording(message, message.id)


def _admit(task: Any, message: Message, group: str, due_in: float, *, new: bool) -> Recording:
    """Admit the oldest due waiting jobs of ``group``, ``message``'s job recorded waiting among
    them; publish the others admitted, and say to publish this one (with a countdown to its
    token's time) if it was. One due later (a countdown, a debounce) is published for its due
    time, to ask for its admission then; else it waits in the database."""
    store = task.lease_store
    try:
        admitted = store.admit(group)
    except Exception as exc:  # recorded, waiting, its group's row made: the reaper admits it
        logger.warning(
            "job %s: recorded in group %s, its admission failed (the reaper admits it): %r",
            message.id,
            group,
            exc,
            extra=job_fields(message.id),
        )
        return Recording(None, message.id, waiting=True)
    own = next((job for job in admitted if job.id == message.id), None)
    handon.publish(task.app, group, [job for job in admitted if job is not own])
    if own is not None:
        if own.due_in > 0:
            eta = (task.app.now() + timedelta(seconds=own.due_in)).isoformat()
            return Recording(message.with_headers(eta=eta), message.id, recorded=new)
        return Recording(message, message.id, recorded=new)
    if due_in > 0:
        logger.info(
            "job %s: recorded in group %s, due in %.2f s: asks for its admission then",
            message.id,
            group,
            due_in,
            extra=job_fields(message.id),
        )
        return Recording(message, message.id, recorded=new, waiting=True)
    logger.info(
        "job %s: recorded, waits for its admission in group %s",
        message.id,
        group,
        extra=job_fields(message.id),
    )
    return Recording(None, message.id, waiting=True)


def retry(task: Any, lease: Lease, message: Message, countdown: float) -> Recording:
    """A retry of the running attempt (Celery's ``self.retry()``): hand the lease back before
    the new message can reach another worker, or its claim would find the lease still held.
    If the retry message is lost (its worker dies holding it until its ETA), the reaper
    publishes the job again once it is overdue; a duplicate is dropped.

    A job of a group waits for its admission again, as every hand-back of one does: its next
    start is counted under the limit and takes a token of the rate. Due now, it is admitted
    here and the admission publishes it; due later, the retry's message goes for its due time
    and asks for its admission then.

    An attempt that wrote in a transaction of its caller's (``checkpoint(connection=)``,
    Django's ``atomic()``) may still be inside it, holding the job's row: the hand-back
    would wait for that transaction, which waits for the retry. The retry is then held
    back (nothing published now) and the attempt hands back and sends it once its body has
    raised, the caller's transaction ended (``Attempt.held_back``)."""
    if lease.joined_write and lease.joined is None:
        lease.held_back = ("retry", message, countdown)
        return Recording(None, message.id)
    return retry_now(task, lease, message, countdown)


def retry_now(
    task: Any, lease: Lease, message: Message, countdown: float, *, lost: bool = True
) -> Recording:
    """:func:`retry`, now (the attempt's body has returned, or never held the job's row in a
    transaction of its own). :class:`Cancelled` or :class:`Superseded` when a cancel or a
    supersede met it: the job has ended so."""
    state = hand_back_for_retry(task, lease, message, countdown, lost=lost)
    if state == State.CANCELLED:
        raise Cancelled(f"job {lease.job_id} was cancelled; not retried")
    if state == State.SUPERSEDED:
        raise Superseded(f"job {lease.job_id} was superseded; not retried")
    if lease.group is not None and countdown <= 0:
        return Recording(None, message.id)  # its hand-back asked for its admission
    return Recording(message, message.id)


def hand_back_for_retry(
    task: Any, lease: Lease, message: Message, countdown: float, *, lost: bool = False
) -> str | None:
    """Give ``lease`` back for a retry whose ``message`` becomes the job's, due ``countdown``
    seconds from now; the job's state after it (None: not handed back). Retried while the
    database is down or busy and the lease lasts: Celery would turn an error here into a
    failure of the job. A soft time limit inside the hand-back does not undo the retry the
    task asked for. ``lost``: when the lease runs out first, raise ``LeaseLost`` (else the
    error). What the hand-back leaves is handed on here (``run.handed_back``)."""
    settings, store = task.lease_settings_and_store()
    wait = settings.queued_timeout or settings.reap_grace
    state = record_end(
        write=lambda: until_deadline(
            lease,
            lambda: store.hand_back_retry(
                lease.job_id, lease.token, message, reap_in=countdown + wait, countdown=countdown
            ),
            waiting=f"the retry of job {lease.job_id} waits for the database",
            gave_up=f"job {lease.job_id}: the database stayed down; its retry is not sent",
            lost=lost,
        ),
        already=lambda: queued_by(store, lease),
    )
    lease.handed_back(state)
    run.handed_back(task, lease, state)
    return None if state is None else str(state)


def forget(task: Any, job_id: str) -> bool:
    """The publish of a job just recorded failed: delete its row, which no message would ever
    claim."""
    return bool(task.lease_store.forget(job_id))


def _debounce(task: Any, message: Message, key: str | None) -> tuple[float, float] | None:
    """The debounce of a call (``lease_debounce=`` of the call, or the task's option);
    :class:`ArgumentsError` for a debounce without a lease key or with a countdown."""
    option = message.headers.get(DEBOUNCE_HEADER)
    where = "lease_debounce"
    if option is None:
        option = getattr(task, "lease_debounce", None)
        where = f"lease_debounce of {task.name}"
    debounce = keys.debounce_of(option, where=where)
    if debounce is None:
        return None
    if key is None:
        raise ArgumentsError(f"{message.task}: a debounced call needs a lease key")
    if message.headers.get("eta"):
        raise ArgumentsError(
            f"{message.task}: a debounced call takes no countdown or eta: its quiet "
            f"period ({debounce[0]} s) is its countdown"
        )
    return debounce


def _due(task: Any, message: Message, debounce: tuple[float, float], due_in: float) -> Message:
    """``message`` as published: marked debounced, with an ETA ``due_in`` seconds away."""
    eta = (task.app.now() + timedelta(seconds=due_in)).isoformat()
    return message.with_headers(**{DEBOUNCE_HEADER: list(debounce), "eta": eta})


def _queued_timeout(settings: Any, key: str | None) -> float | None:
    """How long the job may wait queued before the reaper re-publishes it: the setting
    (``leases_queued_timeout``); for a job of a lease key, ``leases_reap_grace`` when that
    is off: a keyed job whose message never left (its sender died between recording and
    publishing it) would otherwise hold its key, and every trigger of it, for good."""
    timeout: float | None = settings.queued_timeout
    if timeout is None and key is not None:
        return float(settings.reap_grace)
    return timeout


__all__ = ["Recording", "forget", "hand_back_for_retry", "record", "retry", "retry_now"]
