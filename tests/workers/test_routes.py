"""Routes end to end: one real worker serving jobs that live in three leases databases at once
(PostgreSQL ``test`` as 'default', a PostgreSQL database of the test's own as 'r', MariaDB as
'm'), one of which goes away and comes back while its jobs run."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases import Job, StoreUnavailable, routes
from celery_leases.config import settings_for
from celery_leases.db import Store, store_for
from celery_leases.message import ROUTE_HEADER
from celery_leases.reaper import reap
from tests.support.apps.routes_app import add_route_tasks, routed_log_for
from tests.support.cli import migrate_table
from tests.support.scenario import FINISHED, Scenario, check_unit_log, wait_for
from tests.support.service import POSTGRES_URL, drop_tables, require
from tests.support.unit_log import Unit, UnitLog

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(90),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
]

ROUTES_APP = "tests.support.apps.routes_app"
MakeScenario = Callable[..., Scenario]

UNITS = 12
#: Units of the jobs that stay up: long enough to be running when 'r' goes away.
LONG_UNITS = 20
UNIT_SECONDS = 0.25


class Routed:
    """A scenario whose jobs live in three databases, 'r' being a database of the test's
    own that it can take away and bring back."""

    def __init__(self, s: Scenario, r_name: str, r_queue: str) -> None:
        self.s = s
        self.r_name = r_name
        self.r_queue = r_queue

    def store(self, name: str) -> Store:
        return store_for(routes.on(settings_for(self.s.app), name))

    def log(self, name: str) -> UnitLog:
        """The unit log in database ``name`` (where its jobs' units are logged)."""
        return routed_log_for(self.s.app, routes.on(settings_for(self.s.app), name).database_url)

    def job(self, name: str, job_id: str) -> Job | None:
        return self.store(name).get(job_id)

    def finished(self, name: str, job_id: str) -> Job | None:
        """Job ``job_id`` of database ``name`` once it has ended, else None."""
        job = self.job(name, job_id)
        return job if job is not None and job.state in FINISHED else None

    def committed(self, name: str, job_id: str, at_least: int = 1) -> list[Unit]:
        """The committed units of ``job_id`` in ``name``'s unit log; [] while fewer than
        ``at_least``."""
        rows = [row for row in self.log(name).rows(job_id) if row.committed]
        return rows if len(rows) >= at_least else []

    def set_connections(self, allowed: bool) -> None:
        """Let 'r' take connections again, or refuse them and end every session it has: the
        server and its other databases go on."""
        with _admin() as connection:
            flag = "true" if allowed else "false"
            connection.execute(sa.text(f"ALTER DATABASE {self.r_name} ALLOW_CONNECTIONS {flag}"))
            if not allowed:
                connection.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": self.r_name},
                )


@contextlib.contextmanager
def _admin() -> Iterator[sa.Connection]:
    """An autocommit connection to the PostgreSQL server's ``postgres`` database."""
    url = sa.engine.make_url(POSTGRES_URL).set(database="postgres")
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            yield connection
    finally:
        engine.dispose()


@pytest.fixture
def second_postgres() -> Iterator[tuple[str, str]]:
    """A PostgreSQL database of this test's own on the shared server: (name, URL); dropped
    at teardown, whoever is still connected."""
    require("postgres")
    name = f"leases_r_{uuid.uuid4().hex[:8]}"
    with _admin() as connection:
        connection.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield name, sa.engine.make_url(POSTGRES_URL).set(database=name).render_as_string(False)
    finally:
        with _admin() as connection:
            connection.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@pytest.fixture
def routed(
    scenario: MakeScenario,
    celery_settings: dict[str, Any],
    queue_name: str,
    table_name: str,
    second_postgres: tuple[str, str],
) -> Iterator[Routed]:
    """A scenario on three leases databases: 'default' (this test's table in PostgreSQL
    ``test``), 'r' (the same table in a database of the test's own, jobs sent to queue
    ``<queue>_r``) and 'm' (MariaDB, jobs of the tasks named ``e2e.billing_*``); a 2 s lease."""
    r_name, r_url = second_postgres
    m_url = require("mariadb")
    for url in (r_url, m_url):
        migrate_table(url, table_name)
    r_queue = f"{queue_name}_r"
    leases = {
        "leases_databases": {"r": r_url, "m": m_url},
        "leases_routes": {"queues": {r_queue: "r"}, "tasks": {"e2e.billing_*": "m"}},
    }
    s = scenario({**celery_settings, **leases}, lease_seconds=2.0, renew_seconds=0.5)
    add_route_tasks(s.app)
    routed = Routed(s, r_name, r_queue)
    try:
        for name in routes.names(settings_for(s.app)):
            routed.log(name).create()
        yield routed
    finally:
        for name, store in routes.stores(settings_for(s.app)):
            store.engine.dispose()
            routed.log(name).dispose()
        drop_tables(m_url, table_name)


def test_a_database_that_goes_away_stops_only_its_own_jobs_which_resume_once_it_is_back(
    routed: Routed,
) -> None:
    s, r_queue = routed.s, routed.r_queue
    # Given one worker of four pool processes serving the default queue and the queue of 'r',
    # and jobs of units in each database: two in 'r' (by their queue), one in 'm' (by its task's
    # name) and one in 'default' (no rule names it), the last two longer than the others
    queues = [s.app.conf.task_default_queue, r_queue]
    worker = s.spawn.worker(ROUTES_APP, env=s.env, concurrency=4, queues=queues)
    in_r = [s.send("e2e.routed_units", UNITS, UNIT_SECONDS, queue=r_queue) for _ in range(2)]
    others = {
        "m": s.send("e2e.billing_units", LONG_UNITS, UNIT_SECONDS),
        "default": s.send("e2e.routed_units", LONG_UNITS, UNIT_SECONDS),
    }
    for name, job_id in [("r", in_r[0]), ("r", in_r[1]), *others.items()]:
        job = routed.job(name, job_id)
        assert job is not None and job.message.headers.get(ROUTE_HEADER) == name, (name, job)
    for job_id in in_r:
        wait_for(
            partial(routed.committed, "r", job_id, at_least=2),
            timeout=30,
            what=f"two units of {job_id} committed in r",
        )
    for name, job_id in others.items():
        wait_for(
            partial(routed.committed, name, job_id),
            timeout=30,
            what=f"a unit of {job_id} committed in {name}",
        )
    cut_at = {name: routed.log(name).now() for name in others}

    # When 'r' refuses connections and every session it had is ended (the server and its
    # other databases go on)
    routed.set_connections(False)
    routed.log("r").dispose()

    # Then a new job for 'r' is refused at once, saying which database is unavailable, and
    # nothing is published
    lost = f"lost-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with pytest.raises(
        StoreUnavailable, match=rf"leases database \S+/{routed.r_name} is unavailable"
    ):
        s.app.tasks["e2e.routed_units"].apply_async(
            (UNITS, UNIT_SECONDS), queue=r_queue, task_id=lost
        )
    assert time.monotonic() - started < 5

    # And a reaper pass skips 'r' (named in its report) and goes over the others
    assert reap(s.app).unreachable == ["r"]

    # And the jobs of 'r' end their attempts, their failures not recorded (the database is
    # away): their leases are left to end
    for job_id in in_r:
        worker.wait_for_log(
            rf"job {job_id}: failed, and the failure could not be recorded", timeout=30
        )

    # And a new job of 'default', run by a pool process whose keeper of 'r' cannot reach it,
    # and the jobs of 'default' and 'm' that were running, all end in one attempt each
    after_cut = s.send("e2e.routed_units", 4, UNIT_SECONDS)
    for name, job_id, units in [
        *((n, j, LONG_UNITS) for n, j in others.items()),
        ("default", after_cut, 4),
    ]:
        job = wait_for(
            partial(routed.finished, name, job_id),
            timeout=30,
            what=f"{job_id} to finish in {name}",
        )
        assert (job.state, job.result, job.attempts) == ("done", units, 1), job
        rows = routed.log(name).rows(job_id)
        assert len(check_unit_log(rows, units, crashes=0)) == 1
        assert rows[-1].ended_at is not None and rows[-1].ended_at > cut_at[name], rows[-1]

    # When 'r' takes connections again, and the reaper passes until its jobs are sent again
    routed.set_connections(True)
    republished: list[str] = []

    def reaped() -> bool:
        republished.extend(reap(s.app).republished)
        return set(in_r) <= set(republished)

    wait_for(reaped, timeout=30, interval=0.2, what="the jobs of r re-published")

    # Then each of them resumes from its checkpoint, not from zero, in 'r', and ends done
    # with every unit committed once
    r_pids: set[int] = set()
    for job_id in in_r:
        job = wait_for(
            partial(routed.finished, "r", job_id),
            timeout=30,
            what=f"{job_id} to finish in r",
        )
        assert (job.state, job.result, job.attempts) == ("done", UNITS, 2), job
        assert job.checkpoint == {"next": UNITS}, job
        runs = check_unit_log(routed.log("r").rows(job_id), UNITS, crashes=1)
        assert len(runs) == 2 and runs[1].first.unit >= 2, runs
        r_pids.add(runs[0].first.pid)
    # (the job sent after the cut ran in a process that had held a lease in 'r')
    assert routed.log("default").rows(after_cut)[0].pid in r_pids

    # And the job refused while 'r' was away was recorded nowhere, and never ran
    for name in routes.names(settings_for(s.app)):
        assert routed.job(name, lost) is None
        assert routed.log(name).rows(lost) == []
    assert lost not in s.logs()
