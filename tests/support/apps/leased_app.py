"""A celery-leases app for the end-to-end tests and ``bench/recovery.py``, configured from env.

Run it as ``celery -A tests.support.apps.leased_app worker`` (or ``beat``) with the ``E2E_*``
variables of ``factory.app_env`` set (the table of them is in ``factory``'s docstring).

Tasks (all write the unit log, see ``tests/support/unit_log.py``):

- ``e2e.units(count, unit_seconds)``: ``count`` units of ``unit_seconds`` each; after each unit
  it checkpoints ``{"next": unit + 1}`` in the transaction that commits the unit's log row, and
  it resumes from ``self.lease.checkpoint``. Returns ``count``.
- ``e2e.keyed_units(account, count, unit_seconds)``: as ``e2e.units``, for lease key
  ``account:<account>``, also saving the key's cursor ``{"units": n}`` (units its runs
  committed) with each checkpoint. Returns the cursor it ended at.
- ``e2e.poison()``: logs unit 0, then SIGKILLs its own process, before any checkpoint.
- ``e2e.bad_checkpoint()``: saves ``{"next": 1}``, then checkpoints a non-JSON object.
- ``e2e.plain_units(count, unit_seconds)``: plain Celery (no lease), always from unit 0, each
  unit committed on its own, for comparison.
- ``e2e.time_limited(pause)``: ``soft_time_limit=1``; checkpoints ``{"next": n}`` in a loop
  (``pause`` seconds apart) until the limit, catches ``SoftTimeLimitExceeded`` and saves a last
  checkpoint ``{"next": n, "last": True, "landed": where}``, ``where`` being ``"checkpoint"``
  when the limit interrupted a checkpoint, else ``"pause"``; then cleans up for ``cleanup``
  seconds (a sleep) and returns that last checkpoint.
- ``e2e.retry_at(marker, joined=True)``: ``soft_time_limit=1``; its first attempt saves a
  checkpoint (``joined``: in a transaction of its own, so its retry is held back until the
  body has raised; else on the store's connection, so ``self.retry()`` hands the lease back),
  waits for the file ``marker``, then asks for a retry (``self.retry(countdown=0)``); a later
  attempt returns its checkpoint.
- ``e2e.slow_success()``: ``soft_time_limit=1``; returns ``"ok"`` at once (for a limit that
  comes in Celery's own work after it: publishing its links).
- ``e2e.echo(value)``: returns ``value`` (a link's target).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Mapping

from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery, Task

from celery_leases import LeasedTask
from tests.support.apps import factory
from tests.support.apps.factory import table_of
from tests.support.unit_log import UnitLog


def unit_log_for(app: Celery) -> UnitLog:
    """The unit log of ``app``: table ``<leases_table>_units`` in the leases database."""
    return table_of(app, UnitLog, "units")


def make_app(
    environ: Mapping[str, str] | None = None, *, name: str = "leased_app", current: bool = False
) -> Celery:
    """A Celery app with the e2e tasks, configured from ``environ`` (default: os.environ)."""
    app = factory.make_app(name, environ, current=current)
    log = unit_log_for(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.units")
    def units(
        self: Task,
        count: int,
        unit_seconds: float,
        linger_at: int | None = None,
        linger_file: str | None = None,
        hang_at: int | None = None,
        hang_file: str | None = None,
    ) -> int:
        """``count`` units, each committed with its checkpoint. At unit ``linger_at`` the first
        attempt's transaction lingers after the checkpoint statement: ``linger_file`` is created
        (the row is then locked) and the commit waits 3 s, long enough to freeze the worker.
        At unit ``hang_at`` the first attempt hangs (``hang_file`` created, then an hour's
        sleep), as a task stuck on a dead socket does."""
        lease = self.lease
        run = uuid.uuid4().hex
        first = (lease.checkpoint or {}).get("next", 0)
        for unit in range(first, count):
            row = log.start(
                lease.job_id,
                unit,
                run=run,
                token=lease.token,
                attempt=lease.attempt,
                host=self.request.hostname or "",
            )
            if unit == hang_at:
                hang_once(hang_file)
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
                self.checkpoint({"next": unit + 1}, connection=connection)
                if unit == linger_at and linger_file and not os.path.exists(linger_file):
                    open(linger_file, "x").close()  # once: a resumed attempt commits at once
                    time.sleep(3.0)
            self.stop_point()  # committed: stop here if asked to (cancel, shutdown)
        return count

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="e2e.keyed_units",
        lease_key="account:{account}",
    )
    def keyed_units(self: Task, account: str, count: int, unit_seconds: float) -> int:
        """``count`` units of the job's lease key ``account:<account>``: each committed with
        its checkpoint and the key's cursor ``{"units": <units the key's runs committed>}``
        in one transaction. Returns the cursor it ended at."""
        lease = self.lease
        run = uuid.uuid4().hex
        first = (lease.checkpoint or {}).get("next", 0)
        done = int((lease.cursor or {}).get("units", 0))
        for unit in range(first, count):
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
                self.save_cursor({"units": done + 1}, connection=connection)
                self.checkpoint({"next": unit + 1}, connection=connection)
            done += 1
            self.stop_point()
        return done

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.poison")
    def poison(self: Task) -> None:
        lease = self.lease
        log.start(
            lease.job_id,
            0,
            run=uuid.uuid4().hex,
            token=lease.token,
            attempt=lease.attempt,
            host=self.request.hostname or "",
        )
        os.kill(os.getpid(), signal.SIGKILL)

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.bad_checkpoint")
    def bad_checkpoint(self: Task) -> None:
        self.checkpoint({"next": 1})
        self.checkpoint({"next": 2, "when": object()})

    @app.task(bind=True, shared=False, name="e2e.plain_units")
    def plain_units(
        self: Task,
        count: int,
        unit_seconds: float,
        hang_at: int | None = None,
        hang_file: str | None = None,
    ) -> int:
        run = uuid.uuid4().hex
        for unit in range(count):
            row = log.start(
                self.request.id,
                unit,
                run=run,
                token=None,
                attempt=None,
                host=self.request.hostname or "",
            )
            if unit == hang_at:
                hang_once(hang_file)
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
        return count

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="e2e.time_limited",
        soft_time_limit=1,
        time_limit=60,
    )
    def time_limited(self: Task, pause: float, cleanup: float = 0.0) -> dict[str, object]:
        done = (self.lease.checkpoint or {}).get("next", 0)
        where = "pause"
        try:
            while True:
                where = "checkpoint"
                self.checkpoint({"next": done + 1})
                where = "pause"
                done += 1
                time.sleep(pause)
        except SoftTimeLimitExceeded:
            last = {"next": done, "last": True, "landed": where}
            self.checkpoint(last)
            time.sleep(cleanup)
            return last

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="e2e.retry_at",
        soft_time_limit=1,
        time_limit=60,
    )
    def retry_at(self: Task, marker: str, joined: bool = True) -> object:
        if self.lease.checkpoint is not None:
            return self.lease.checkpoint
        if joined:  # the retry is then held back until the body has raised
            with log.engine.begin() as connection:
                self.checkpoint({"asked": "retry"}, connection=connection)
        else:  # the retry hands the lease back inside self.retry()
            self.checkpoint({"asked": "retry"})
        while not os.path.exists(marker):
            time.sleep(0.01)
        raise self.retry(countdown=0)

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="e2e.slow_success",
        soft_time_limit=1,
        time_limit=60,
    )
    def slow_success(self: Task) -> str:
        return "ok"

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.echo")
    def echo(self: Task, value: object) -> object:
        return value

    return app


def hang_once(marker: str | None) -> None:
    """Hang for an hour unless ``marker`` exists (created first: only one attempt hangs)."""
    if marker is None or os.path.exists(marker):
        return
    open(marker, "x").close()
    time.sleep(3600)


app = make_app(current=True)
