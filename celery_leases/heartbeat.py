"""Is a reaper running? Each pass records itself (the reaper's heartbeat, ``db/store/heartbeat``),
and whatever shows the jobs warns when none happened for several intervals: a worker at its
start and then periodically, ``leases list`` and ``watch``, the Django admin; the metrics
export its age (``celery_leases_reaper_last_pass_age_seconds``).

Without a reaper (beat forgotten, or down), nothing sends a killed worker's jobs again: they
stay ``running`` with an expired lease, and nothing else says why.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any

from .db.store.heartbeat import ReaperPass, last_pass, record_pass
from .errors import LeaseError

logger = logging.getLogger("celery_leases.reaper")

#: A warning comes after this many reaper intervals without a pass...
SILENT_INTERVALS = 5
#: ... and never before this many seconds (a deploy restarting beat is not a silence).
MIN_SILENCE = 60.0
#: The reaper's interval when the app's beat schedule does not say (``schedule_reaper``'s).
DEFAULT_EVERY = 10.0


def record(store: Any) -> None:
    """Record a reaper pass that ends now, by this process; a failure is logged, never raised
    (the pass did its work)."""
    try:
        record_pass(store, f"{socket.gethostname()}/{os.getpid()}")
    except LeaseError as exc:
        logger.warning("celery-leases: could not record this reaper pass: %s", exc)


def reaper_every(app: Any) -> float:
    """Seconds between reaper passes in ``app``'s beat schedule (``schedule_reaper``), or
    :data:`DEFAULT_EVERY` when it has no reaper entry (kept in django-celery-beat's database,
    say)."""
    from .reaper import REAP_TASK

    for entry in (app.conf.beat_schedule or {}).values():
        if not isinstance(entry, dict) or entry.get("task") != REAP_TASK:
            continue
        every = entry.get("schedule")
        if isinstance(every, datetime.timedelta):
            return every.total_seconds()
        if isinstance(every, int | float):
            return float(every)
        run_every = getattr(every, "run_every", None)  # celery.schedules.schedule
        if isinstance(run_every, datetime.timedelta):
            return run_every.total_seconds()
    return DEFAULT_EVERY


def silence_after(app: Any) -> float:
    """Seconds without a reaper pass after which it counts as missing."""
    return max(SILENT_INTERVALS * reaper_every(app), MIN_SILENCE)


def silence(app: Any, store: Any, *, watched: float | None = None) -> str | None:
    """What to warn when no reaper pass happened for :func:`silence_after` seconds ("no
    reaper pass for 5 min: is beat running?"), None when one did. ``watched``: seconds the
    caller has been up (a worker), before which a table with no pass recorded at all is not
    a warning yet (beat may start after the workers). :class:`LeaseError` when the table
    cannot be read."""
    limit = silence_after(app)
    last = last_pass(store)
    if last is None:
        if watched is not None and watched < limit:
            return None
        return f"no reaper pass recorded: {_advice()}"
    if last.age < limit:
        return None
    return f"no reaper pass for {duration(last.age)} (the last by {last.owner}): {_advice()}"


def _advice() -> str:
    from .reaper import REAP_TASK

    return (
        f"is beat running? Without {REAP_TASK}, a killed worker's jobs are never sent "
        f"again (schedule_reaper(app), then celery -A proj beat)"
    )


def duration(seconds: float) -> str:
    """``seconds`` for people: ``45 s``, ``5 min``, ``3 h``, ``2 d``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


__all__ = [
    "ReaperPass",
    "duration",
    "last_pass",
    "reaper_every",
    "record",
    "silence",
    "silence_after",
]
