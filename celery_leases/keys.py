"""Lease keys: the resource a job works on, so that at most one job per key is queued or
running, and a trigger that comes while one runs is served by one follow-up run.

The key of a call is computed here (:func:`key_of`); recording a trigger is the store's
(``Store.register`` / ``coalesce``); starting the follow-up of a job that ended is
:func:`start_followup`, whoever ends the job (its attempt, ``Task.replace``, the reaper).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

from .errors import ArgumentsError

logger = logging.getLogger("celery_leases")


def key_of(task: Any, key: Any, args: Any, kwargs: Any) -> str | None:
    """The lease key ``key`` (a task's ``lease_key``: None, a format string or a callable)
    gives a call of ``task`` with ``args`` and ``kwargs``: a format string is formatted with
    the positional arguments and every argument by name (``"account:{account_id}"``)."""
    if key is None:
        return None
    if inspect.ismethod(key) and key.__self__ is task:
        key = key.__func__  # a function given as the option became a method of the task
    args, kwargs = list(args or ()), dict(kwargs or {})
    try:
        if callable(key):
            found = key(*args, **kwargs)
        else:
            named = dict(kwargs)
            with contextlib.suppress(TypeError, ValueError):  # a call the signature refuses
                named = dict(inspect.signature(task.run).bind_partial(*args, **kwargs).arguments)
            found = str(key).format(*args, **named)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ArgumentsError(
            f"lease_key {key!r} of {getattr(task, 'name', task)} cannot be computed from the "
            f"call's arguments (args {args!r}, kwargs {kwargs!r}): {exc!r}"
        ) from exc
    if not isinstance(found, str):
        raise ArgumentsError(
            f"lease_key of {getattr(task, 'name', task)} must give a string, not {found!r}"
        )
    return found


def start_followup(app: Any, store: Any, job_id: str) -> str | None:
    """Record and send the follow-up run of the ended keyed job ``job_id``, if a trigger of
    its key waits for one; the follow-up's id, or None. A failure is logged, never raised:
    the reaper starts it then (``reaper.reap``), or its queued timeout re-publishes it."""
    try:
        followup = store.start_followup(job_id)
        if followup is None:
            return None
        followup.send(app)
    except Exception as exc:
        logger.error(
            "job %s: could not start the follow-up run of its key (the reaper will): %r",
            job_id,
            exc,
        )
        return None
    logger.info("job %s: ended; the follow-up run of its key is job %s", job_id, followup.id)
    return str(followup.id)


__all__ = ["key_of", "start_followup"]
