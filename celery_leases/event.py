"""Progress as Celery events, for Flower and other event monitors.

After each checkpoint that carries progress, the attempt sends a ``task-progress`` event
(``Task.send_event``, the way Celery documents custom events for Flower). Celery's event state,
which Flower is built on, turns an unknown ``task-<name>`` event into the task's state
``<NAME>``: Flower then lists the task as ``PROGRESS``. Flower shows only the fields it knows
(``celery.events.state.Task._fields``), so the event also sets ``result`` to a short text
(``61% (733/1,200)``), which Flower shows in its Result column and on the task's page until the
real result replaces it. ``done``, ``total``, ``percent``, ``attempt`` and ``token`` carry the
figures for other monitors.

One broker publish per such checkpoint, no database work; not sent for eager or direct calls,
never retried (a broker that is down never delays a checkpoint). Sent when the worker sends
task events (``-E``, ``worker_send_task_events``, as Flower needs anyway), or always with
``leases_progress_events = True``; never with ``False``.

Sent by the pool process, while Celery's ``task-succeeded`` comes from the worker's main process
over another connection: a monitor can receive a task's last progress event after its end
(docs/operating.md, "Progress and Flower").
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_init

from .lease import Lease

logger = logging.getLogger("celery_leases")

#: Whether this worker sends task events (``-E``), as it started (its pool processes inherit
#: it); None outside a worker.
_worker_task_events: bool | None = None


def _note_task_events(sender: Any = None, **_: Any) -> None:
    global _worker_task_events
    _worker_task_events = bool(getattr(sender, "task_events", False))


def enabled(task: Any) -> bool:
    """Whether ``task``'s checkpoints send ``task-progress`` events."""
    chosen = task.lease_settings.progress_events
    return bool(_worker_task_events) if chosen is None else bool(chosen)


#: The event's type: Celery's event state makes it the task's state ``PROGRESS``.
PROGRESS_EVENT = "task-progress"


def progress_text(done: int, total: int | None) -> str:
    """``61% (733/1,200)``, or ``733 done`` without a total."""
    if not total:
        return f"{done:,} done"
    return f"{done * 100 // total}% ({done:,}/{total:,})"


def send_progress(task: Any, lease: Lease, done: int, total: int | None) -> None:
    """Send the ``task-progress`` event of a checkpoint that saved ``(done, total)``."""
    request = task.request
    if request.called_directly or request.is_eager or not enabled(task):
        return
    try:
        task.send_event(
            PROGRESS_EVENT,
            retry=False,
            done=done,
            total=total,
            percent=None if not total else round(done * 100 / total, 1),
            attempt=lease.attempt,
            token=lease.token,
            result=progress_text(done, total),
        )
    except Exception as exc:  # monitoring never fails a checkpoint
        logger.debug("could not send %s of %s: %r", PROGRESS_EVENT, request.id, exc)


#: Each signal and the receiver ``worker.connect`` connects to it.
RECEIVERS = ((worker_init, _note_task_events),)

__all__ = ["PROGRESS_EVENT", "RECEIVERS", "enabled", "progress_text", "send_progress"]
