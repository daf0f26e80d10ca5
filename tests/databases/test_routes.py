"""Routes (``leases_databases`` + ``leases_routes``): each job lives in one database, chosen
when it is recorded, and every later step finds it there. Three real databases at once: an
SQLite file ('default'), PostgreSQL ('pg') and MariaDB ('maria')."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask, routes
from celery_leases.config import settings_for
from celery_leases.db import Store, store_for
from celery_leases.errors import ConfigurationError, StoreUnavailable
from celery_leases.message import ROUTE_HEADER, VERSION_HEADER
from celery_leases.reaper import reap
from celery_leases.settings import validate
from tests.support.cli import migrate_table
from tests.support.memory import close_routed, memory_app, three_databases

PG_QUEUE = "to_pg"


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    with three_databases(tmp_path, "leases_t_") as urls:
        yield from _app(urls)


def _app(urls: dict[str, str]) -> Iterator[Celery]:
    app = memory_app(
        "routes_tests",
        urls["default"],
        urls["table"],
        leases_databases={"pg": urls["pg"], "maria": urls["maria"]},
        leases_routes={"tasks": {"tests.routes.billing*": "maria"}, "queues": {PG_QUEUE: "pg"}},
    )

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.routes.sync")
    def sync(self: LeasedTask, pages: int, fail_at: int | None = None) -> Any:
        start = (self.lease.checkpoint or {}).get("page", 0)
        for page in range(start, pages):
            if page == fail_at:
                raise RuntimeError("upstream down")
            self.checkpoint({"page": page + 1})
        return start

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.routes.billing")
    def billing(self: LeasedTask, account: str) -> Any:
        return account

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.routes.chain_step")
    def chain_step(self: LeasedTask, account: str) -> Any:
        return billing.delay(account).id  # a job of another route, sent from a running one

    try:
        yield app
    finally:
        close_routed(app)


def store(app: Celery, name: str) -> Store:
    return store_for(routes.on(settings_for(app), name))


def where(app: Celery, job_id: str) -> list[str]:
    """The names of the databases that hold a row of ``job_id``."""
    return [name for name, found in routes.stores(settings_for(app)) if found.get(job_id)]


def test_each_job_is_recorded_in_its_routes_database_and_its_message_names_it(
    app: Celery,
) -> None:
    sync, billing = app.tasks["tests.routes.sync"], app.tasks["tests.routes.billing"]

    by_queue = sync.apply_async((2,), queue=PG_QUEUE)
    by_name = billing.delay("acme")
    unrouted = sync.delay(2)

    assert where(app, by_queue.id) == ["pg"]
    assert where(app, by_name.id) == ["maria"]
    assert where(app, unrouted.id) == ["default"]
    recorded = store(app, "pg").get(by_queue.id)
    assert recorded is not None and recorded.message.headers[ROUTE_HEADER] == "pg"


def test_an_attempt_claims_checkpoints_and_ends_in_its_jobs_database(app: Celery) -> None:
    sync = app.tasks["tests.routes.sync"]
    sent = sync.apply_async((3,), {"fail_at": 2}, queue=PG_QUEUE)

    # When its first attempt fails after two pages, and a second delivery runs it
    first = sync.apply((3,), {"fail_at": 2}, task_id=sent.id, headers={ROUTE_HEADER: "pg"})
    job = store(app, "pg").get(sent.id)
    assert job is not None and job.state == "failed" and job.checkpoint == {"page": 2}
    assert isinstance(first.result, RuntimeError)

    # Then everything happened in PostgreSQL, and nothing anywhere else
    assert where(app, sent.id) == ["pg"]


def test_a_message_sent_by_name_is_routed_at_its_claim_by_its_queue(app: Celery) -> None:
    sync = app.tasks["tests.routes.sync"]
    job_id = str(uuid.uuid4())

    # A delivery without the header (sent by name, no record), from the routed queue
    result = sync.apply((2,), task_id=job_id, routing_key=PG_QUEUE)

    assert result.result == 0
    assert where(app, job_id) == ["pg"]
    done = store(app, "pg").get(job_id)
    assert done is not None and done.state == "done" and done.checkpoint == {"page": 2}
    # Its row keeps its database: the reaper's re-publish of it goes back there
    assert done.message.headers[ROUTE_HEADER] == "pg"


def test_a_recorded_message_without_its_database_is_claimed_where_its_job_lives(
    app: Celery,
) -> None:
    # Given a job recorded in 'default' (its task's own route), and a delivery of its message
    # that names no database (recorded before the app had routes), from a queue routed to pg
    sync = app.tasks["tests.routes.sync"]
    sent = sync.delay(2)
    recorded = store(app, "default").get(sent.id)
    assert recorded is not None
    version = recorded.message.version

    result = sync.apply(
        (2,), task_id=sent.id, routing_key=PG_QUEUE, headers={VERSION_HEADER: version}
    )

    # Then it ran as the job it is, in its database, and no second job was made in pg
    assert result.result == 0
    assert where(app, sent.id) == ["default"]
    done = store(app, "default").get(sent.id)
    assert done is not None and done.state == "done" and done.attempts == 1


def test_a_job_sent_from_a_running_job_lives_in_its_own_route(app: Celery) -> None:
    chain_step = app.tasks["tests.routes.chain_step"]
    parent = chain_step.apply_async(("acme",), queue=PG_QUEUE)

    child_id = chain_step.apply(("acme",), task_id=parent.id, headers={ROUTE_HEADER: "pg"}).result

    assert where(app, parent.id) == ["pg"]
    assert where(app, child_id) == ["maria"]


def test_the_reaper_goes_over_every_database_and_skips_one_that_is_down(
    app: Celery, tmp_path: Path
) -> None:
    sync, billing = app.tasks["tests.routes.sync"], app.tasks["tests.routes.billing"]
    in_pg = sync.apply_async((2,), queue=PG_QUEUE)
    in_maria = billing.delay("acme")
    for name, job_id in (("pg", in_pg.id), ("maria", in_maria.id)):
        claimed_long_ago(store(app, name), job_id)

    report = reap(app)

    assert sorted(report.republished) == sorted([in_pg.id, in_maria.id])
    assert report.unreachable == []

    # When one database does not answer (MariaDB's URL now points at a closed port)
    for job_id in (in_pg.id,):
        claimed_long_ago(store(app, "pg"), job_id)
    app.conf.leases_databases = {
        "pg": settings_for(app).databases["pg"],
        "maria": "mysql+pymysql://root@127.0.0.1:1/test?connect_timeout=1",
    }
    report = reap(app)

    # Then the others are reaped all the same, and the report names it
    assert report.unreachable == ["maria"]
    assert report.republished == [in_pg.id]


def claimed_long_ago(store: Store, job_id: str) -> None:
    """Make job ``job_id`` a running job whose lease expired a minute ago (by the database's
    clock), as a crashed worker leaves it."""
    table = store.table
    with store.engine.begin() as connection:
        row = connection.execute(sa.select(table.c.token).where(table.c.id == job_id)).one()
        connection.execute(
            table.update()
            .where(table.c.id == job_id)
            .values(state="running", owner="gone@host", token=row.token + 1)
        )
    assert store.release(job_id)


def test_a_keyed_task_sent_to_a_queue_routed_elsewhere_is_refused(app: Celery) -> None:
    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.routes.keyed", lease_key="{0}")
    def keyed(self: LeasedTask, account: str) -> None:
        pass

    with pytest.raises(ConfigurationError, match="route the task by its name"):
        keyed.apply_async(("acme",), queue=PG_QUEUE)
    assert keyed.delay("acme").id  # to its own route: fine


def test_a_keyed_task_whose_own_queue_is_routed_lives_in_that_queues_database(
    app: Celery,
) -> None:
    # Given a keyed task declared with a queue of its own (@app.task(queue=...)), which
    # apply_async sends it to before task_routes, and that queue routed to pg
    @app.task(
        base=LeasedTask, bind=True, shared=False, name="tests.routes.own_queue",
        lease_key="{0}", queue=PG_QUEUE,
    )  # fmt: skip
    def own_queue(self: LeasedTask, account: str) -> str:
        return account

    # When it is called without options, and run as a delivery without a record
    sent = own_queue.delay("acme")
    job_id = str(uuid.uuid4())
    run = own_queue.apply(("globex",), task_id=job_id)

    # Then its home is that queue's database: the call is not refused as sent elsewhere, and
    # both jobs live in pg
    assert own_queue.lease_home() == "pg"
    assert where(app, sent.id) == ["pg"]
    assert run.result == "globex" and where(app, job_id) == ["pg"]


def test_a_keyed_task_sent_by_name_to_a_queue_routed_elsewhere_runs_in_its_own_database(
    app: Celery,
) -> None:
    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.routes.keyed", lease_key="{0}")
    def keyed(self: LeasedTask, account: str) -> str:
        return account

    # A delivery without a record (sent by name) from the queue routed to pg: the key's
    # jobs live in the task's own database, where the unique live key can see them all
    job_id = str(uuid.uuid4())
    result = keyed.apply(("acme",), task_id=job_id, routing_key=PG_QUEUE)

    assert result.result == "acme"
    assert where(app, job_id) == ["default"]


def test_a_message_naming_a_database_an_app_without_routes_lacks_is_not_run(
    tmp_path: Path,
) -> None:
    # Given an app of one database (a worker of a rolling deploy before it got the routes)
    url, table = f"sqlite:///{tmp_path}/alone.sqlite3", "leases_alone"
    migrate_table(url, table)
    app = memory_app("routes_alone", url, table)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.routes.alone")
    def alone(self: LeasedTask) -> str:
        return "ran"

    # When a message recorded in database 'pg' reaches it
    result = alone.apply(task_id=str(uuid.uuid4()), headers={ROUTE_HEADER: "pg"})

    # Then it does not run, nor make a second job in its database: it says what to do
    assert isinstance(result.result, StoreUnavailable), result.result
    assert "leases_databases does not name" in str(result.result)
    assert store_for(settings_for(app)).get(result.id) is None
    store_for(settings_for(app)).engine.dispose()
    app.close()


def test_tasks_sharing_a_key_over_two_databases_are_refused_at_start(app: Celery) -> None:
    for name in ("tests.routes.billing_keyed", "tests.routes.other_keyed"):

        @app.task(base=LeasedTask, bind=True, shared=False, name=name, lease_key="acct:{0}")
        def keyed(self: LeasedTask, account: str) -> None:
            pass

    [problem] = routes.split_keys(app)
    assert "lease_key 'acct:{0}'" in problem and "maria: tests.routes.billing_keyed" in problem


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"databases": {"default": "sqlite://"}}, "other than 'default'"),
        ({"databases": {"b": "not a url"}}, r"leases_databases\['b'\] must be an SQLAlchemy URL"),
        ({"routes": {"queues": {"q": "nowhere"}}}, "not one of \\['default'\\]"),
        ({"routes": {"queue": {"q": "default"}}}, "leases_routes must be"),
    ],
)
def test_routes_that_cannot_work_are_refused_with_what_is_wrong(
    raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        validate(raw)
