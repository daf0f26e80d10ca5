"""``leased_app`` plus the tasks of the Celery-controls tests, configured from env.

Configured like ``leased_app`` (see its ``app_env``), plus:

=====================  =========================================================================
``CONTROLS_PARTIAL``   ``1``: the module's app knows one leased task, ``controls.other``, and
                       none of the others (a worker of another deployment on the same queue)
=====================  =========================================================================

Records, in the leases database: ``leased_app``'s unit log (one row per unit started; ``run``
is one execution of a task body), and the call log ``<leases_table>_calls`` (one row per call
of an errback, see :class:`CallLog`).

Leased tasks (each logs every unit it starts and checkpoints ``{"next": unit + 1}`` after it,
resuming from its checkpoint; ``e2e.units`` and ``e2e.poison`` come from ``leased_app``):

- ``controls.reject(requeue)``: logs unit 0, then raises ``Reject(requeue=requeue)``; with
  ``requeue`` it rejects on its first attempt only and returns ``"accepted at attempt N"``.
- ``controls.retry_after_cancel(count, unit_seconds)``: its first attempt, after unit 0's
  checkpoint, polls its row until it is asked to stop (at most 60 s), then calls ``self.retry()``;
  a retry runs the remaining units. Returns ``count``.
- ``controls.autoretry(count, unit_seconds)``: ``autoretry_for=(Exception,)``. Returns ``count``.
- ``controls.timed(count, unit_seconds)``: ``time_limit=2``. Returns ``count``.

Plain tasks: ``controls.errback(request, exc, traceback)`` (a ``link_error`` errback Celery
calls in the process that stores the failure: records one call), ``controls.add(x, y)`` and
``controls.total(values)``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from celery import Celery, Task
from celery.exceptions import Reject

from celery_leases import LeasedTask
from celery_leases.db.functions import db_now
from tests.support.apps import factory
from tests.support.apps.factory import table_of
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.apps.leased_app import unit_log_for
from tests.support.unit_log import ProcessTable, UnitLog

PARTIAL_ENV = "CONTROLS_PARTIAL"
#: Seconds ``controls.retry_after_cancel`` waits to be asked to stop before it retries anyway:
#: a bound, not an expectation (the test's cancel goes through a `celery leases` process,
#: which took over 15 s to start on a loaded machine, and the job then ran to done).
STOP_WAIT_SECONDS = 60.0


@dataclass(frozen=True)
class Call:
    """One recorded call: ``kind`` (``errback``), the job it was about, and what it was told."""

    kind: str
    job_id: str
    detail: str
    pid: int
    at: float


class CallLog(ProcessTable):
    """The table ``name`` in the database at ``url``: one row per recorded call."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(
            url,
            sa.Table(
                name,
                sa.MetaData(),
                sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                sa.Column("kind", sa.String(32), nullable=False),
                sa.Column("job_id", sa.String(155), nullable=False, index=True),
                sa.Column("detail", sa.Text, nullable=False),
                sa.Column("pid", sa.Integer, nullable=False),
                sa.Column("at", sa.Double, nullable=False),
            ),
        )

    def add(self, kind: str, job_id: str, detail: str) -> None:
        values = {"kind": kind, "job_id": job_id, "detail": detail, "pid": os.getpid()}
        with self.engine.begin() as connection:
            connection.execute(sa.insert(self.table).values(values | {"at": db_now()}))

    def rows(self, job_id: str, kind: str | None = None) -> list[Call]:
        t = self.table
        stmt = sa.select(t.c.kind, t.c.job_id, t.c.detail, t.c.pid, t.c.at).where(
            t.c.job_id == job_id
        )
        if kind is not None:
            stmt = stmt.where(t.c.kind == kind)
        with self.engine.connect() as connection:
            return [Call(*row) for row in connection.execute(stmt.order_by(t.c.id)).all()]


def call_log_for(app: Celery) -> CallLog:
    """The call log of ``app``: table ``<leases_table>_calls`` in the leases database."""
    return table_of(app, CallLog, "calls")


def _start_unit(task: Task, log: UnitLog, unit: int, run: str) -> int:
    lease = task.lease
    return log.start(
        lease.job_id,
        unit,
        run=run,
        token=lease.token,
        attempt=lease.attempt,
        host=task.request.hostname or "",
    )


def _end_unit(log: UnitLog, row: int) -> None:
    with log.engine.begin() as connection:
        log.end(connection, row)


def add_control_tasks(app: Celery) -> Celery:
    log = unit_log_for(app)
    calls = call_log_for(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="controls.reject")
    def reject(self: Task, requeue: bool) -> str:
        _start_unit(self, log, 0, uuid.uuid4().hex)
        if not requeue:
            raise Reject("rejected for good", requeue=False)
        if self.lease.attempt == 1:
            raise Reject("rejected once, to run again", requeue=True)
        return f"accepted at attempt {self.lease.attempt}"

    @app.task(base=LeasedTask, bind=True, shared=False, name="controls.retry_after_cancel")
    def retry_after_cancel(self: Task, count: int, unit_seconds: float) -> int:
        lease = self.lease
        run = uuid.uuid4().hex
        for unit in range((lease.checkpoint or {}).get("next", 0), count):
            row = _start_unit(self, log, unit, run)
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
                self.checkpoint({"next": unit + 1}, connection=connection)
            if self.request.retries == 0 and unit == 0:
                # No stop_point() here: the stop must meet the retry, not this checkpoint.
                deadline = time.monotonic() + STOP_WAIT_SECONDS
                # The row says when it is asked (the attempt learns it only at a checkpoint).
                while time.monotonic() < deadline:
                    if self.lease_store.get(lease.job_id).stop_requested is not None:
                        break
                    time.sleep(0.05)
                raise self.retry(countdown=0.2)
        return count

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="controls.autoretry",
        autoretry_for=(Exception,),
        max_retries=3,
        default_retry_delay=0.2,
    )
    def autoretry(self: Task, count: int, unit_seconds: float) -> int:
        run = uuid.uuid4().hex
        for unit in range((self.lease.checkpoint or {}).get("next", 0), count):
            row = _start_unit(self, log, unit, run)
            time.sleep(unit_seconds)
            _end_unit(log, row)
            self.checkpoint({"next": unit + 1})
        return count

    @app.task(base=LeasedTask, bind=True, shared=False, name="controls.timed", time_limit=2)
    def timed(self: Task, count: int, unit_seconds: float) -> int:
        run = uuid.uuid4().hex
        for unit in range((self.lease.checkpoint or {}).get("next", 0), count):
            row = _start_unit(self, log, unit, run)
            time.sleep(unit_seconds)
            _end_unit(log, row)
            self.checkpoint({"next": unit + 1})
        return count

    @app.task(shared=False, name="controls.errback")
    def errback(request: Any, exc: BaseException, traceback: Any) -> None:
        calls.add("errback", request.id, f"{type(exc).__module__}.{type(exc).__name__}: {exc}")

    @app.task(shared=False, name="controls.add")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(shared=False, name="controls.total")
    def total(values: list[int]) -> int:
        return sum(values)

    return app


def make_partial_app(environ: Mapping[str, str], *, name: str = "partial_app") -> Celery:
    """An app of the same settings that knows ``controls.other`` only (no reaper either)."""
    app = factory.make_app(name, environ, reaper=False, current=True)

    @app.task(base=LeasedTask, bind=True, shared=False, name="controls.other")
    def other(self: Task) -> str:
        return "other"

    return app


def make_app(
    environ: Mapping[str, str] | None = None, *, name: str = "control_app", current: bool = True
) -> Celery:
    """The app ``environ`` describes (default: os.environ); ``current``: set as current app."""
    environ = os.environ if environ is None else environ
    if environ.get(PARTIAL_ENV) == "1":
        return make_partial_app(environ)
    return add_control_tasks(make_leased_app(environ, name=name, current=current))


app = make_app(os.environ)
