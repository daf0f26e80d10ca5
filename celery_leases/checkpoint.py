"""Saving a checkpoint: the fenced write behind ``LeasedTask.checkpoint`` and ``stop_point``."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, NoReturn

from . import event, metrics
from .db import rows
from .db.joined import Joined, joined, refuse_unjoined
from .errors import Cancelled, CheckpointError, LeaseLost, Preempted, Superseded
from .lease import Lease, saved_checkpoint, until_deadline
from .lifecycle.run import why_refused
from .log import job_fields, lease_fields
from .signals import checkpoint_saved

logger = logging.getLogger("celery_leases")


def save(
    task: Any, lease: Lease, state: Any, *, progress: Any = None, connection: Any = None
) -> None:
    """Save ``state`` for ``lease``'s job, fenced by its token (``LeasedTask.checkpoint``): in
    the caller's transaction (``connection``, or the one this thread is in: ``joined``)."""
    settings, store = _settings_and_store(task, lease)
    text = _encoded(settings, lease, state, "checkpoint")
    done_total = _progress(progress)
    if lease.stop_seen:
        # The last checkpoint (in a transaction of the caller's) was told to stop, and the task
        # went on without calling stop_point(): stop before writing into this transaction.
        stop_point(lease)
    if lease.lost:
        raise LeaseLost(f"job {lease.job_id}: this attempt lost its lease; stop")
    stop = None
    transaction = None
    if not lease.detached:  # a direct call keeps its checkpoints in memory only
        started = time.monotonic()
        transaction = joined_by(store, lease, connection)
        saved, stop = _written(
            lease,
            transaction,
            lambda: store.checkpoint_in(
                transaction,
                lease.job_id,
                lease.token,
                text,
                progress=done_total,
                idle_limit=lease.duration,
            ),
            what="checkpoint",
        )
        metrics.checkpoint_seconds(time.monotonic() - started, task=task.name)
        if not saved:
            fenced_out(task, lease, "checkpoint")
        lease.deadline = started + lease.duration
        lease.last_progress = time.monotonic()
        if done_total is not None:
            _report_progress(task, *done_total)
            event.send_progress(task, lease, *done_total)
    saved_checkpoint(lease, text)
    checkpoint_saved.send(sender=task, lease=lease, progress=done_total)
    lease.stop_requested = stop or lease.stop_requested
    if lease.stop_requested is None:
        return
    # A checkpoint is a completed unit: it is saved first, then the attempt stops. Inside the
    # caller's transaction a raise would roll the checkpoint back: there the stop is raised by
    # stop_point() after the commit, or before the next checkpoint writes.
    lease.stop_seen = True
    if transaction is None:
        stop_point(lease)


def save_cursor(task: Any, lease: Lease, state: Any, *, connection: Any = None) -> None:
    """Save ``state`` as the cursor of ``lease``'s key, fenced by its token
    (``LeasedTask.save_cursor``), in the caller's transaction as :func:`save` is."""
    if lease.key is None:
        lease.cursor  # noqa: B018  (raises the no-key error)
    settings, store = _settings_and_store(task, lease)
    text = _encoded(settings, lease, state, "cursor")
    if lease.lost:
        raise LeaseLost(f"job {lease.job_id}: this attempt lost its lease; stop")
    if not lease.detached:
        key = str(lease.key)
        transaction = joined_by(store, lease, connection)
        saved = _written(
            lease,
            transaction,
            lambda: store.save_cursor_in(
                transaction,
                key,
                lease.job_id,
                lease.token,
                text,
                idle_limit=lease.duration,
            ),
            what="cursor",
        )
        if not saved:
            fenced_out(task, lease, "cursor")
    lease.cursor = json.loads(text)


def joined_by(store: Any, lease: Lease, connection: Any) -> Joined | None:
    """The caller's transaction a write of ``lease``'s attempt joins: ``connection``'s, the
    one the whole attempt runs in (it started inside one), or the one this thread is in
    (Django's ``atomic()`` on the leases' database); None: the store's own connection."""
    if connection is None and lease.joined is not None:
        return lease.joined  # type: ignore[no-any-return]
    transaction = joined(store, connection)
    if transaction is None and connection is None:
        refuse_unjoined(store, lease)
    if transaction is not None:
        lease.joined_write = True
    if transaction is not None and transaction.guard_idle:
        lease.idle_bounded = lease.idle_bounded or store.bounds_idle(transaction)
    return transaction


def _written(lease: Lease, transaction: Joined | None, write: Any, *, what: str) -> Any:
    """Run ``write``: in the caller's transaction at once (it cannot be retried there); on
    the store's own connection, retried while the database is unavailable and the lease has
    time left (``LeaseLost`` when it runs out)."""
    if transaction is not None:
        return write()
    return until_deadline(
        lease, write, waiting=f"{what} of job {lease.job_id} waits for the database", lost=True
    )


def fenced_out(task: Any, lease: Lease, what: str) -> NoReturn:
    """A write of ``lease``'s attempt was refused by its fence: it lost the lease (LeaseLost),
    said with why (:func:`lifecycle.why_refused`)."""
    lease.lost = True
    metrics.count("leases_lost", task=task.name)
    why = why_refused(task, lease, f"{what} not saved")
    if why is not None:
        logger.warning(
            "lease lost on job %s (token %s): %s; %s not saved",
            lease.job_id,
            lease.token,
            why,
            what,
            extra=lease_fields(lease),
        )
    raise LeaseLost(
        f"job {lease.job_id}: this attempt lost its lease ({why or 'commits lost'}); stop"
    )


def _settings_and_store(task: Any, lease: Lease) -> tuple[Any, Any]:
    """The task's settings and the store its attempt writes to (none for a direct call, which
    keeps its checkpoints in memory): those the attempt claimed with, carried by its lease."""
    carried = lease.carried
    if carried is not None:
        return carried
    if lease.detached:
        return task.lease_settings, None
    settings, store = task.lease_settings_and_store()
    return settings, store


def _encoded(settings: Any, lease: Lease, state: Any, what: str) -> str:
    """The JSON text of ``state``, or :class:`CheckpointError` (not JSON, or too large for
    ``settings``)."""
    try:
        text = rows.dumps(state)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} of job {lease.job_id} is not JSON-serializable ({exc}); "
            f"the previous {what} is kept"
        ) from exc
    # Its UTF-8 length: one byte a character for ASCII text, which is told without encoding it.
    size = len(text) if text.isascii() else len(text.encode())
    if size > settings.max_checkpoint_bytes:
        raise CheckpointError(
            f"{what} of job {lease.job_id} is {size} bytes, over "
            f"leases_max_checkpoint_bytes ({settings.max_checkpoint_bytes}); "
            f"the previous {what} is kept"
        )
    return text


def stop_point(lease: Lease) -> None:
    """Raise :class:`Cancelled`, :class:`Superseded` or :class:`Preempted` if ``lease``'s job
    was asked to stop, :class:`LeaseLost` if the lease is lost (renewals failed until it ended,
    or another attempt took the job): code between checkpoints stops there, not only at the
    next one."""
    if lease.lost:
        raise LeaseLost(f"job {lease.job_id}: this attempt lost its lease; stop")
    if lease.stop_requested == "cancel":
        raise Cancelled(f"job {lease.job_id} was cancelled; stopped at its checkpoint")
    if lease.stop_requested == "supersede":
        raise Superseded(
            f"job {lease.job_id} was superseded by a newer trigger of its lease key; stopped "
            f"at its checkpoint"
        )
    if lease.stop_requested == "preempt":
        raise Preempted(f"job {lease.job_id} handed back at its checkpoint (shutdown)")


def _report_progress(task: Any, done: int, total: int | None) -> None:
    if task.ignore_result or task.request.called_directly:
        return
    try:
        task.update_state(state="PROGRESS", meta={"done": done, "total": total})
    except Exception as exc:  # a result backend that cannot store states is not fatal
        logger.debug(
            "could not store PROGRESS of %s: %r",
            task.request.id,
            exc,
            extra=job_fields(task.request.id),
        )


def _progress(progress: Any) -> tuple[int, int | None] | None:
    if progress is None:
        return None
    if isinstance(progress, int) and not isinstance(progress, bool):
        return (progress, None)
    if (
        isinstance(progress, tuple | list)
        and len(progress) == 2
        and isinstance(progress[0], int)
        and (progress[1] is None or isinstance(progress[1], int))
    ):
        return (int(progress[0]), None if progress[1] is None else int(progress[1]))
    raise CheckpointError(f"progress must be done or (done, total) integers, not {progress!r}")
