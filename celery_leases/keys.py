"""Lease keys: the resource a job works on, so that at most one job per key is queued or
running, and a trigger that comes while one runs is served by one follow-up run.

The key of a call is computed here (:func:`key_of`); a trigger of a busy key is kept on the key
by the store (``Store.register``), where it survives any end of the job that holds the key;
settling the triggers of a key whose job ended is :func:`settle`, whoever ends the job (its
attempt, ``Task.replace``, the reaper for every other end).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from typing import Any

from .errors import ArgumentsError
from .notice import announce_pending

logger = logging.getLogger("celery_leases")


def key_of(task: Any, key: Any, args: Any, kwargs: Any, *, option: str = "lease_key") -> str | None:
    """The lease key ``key`` (a task's ``lease_key``: None, a format string or a callable)
    gives a call of ``task`` with ``args`` and ``kwargs``: a format string is formatted with
    the positional arguments and every argument by name (``"account:{account_id}"``).
    ``option``: the option's name in errors (``lease_group`` computes a group the same way)."""
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
            f"{option} {key!r} of {getattr(task, 'name', task)} cannot be computed from the "
            f"call's arguments (args {args!r}, kwargs {kwargs!r}): {exc!r}"
        ) from exc
    if not isinstance(found, str):
        raise ArgumentsError(
            f"{option} of {getattr(task, 'name', task)} must give a string, not {found!r}"
        )
    return found


def debounce_of(value: Any, *, where: Any = "lease_debounce") -> tuple[float, float] | None:
    """``lease_debounce`` checked: None, or (quiet, max_wait) in seconds, both finite, quiet
    above 0 and max_wait at least quiet; :class:`ArgumentsError` otherwise."""
    if value is None:
        return None
    try:
        quiet, max_wait = (float(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise ArgumentsError(
            f"{where} must be (quiet, max_wait) in seconds, such as (2.0, 30.0), not {value!r}"
        ) from exc
    if not (math.isfinite(quiet) and math.isfinite(max_wait) and 0 < quiet <= max_wait):
        raise ArgumentsError(
            f"{where} {value!r}: quiet must be above 0 and at most max_wait, both finite"
        )
    return quiet, max_wait


def settle(app: Any, store: Any, key: str, *, connection: Any = None) -> bool:
    """Settle the triggers waiting on ``key`` (``Store.settle``) now that its job has ended:
    publish the run started for them, or tell their callers the end of the run that served
    them; True when they were settled. A failure is logged, never raised: the reaper settles
    them at its next pass, and a run recorded but not published is re-published once its wait
    has passed."""
    try:
        settled = store.settle(key, connection=connection)
        if settled.followup is not None and settled.followup.group is not None:
            # Recorded waiting in its group: its admission publishes it.
            from .groups import admit

            admit(app, store, settled.followup.group)
        elif settled.followup is not None:
            settled.followup.send(app)
            logger.info(
                "lease key %s: the triggers that waited on it run as job %s",
                key,
                settled.followup.id,
            )
        if settled.served:
            announce_pending(app, store, batch=store.settings.reap_batch)
    except Exception as exc:
        logger.error(
            "lease key %s: could not settle the triggers waiting on it (the reaper will): %r",
            key,
            exc,
        )
        return False
    return settled.followup is not None or settled.served


def start_followup(app: Any, store: Any, job_id: str) -> str | None:
    """Record and send the follow-up a celery-leases before revision 0003 kept on the ended job
    ``job_id``; its id, or None. A failure is logged: the reaper tries again."""
    try:
        followup = store.start_followup(job_id)
        if followup is None:
            return None
        followup.send(app)
    except Exception as exc:
        logger.error("job %s: could not start the follow-up of its key: %r", job_id, exc)
        return None
    logger.info("job %s: ended; the follow-up run of its key is job %s", job_id, followup.id)
    return str(followup.id)


__all__ = ["debounce_of", "key_of", "settle", "start_followup"]
