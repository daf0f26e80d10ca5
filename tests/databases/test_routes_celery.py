"""Routes where they meet Celery's own features: replace, routing options (task_routes with
an exchange and a routing key, routers that read the arguments, topic exchanges), a message's
database against the routes of now, eager runs. Three real databases, as tests/databases/
test_routes.py: an SQLite file ('default'), PostgreSQL ('pg') and MariaDB ('maria'); jobs go
through kombu's in-memory broker and run as Celery's worker runs them (``Request.execute``:
in this process, not eager)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, chain
from celery.worker.request import Request
from kombu import Consumer, Exchange, Queue
from kombu import Message as KombuMessage

from celery_leases import LeasedTask, routes
from celery_leases.config import settings_for
from celery_leases.db import Store, store_for
from celery_leases.message import ROUTE_HEADER
from celery_leases.worker.startup import validated
from tests.support.memory import close_routed, memory_app, three_databases


@pytest.fixture
def urls(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with three_databases(tmp_path, "leases_r_") as found:
        yield found


def make_app(urls: dict[str, Any], **conf: Any) -> Celery:
    """An app whose queue ``<table>_pg`` is routed to pg and whose ``tests.review.billing*``
    tasks live in maria (queues named for the test: kombu's memory broker is per process)."""
    table = urls["table"]
    conf.setdefault(
        "leases_routes",
        {"tasks": {"tests.review.billing*": "maria"}, "queues": {f"{table}_pg": "pg"}},
    )
    return memory_app(
        "routes_review",
        urls["default"],
        table,
        leases_databases={"pg": urls["pg"], "maria": urls["maria"]},
        **conf,
    )


@pytest.fixture
def apps() -> Iterator[list[Celery]]:
    made: list[Celery] = []
    yield made
    for app in made:
        close_routed(app)


@pytest.fixture
def app(urls: dict[str, Any], apps: list[Celery]) -> Celery:
    app = make_app(urls)
    apps.append(app)
    return app


def pg_queue(app: Celery) -> str:
    return f"{app.conf.leases_table}_pg"


def store(app: Celery, name: str) -> Store:
    return store_for(routes.on(settings_for(app), name))


def where(app: Celery, job_id: str) -> list[str]:
    """The names of the databases that hold a row of ``job_id``."""
    return [name for name, found in routes.stores(settings_for(app)) if found.get(job_id)]


def received(app: Celery, queue: str | Queue) -> list[KombuMessage]:
    """Every message waiting in ``queue``, as a worker consuming it receives them."""
    got: list[KombuMessage] = []
    if isinstance(queue, str):
        queue = app.amqp.queues[queue]
    with (
        app.connection_for_write() as connection,
        Consumer(connection, [queue], callbacks=[lambda _, m: got.append(m)], no_ack=True),
    ):
        while True:
            try:
                connection.drain_events(timeout=0.05)
            except TimeoutError:
                break
    return got


def execute(app: Celery, message: KombuMessage) -> Any:
    """Run ``message`` as Celery's worker does (trace, not eager), in this process."""
    task = app.tasks[message.headers["task"]]
    request = Request(message, app=app, task=task, hostname="w@review", connection_errors=())
    return request.execute()


def live_rows_of_key(app: Celery, key: str) -> dict[str, list[str]]:
    """The queued or running jobs of lease key ``key``, by database."""
    found: dict[str, list[str]] = {}
    for name, each in routes.stores(settings_for(app)):
        table = each.table
        with each.engine.connect() as connection:
            ids = connection.execute(
                sa.select(table.c.id).where(
                    table.c.lease_key == key, table.c.state.in_(("queued", "running"))
                )
            ).scalars()
            found.update({name: sorted(ids)} if (ids := list(ids)) else {})
    return found


def test_a_keyed_replacement_whose_key_lives_elsewhere_is_refused_before_the_job_ends(
    app: Celery,
) -> None:
    # Given a keyed task whose home is maria (routed by its name), a job of key acct:acme
    # queued there, and a task that replaces itself with a call of that key
    @app.task(
        base=LeasedTask, bind=True, shared=False, name="tests.review.billing_keyed",
        lease_key="acct:{0}",
    )  # fmt: skip
    def billing_keyed(self: LeasedTask, account: str) -> str:
        return account

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.hand_over")
    def hand_over(self: LeasedTask, account: str) -> Any:
        return self.replace(billing_keyed.s(account))

    assert billing_keyed.lease_home() == "maria"
    first = billing_keyed.delay("acme")
    assert live_rows_of_key(app, "acct:acme") == {"maria": [first.id]}

    # When a job running in pg replaces itself with a call of that key
    sent = hand_over.apply_async(("acme",), queue=pg_queue(app))
    [message] = received(app, pg_queue(app))
    execute(app, message)

    # Then the replacement is refused before the job ends: the job failed saying why and
    # what to do, nothing was sent, and the key still has its one live job, in maria
    job = store(app, "pg").get(sent.id)
    assert job is not None and job.state == "failed"
    assert "cannot take over this job's id in database 'pg'" in str(job.error)
    assert "send it with apply_async()" in str(job.error)
    sent_since = [m.headers["id"] for m in received(app, app.conf.task_default_queue)]
    assert sent_since == [first.id]  # the first call's message, and no replacement's
    assert live_rows_of_key(app, "acct:acme") == {"maria": [first.id]}


def test_a_keyed_replacement_at_the_end_of_a_chain_is_refused_too(app: Celery) -> None:
    # Given a keyed task whose home is maria, and a task that replaces itself with a chain
    # whose last step (the one that takes over the job's id) is a call of that task
    @app.task(
        base=LeasedTask, bind=True, shared=False, name="tests.review.billing_keyed",
        lease_key="acct:{0}",
    )  # fmt: skip
    def billing_keyed(self: LeasedTask, account: str) -> str:
        return account

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.hand_over")
    def hand_over(self: LeasedTask, account: str) -> Any:
        return self.replace(chain(billing_keyed.s(account)))

    # When a job running in pg replaces itself so
    sent = hand_over.apply_async(("acme",), queue=pg_queue(app))
    [message] = received(app, pg_queue(app))
    execute(app, message)

    # Then it is refused before the job ends, and no job of the key was made anywhere
    job = store(app, "pg").get(sent.id)
    assert job is not None and job.state == "failed"
    assert "cannot take over this job's id in database 'pg'" in str(job.error)
    assert live_rows_of_key(app, "acct:acme") == {}


def test_a_keyed_task_whose_task_routes_give_an_exchange_and_routing_key_can_be_called(
    urls: dict[str, Any], apps: list[Celery]
) -> None:
    # Given task_routes that send a keyed task to an exchange and a routing key (no queue
    # name), that of the queue routed to pg
    table = urls["table"]
    app = make_app(
        urls,
        task_routes={
            "tests.review.keyed": {"exchange": f"{table}_pg", "routing_key": f"{table}_pg"}
        },
    )
    apps.append(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.keyed", lease_key="{0}")
    def keyed(self: LeasedTask, account: str) -> str:
        return account

    # When it is called without options, then it is recorded where its calls go: pg
    sent = keyed.delay("acme")
    assert where(app, sent.id) == ["pg"]
    assert keyed.lease_home() == "pg"


def by_region(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any) -> Any:
    """A router of Celery's kind that routes by the call's arguments."""
    return {"queue": "eu" if args[0].startswith("eu-") else "us"}


def test_a_keyed_task_with_a_router_that_reads_the_arguments_can_be_called(
    urls: dict[str, Any], apps: list[Celery]
) -> None:
    app = make_app(urls, task_routes=(by_region,))
    apps.append(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.keyed", lease_key="{0}")
    def keyed(self: LeasedTask, account: str) -> str:
        return account

    # Neither queue is routed: the job lives in default
    sent = keyed.delay("eu-acme")
    assert where(app, sent.id) == ["default"]


def test_an_eager_call_is_routed_by_a_router_that_reads_its_arguments(
    urls: dict[str, Any], apps: list[Celery]
) -> None:
    # Given task_always_eager and a router that sends calls for EU accounts to the queue
    # routed to pg
    table = urls["table"]

    def eu_to_pg(name: str, args: Any, kwargs: Any, options: Any, **_: Any) -> Any:
        return {"queue": f"{table}_pg" if args and args[0].startswith("eu-") else table}

    app = make_app(urls, task_always_eager=True, task_routes=(eu_to_pg,))
    apps.append(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.plain")
    def plain(self: LeasedTask, account: str) -> str:
        return account

    # When an EU and a US account's calls run, then each lives where its queue's route says
    eu, us = plain.delay("eu-acme"), plain.delay("us-acme")
    assert (eu.result, us.result) == ("eu-acme", "us-acme")
    assert (where(app, eu.id), where(app, us.id)) == (["pg"], ["default"])


def test_a_worker_starts_with_a_keyed_task_and_a_router_that_reads_the_arguments(
    urls: dict[str, Any], apps: list[Celery]
) -> None:
    app = make_app(urls, task_routes=(by_region,))
    apps.append(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.keyed", lease_key="{0}")
    def keyed(self: LeasedTask, account: str) -> str:
        return account

    # What a starting worker checks: it starts (no key is split), or says why it does not
    assert validated(app, who="worker") is not None


def test_a_call_sent_through_a_topic_exchange_lives_in_its_queues_database(
    urls: dict[str, Any], apps: list[Celery]
) -> None:
    # Given a queue bound to a topic exchange by a pattern (Celery's routing docs), that
    # queue routed to pg, and task_routes sending a task there with a key the pattern matches
    table = urls["table"]
    jobs = Exchange(f"{table}_jobs", type="topic")
    app = make_app(
        urls,
        task_queues=[
            Queue(table, Exchange(table), routing_key=table),
            Queue(f"{table}_pg", jobs, routing_key="billing.#"),
        ],
        task_routes={
            "tests.review.plain": {
                "exchange": f"{table}_jobs",
                "exchange_type": "topic",
                "routing_key": "billing.invoice",
            }
        },
    )
    apps.append(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.plain")
    def plain(self: LeasedTask, n: int) -> int:
        return n

    with app.connection_for_write() as connection:  # as a worker consuming it has
        app.amqp.queues[f"{table}_pg"](connection.default_channel).declare()
    sent = plain.delay(1)

    # The broker delivers it from queue <table>_pg, the one routed to pg
    [message] = received(app, f"{table}_pg")
    assert message.headers["id"] == sent.id
    # Then it lives in pg, the database of the queue it is sent to
    assert where(app, sent.id) == ["pg"]
    # And, as AMQP matches topics, '#' takes zero words too; a pattern of no match does not
    exchange = f"{table}_jobs"
    assert routes.queue_of(app, exchange, "billing") == f"{table}_pg"
    assert routes.queue_of(app, exchange, "shipping.label") == "shipping.label"


def test_a_message_naming_its_database_runs_there_whatever_a_routes_callable_says_now(
    app: Celery,
) -> None:
    # Given a job recorded in pg (its message names it)
    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.plain")
    def plain(self: LeasedTask, n: int) -> int:
        return n

    sent = plain.apply_async((1,), queue=pg_queue(app))
    [message] = received(app, pg_queue(app))
    assert message.headers[ROUTE_HEADER] == "pg"

    # When the routes become a callable that knows nothing of that queue any more
    def by_tenant(task_name: str, queue: str | None) -> str | None:
        return {app.conf.task_default_queue: None}[queue]  # KeyError for any other queue

    app.conf.leases_routes = by_tenant
    execute(app, message)

    # Then the job runs in pg, where its message says it lives
    job = store(app, "pg").get(sent.id)
    assert job is not None
    assert (job.state, job.error) == ("done", None)


def test_an_eager_call_sent_to_a_routed_queue_lives_in_that_queues_database(
    urls: dict[str, Any], apps: list[Celery]
) -> None:
    # Given task_always_eager (tests of a project's own code)
    app = make_app(urls, task_always_eager=True)
    apps.append(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.review.plain")
    def plain(self: LeasedTask, n: int) -> int:
        return n

    # When a call is sent to the queue routed to pg, then its job lives in pg, as it would
    # without eager mode
    sent = plain.apply_async((1,), queue=pg_queue(app))
    assert sent.result == 1
    assert where(app, sent.id) == ["pg"]
