"""Job groups: at most ``lease_group_limit`` jobs of a group (a tenant, an upstream account)
in the broker or running at once, across every worker, and at most ``lease_group_rate``
admissions of it a second; a job over them waits in the database, recorded but not published.

A call's group is computed here (:func:`group_of`, as a lease key is); the admission is the
store's (``Store.admit``: one transaction, the group's row locked); :func:`admit` publishes
what it admitted. A client admits when it records a job, the worker that ends a job admits the
next ones of its group, and the reaper admits what those missed (:func:`admit_waiting`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from celery.utils.time import rate as celery_rate

from . import keys, metrics
from .errors import ArgumentsError

logger = logging.getLogger("celery_leases")


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


def admit(app: Any, store: Any, group: str, *, most: int | None = None) -> list[str]:
    """Admit the oldest waiting jobs of ``group`` its limit and bucket allow (``Store.admit``)
    and publish them, each with a countdown to its token's time; their ids. A failure is
    logged, never raised: the reaper admits them at its next pass, and a job admitted but
    not published is re-published once its wait has passed."""
    try:
        admitted = store.admit(group, most=most)
    except Exception as exc:
        logger.error("group %s: could not admit its waiting jobs (the reaper will): %r", group, exc)
        return []
    return publish(app, group, admitted)


def make_room(app: Any, store: Any, job: Any) -> list[str]:
    """``job`` ended outside any attempt (an operator's cancel, Celery's revoke in a worker):
    if it was admitted in a group, its room goes to the group's next waiting job now, not at
    the reaper's next pass; the ids published."""
    if job is None or job.lease_group is None or job.admitted_at is None:
        return []
    return admit(app, store, job.lease_group)


def publish(app: Any, group: str, admitted: list[Any]) -> list[str]:
    """Publish the jobs ``admitted`` in ``group``; the ids sent."""
    sent: list[str] = []
    for job in admitted:
        try:
            job.message.send(app, countdown=job.due_in if job.due_in > 0 else None)
        except Exception as exc:  # admitted: the reaper re-publishes it after its wait
            logger.error("job %s: admitted in group %s, publish failed: %r", job.id, group, exc)
            continue
        sent.append(job.id)
        metrics.count("admitted", task=job.message.task)
        logger.info(
            "job %s: admitted in group %s%s",
            job.id,
            group,
            f", runs in {job.due_in:.2f} s" if job.due_in > 0 else "",
        )
    return sent


def admit_waiting(app: Any, store: Any, *, batch: int) -> list[str]:
    """The reaper's admission: the groups with waiting jobs (the longest since an admission
    first), one job of each in turn (round-robin) until none admits more; the ids published.
    It serves the groups whose job ended where nothing admitted the next (its worker died,
    an older release ended it, it ended outside any attempt: revoked, cancelled, given up)."""
    try:
        waiting = store.groups_waiting(batch=batch)
    except Exception as exc:
        logger.error("cannot read the groups with waiting jobs: %r", exc)
        return []
    sent: list[str] = []
    for _ in range(batch):
        if not waiting:
            break
        still = []
        for group in waiting:
            try:
                admitted = store.admit(group, most=1)
            except Exception as exc:
                logger.error("group %s: could not admit its waiting jobs: %r", group, exc)
                continue
            if admitted:
                sent += publish(app, group, admitted)
                still.append(group)
        waiting = still
    return sent


__all__ = [
    "admit",
    "admit_waiting",
    "group_of",
    "limit_of",
    "make_room",
    "publish",
    "rate_of",
    "rate_text",
]
