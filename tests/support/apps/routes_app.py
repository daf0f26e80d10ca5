"""``tests.support.apps.leased_app`` plus tasks whose jobs live in the database their route
names (``leases_databases`` and ``leases_routes``, passed in ``TEST_CELERY_CONFIG``),
configured from env.

- ``e2e.routed_units(count, unit_seconds)``: as ``e2e.units``, with its unit log in the
  leases database its job lives in (:func:`routed_log_for`), each unit's log row ended in the
  transaction that saves its checkpoint there: a unit counts as committed exactly when its
  checkpoint was saved, in whichever database that is.
- ``e2e.billing_units(count, unit_seconds)``: the same body under another name, for a route by
  task name.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping

from celery import Celery, Task

from celery_leases import LeasedTask
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.unit_log import UnitLog


def routed_log_for(app: Celery, url: str) -> UnitLog:
    """The unit log table ``<leases_table>_units`` in the leases database at ``url``: one
    object per app and database (one engine per process)."""
    logs: dict[str, UnitLog] = app.__dict__.setdefault("_test_routed_logs", {})
    found = logs.get(url)
    if found is None:
        found = logs[url] = UnitLog(url, f"{app.conf.leases_table}_units")
    return found


def add_route_tasks(app: Celery) -> Celery:
    def routed_units(self: Task, count: int, unit_seconds: float) -> int:
        lease = self.lease
        # The database of the job being run (its message's route), as the library sees it.
        log = routed_log_for(app, self.lease_settings.database_url)
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
        return count

    for name in ("e2e.routed_units", "e2e.billing_units"):
        app.task(base=LeasedTask, bind=True, shared=False, name=name)(routed_units)
    return app


def make_app(environ: Mapping[str, str] | None = None, *, name: str = "routes_app") -> Celery:
    return add_route_tasks(make_leased_app(environ, name=name, current=True))


app = make_app(os.environ)
