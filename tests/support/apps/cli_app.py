"""A celery-leases app for the ``celery -A tests.support.apps.cli_app leases ...`` tests.

Settings (``leases_database_url``, ``leases_table``, broker) come from ``TEST_CELERY_CONFIG``
(see ``tests.support.service.celery_env``); without them the broker is ``memory://``.
"""

from __future__ import annotations

import time
from typing import Any

from celery_leases import LeasedTask
from tests.support.apps.factory import make_app

app = make_app(
    "cli_app", variables="celery_env", defaults={"broker_url": "memory://"}, current=True
)


@app.task(base=LeasedTask, bind=True, shared=False, name="cli.count")  # type: ignore[untyped-decorator]
def count(self: Any, n: int, pause: float = 0.0) -> dict[str, Any]:
    """Sum 0..n-1, one checkpoint a step; the result says where this attempt started."""
    state = self.lease.checkpoint or {"i": 0, "sum": 0}
    started_from = state["i"]
    for i in range(state["i"], n):
        time.sleep(pause)
        state = {"i": i + 1, "sum": state["sum"] + i}
        self.checkpoint(state, progress=(i + 1, n))
    return {"started_from": started_from, **state}
