"""Job groups: at most ``lease_group_limit`` jobs of a group (a tenant, an upstream account)
in the broker or running at once, across every worker, and at most ``lease_group_rate``
admissions of it a second; a job over them waits in the database, recorded but not published.

The rules of a call's options only: its group (:func:`group_of`, as a lease key is), its limit
(:func:`limit_of`) and rate (:func:`rate_of`). The admission is the store's (``Store.admit``:
one transaction, the group's row locked), and who asks for it is ``lifecycle``'s: a client when
it records a job, every end or hand-back of a job of the group, a job's message that comes when
it is due, and the reaper for what those missed.
"""

from __future__ import annotations

import math
from typing import Any

from celery.utils.time import rate as celery_rate

from . import keys
from .errors import ArgumentsError


def group_of(task: Any, group: Any, args: Any, kwargs: Any) -> str | None:
    """The group ``group`` (a task's ``lease_group``: None, a format string over the call's
    arguments, or a callable taking them) gives a call of ``task``, as ``keys.key_of``."""
    return keys.key_of(task, group, args, kwargs, option="lease_group")


def limit_of(limit: Any, group: str, *, where: str = "lease_group_limit") -> int | None:
    """``lease_group_limit`` for ``group``: None (no limit), an int of at least 1, or a
    callable taking the group's name and returning one; :class:`ArgumentsError` otherwise."""
    found = limit(group) if callable(limit) else limit
    if found is None:
        return None
    if isinstance(found, bool) or not isinstance(found, int) or found < 1:
        raise ArgumentsError(
            f"{where} of group {group!r} must be an int of at least 1, not {found!r}"
        )
    return found


def rate_of(rate: Any, *, where: str = "lease_group_rate") -> float | None:
    """``lease_group_rate`` as admissions a second: None, or a rate as Celery's ``rate_limit``
    writes it (``"10/s"``, ``"10/m"``, ``"100/h"``, or a number a second), above 0."""
    if rate is None:
        return None
    try:
        found = float(celery_rate(rate))
    except (KeyError, TypeError, ValueError) as exc:
        raise ArgumentsError(
            f"{where} must be a rate such as '10/s', '10/m' or '100/h', not {rate!r}"
        ) from exc
    if not (math.isfinite(found) and found > 0):
        raise ArgumentsError(f"{where} {rate!r} must be above 0")
    return found


def rate_text(rate: float) -> str:
    """A group's rate (admissions a second, as stored) as a user writes it: ``"10/m"`` for
    10 a minute, the first of ``/s``, ``/m``, ``/h`` that makes it a whole number;
    else admissions a second (``"1.5e-05/s"``)."""
    for unit, seconds in (("s", 1), ("m", 60), ("h", 3600)):
        count = rate * seconds
        if count >= 1 and abs(count - round(count)) <= 1e-6 * count:
            return f"{round(count)}/{unit}"
    return f"{rate:g}/s"


__all__ = ["group_of", "limit_of", "rate_of", "rate_text"]
