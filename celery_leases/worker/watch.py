"""A worker's watch for a missing reaper: at its start, then every few reaper intervals, its
main process warns when no reaper pass happened for a while (``heartbeat.silence``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.signals import worker_ready

from .. import heartbeat
from ..config import settings_for, uses_leases
from ..db import store_for
from ..errors import LeaseError

logger = logging.getLogger("celery_leases.reaper")


class ReaperWatch:
    """Warns, in a worker's log, while no reaper pass happens (:meth:`check` is the body)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.started = time.monotonic()

    def check(self) -> str | None:
        """Look once; the warning logged, if any."""
        try:
            store = store_for(settings_for(self.app))
            warning = heartbeat.silence(self.app, store, watched=time.monotonic() - self.started)
        except LeaseError as exc:  # the database is down: other warnings say so
            logger.debug("celery-leases: cannot read the reaper's last pass: %s", exc)
            return None
        if warning is not None:
            logger.warning("celery-leases: %s", warning)
        return warning


def watch_the_reaper(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` (the main process): look now, then every :func:`heartbeat.silence_after`
    seconds, on the worker's timer."""
    app = getattr(sender, "app", None)
    timer = getattr(sender, "timer", None)
    if app is None or not uses_leases(app):
        return
    watch = ReaperWatch(app)
    watch.check()
    if timer is not None:
        timer.call_repeatedly(heartbeat.silence_after(app), watch.check)


#: Each signal and the receiver ``worker.connect`` connects to it.
RECEIVERS = ((worker_ready, watch_the_reaper),)

__all__ = ["RECEIVERS", "ReaperWatch", "watch_the_reaper"]
