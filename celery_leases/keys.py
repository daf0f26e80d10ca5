"""Lease keys: the resource a job works on, so that at most one job per key is queued or
running, and a trigger that comes while one runs is served by one follow-up run.

The rules of a call's options only: its key (:func:`key_of`) and its debounce
(:func:`debounce_of`). A trigger of a busy key is kept on the key by the store
(``Store.register``), where it survives any end of the job that holds the key; what a key's end
hands on is ``lifecycle.handon``'s.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any

from .errors import ArgumentsError


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


__all__ = ["debounce_of", "key_of"]
