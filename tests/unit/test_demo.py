"""The webhook-sync example: the exactly-once storage of a page and its checkpoint.

Its demo end to end, with real workers, is in tests/e2e/test_demo.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, _state

from celery_leases import LeasedTask, LeaseLost
from celery_leases.lease import Lease, current
from celery_leases.rows import Claimed
from tests.support.message import job_message


@pytest.fixture
def example() -> Iterator[ModuleType]:
    """The example's app module, imported without leaving its app as the current app."""
    previous = _state.get_current_app()
    import examples.webhook_sync.app as module

    previous.set_current()
    yield module


@contextmanager
def running(lease: Lease) -> Iterator[Lease]:
    """Run the block as the attempt holding ``lease`` (what LeasedTask does around run())."""
    current.stack.append(lease)
    try:
        yield lease
    finally:
        current.stack.remove(lease)


def attempt(job_id: str, claimed: Claimed | Any, owner: str) -> Lease:
    assert isinstance(claimed, Claimed)
    return Lease(job_id, claimed.token, claimed.attempt, claimed.checkpoint, owner, 30.0, 10.0)


def test_a_stale_attempt_can_neither_store_a_page_nor_move_the_cursor(
    example: ModuleType, database_url: str, table_name: str
) -> None:
    from examples.webhook_sync import sink
    from examples.webhook_sync.upstream import generate_events

    app = Celery("exactly_once", set_as_current=False)
    app.conf.update(leases_database_url=database_url, leases_table=table_name)

    @app.task(base=LeasedTask, bind=True, name="exactly_once.sync", shared=False)  # type: ignore[untyped-decorator]
    def sync(self: LeasedTask) -> None:
        """Only its leases settings and checkpoint() are used."""

    store = sync.lease_store
    engine = sa.create_engine(database_url)
    table = sink.events_table(f"{table_name}_events")
    page = generate_events("exactly-once", "acct_1", 50)
    after_page = {"cursor": page[-1]["id"], "page": 1, "done": 50}
    try:
        sink.create(engine, table)
        # Given a job whose first attempt's lease expired and was claimed again by a second one
        job_id = f"job-{uuid.uuid4().hex}"
        sent = job_message(job_id, sync.name)
        store.register(sent)
        stale = attempt(job_id, store.claim(sent, owner="w1/1", duration=30.0), "w1/1")
        assert store.release(job_id)
        fresh = attempt(job_id, store.claim(sent, owner="w2/2", duration=30.0), "w2/2")
        assert fresh.token > stale.token

        # When the first (stale) attempt stores a page with its checkpoint
        with running(stale), pytest.raises(LeaseLost):
            example.store_page(sync, engine, table, "acct_1", page, after_page, progress=(50, 100))

        # Then the transaction rolled back: no event stored, the cursor did not move
        assert sink.count(engine, table, "acct_1") == 0
        job = store.get(job_id)
        assert job is not None
        assert (job.checkpoint, job.progress_done, job.owner) == (None, None, "w2/2")

        # And the attempt holding the lease stores the same page, and its checkpoint, once
        with running(fresh):
            example.store_page(sync, engine, table, "acct_1", page, after_page, progress=(50, 100))
        assert sorted(sink.stored_ids(engine, table, "acct_1")) == sorted(e["id"] for e in page)
        job = store.get(job_id)
        assert job is not None
        assert (job.checkpoint, job.progress_done, job.progress_total) == (after_page, 50, 100)
    finally:
        engine.dispose()
        store.engine.dispose()
