"""A celery-leases app whose task reports progress, for the monitoring tests.

Settings come from ``TEST_CELERY_CONFIG`` (``tests.support.service.celery_env``); the leases
database and table from ``leases_database_url`` / ``leases_table`` in it.

- ``progress.count(total)``: ``total`` checkpoints ``{"done": i}`` with progress ``(i, total)``;
  returns ``total``.
- ``progress.hold(total, hold_at, release_file)``: the same, waiting after checkpoint
  ``hold_at`` until ``release_file`` exists.
"""

from __future__ import annotations

from celery_leases import LeasedTask
from tests.support.apps.factory import make_app

app = make_app("progress_app", variables="celery_env", current=True)


@app.task(base=LeasedTask, bind=True, name="progress.count")
def count(self: LeasedTask, total: int) -> int:
    done = (self.lease.checkpoint or {}).get("done", 0)
    while done < total:
        done += 1
        self.checkpoint({"done": done}, progress=(done, total))
    return total


@app.task(base=LeasedTask, bind=True, name="progress.hold")
def hold(self: LeasedTask, total: int, hold_at: int, release_file: str) -> int:
    """Like ``count``, but after checkpoint ``hold_at`` it waits until ``release_file``
    exists (so a test can look at a monitor while the task is in progress)."""
    import os
    import time

    for done in range(1, total + 1):
        self.checkpoint({"done": done}, progress=(done, total))
        while done == hold_at and not os.path.exists(release_file):
            time.sleep(0.05)
    return total
