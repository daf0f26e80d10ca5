"""``await task.adelay()`` / ``aapply_async()``: a leased call from ``async def`` code records
and publishes the job without holding the event loop while the database answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.store import Store, store_for

#: Event-loop ticks (10 ms apart) the call must let run while its INSERT waits.
TICKS = 20


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("async", broker="memory://", set_as_current=False)
    app.conf.update(leases_database_url=database_url, leases_table=table_name)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.sync_account")
    def sync_account(self: LeasedTask, account: str) -> str:
        return account

    yield app
    store_for(settings_for(app)).engine.dispose()
    app.close()


def held_back(store: Store, job_id: str) -> tuple[sa.Connection, Any]:
    """An uncommitted row of ``job_id`` on another connection: a record of that id waits for
    it (its transaction's row lock; on SQLite, the file's write lock)."""
    connection = store.engine.connect()
    transaction = connection.begin()
    row = {"id": job_id, "task": "x", "message": "{}", "state": "done", "created_at": 0.0}
    connection.execute(sa.insert(store.table).values(row))
    return connection, transaction


def test_adelay_records_and_publishes_while_the_event_loop_goes_on(app: Celery) -> None:
    task = app.tasks["tests.sync_account"]
    store = store_for(settings_for(app))
    store.get("warm-up")  # the table, the connection
    connection, transaction = held_back(store, "a-1")

    async def call() -> tuple[int, Any]:
        # When a coroutine awaits the call while its INSERT waits for the other transaction
        pending = asyncio.ensure_future(task.aapply_async(("acme",), task_id="a-1"))
        ticks = 0
        while ticks < TICKS:  # the event loop goes on meanwhile
            await asyncio.sleep(0.01)
            ticks += 1
        assert not pending.done(), "the record did not wait: nothing was tested"
        transaction.rollback()
        return ticks, await pending

    try:
        ticks, result = asyncio.run(call())
    finally:
        connection.close()

    # Then the loop ran while it waited, and the job is recorded and published as by
    # apply_async: its row queued with its arguments
    assert ticks == TICKS
    assert result.id == "a-1"
    job = store.get("a-1")
    assert job is not None and job.state == "queued" and job.message.args == ["acme"]


def test_adelay_is_delay_for_async_code(app: Celery) -> None:
    task = app.tasks["tests.sync_account"]

    result = asyncio.run(task.adelay("globex"))

    job = store_for(settings_for(app)).get(result.id)
    assert job is not None and job.state == "queued" and job.message.args == ["globex"]
