"""``tests.support.apps.leased_app`` plus the hand-off tests' tasks (issue 6), configured from env.

- ``e2e.stuck(count, unit_seconds, stuck_after)``: like ``e2e.units``, but its first attempt
  hangs in ``time.sleep(3600)`` after committing unit ``stuck_after`` (a deadlock, a socket
  without timeout); later attempts run to the end.
- ``e2e.saved_units(count, unit_seconds)``: units committed one by one, each followed by a
  plain ``self.checkpoint()`` (not in the unit's transaction).
- ``e2e.dies_once_done(value)``: its process dies right after the attempt marked the job done,
  before Celery stores the result (``DiesOnSecondEncoding``); ``e2e.record_callback``: a link.
- ``e2e.hold(seconds)``: holds its lease ``seconds`` without a checkpoint (the keeper alone keeps
  it alive), then returns its token.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Mapping

from celery import Celery, Task

from celery_leases import LeasedTask
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.apps.leased_app import unit_log_for


class DiesOnSecondEncoding:
    """A task result (Celery's JSON asks it for ``__json__``) that kills its process the second
    time it is encoded."""

    encoded = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __json__(self) -> int:
        DiesOnSecondEncoding.encoded += 1
        if DiesOnSecondEncoding.encoded == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.value


def add_handoff_tasks(app: Celery) -> Celery:
    log = unit_log_for(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.stuck")
    def stuck(self: Task, count: int, unit_seconds: float, stuck_after: int) -> int:
        lease = self.lease
        run = uuid.uuid4().hex
        for unit in range((lease.checkpoint or {}).get("next", 0), count):
            row = log.start(
                lease.job_id,
                unit,
                run=run,
                token=lease.token,
                attempt=lease.attempt,
                host=self.request.hostname or "",
            )
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
                self.checkpoint({"next": unit + 1}, connection=connection)
            self.stop_point()
            if lease.attempt == 1 and unit == stuck_after:
                time.sleep(3600)
        return count

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.saved_units")
    def saved_units(self: Task, count: int, unit_seconds: float) -> int:
        """Like ``e2e.units``, but each unit commits its log row first and then checkpoints
        on its own (no transaction of the task's): a unit whose checkpoint is not saved is
        done again by the next attempt."""
        lease = self.lease
        run = uuid.uuid4().hex
        for unit in range((lease.checkpoint or {}).get("next", 0), count):
            row = log.start(
                lease.job_id,
                unit,
                run=run,
                token=lease.token,
                attempt=lease.attempt,
                host=self.request.hostname or "",
            )
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
            self.checkpoint({"next": unit + 1})
        return count

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.flaky", max_retries=3)
    def flaky(self: Task, count: int) -> dict[str, int]:
        """Checkpoints units; the first attempt asks Celery to retry it after unit 2."""
        first = (self.lease.checkpoint or {}).get("next", 0)
        for unit in range(first, count):
            self.checkpoint({"next": unit + 1})
            if self.request.retries == 0 and unit == 2:
                raise self.retry(countdown=0.3)
        return {"resumed_from": first, "retries": self.request.retries}

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.dies_once_done")
    def dies_once_done(self: Task, value: int) -> DiesOnSecondEncoding:
        """Checkpoints, then returns a value whose second JSON encoding SIGKILLs the process:
        the first is the attempt marking the job done, the second Celery storing the result.
        The process dies between the two, as a kill at the worst moment would."""
        self.checkpoint({"done": True})
        return DiesOnSecondEncoding(value)

    @app.task(shared=False, name="e2e.record_callback")
    def record_callback(result: int, key: str) -> None:
        """A success callback: counts its runs in the unit log under ``key``."""
        log.start(key, int(result), run=uuid.uuid4().hex, token=None, attempt=None, host="")

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.hold")
    def hold(self: Task, seconds: float) -> int:
        time.sleep(seconds)
        return int(self.lease.token)

    return app


def make_app(environ: Mapping[str, str] | None = None, *, name: str = "handoff_app") -> Celery:
    return add_handoff_tasks(make_leased_app(environ, name=name, current=True))


app = make_app(os.environ)
