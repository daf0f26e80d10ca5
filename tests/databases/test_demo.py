"""The webhook-sync example: the exactly-once storage of a page, the account's cursor and the
run's checkpoint.

Its demo end to end, with real workers, is in tests/workers/test_demo.py.
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
from celery_leases.db.rows import Claimed
from celery_leases.db.store import Store
from celery_leases.lease import Lease, current
from celery_leases.message import KEY_HEADER
from tests.support.message import job_message

KEY = "account:acct_1"


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


def attempt(store: Store, job_id: str, claimed: Claimed | Any, owner: str) -> Lease:
    """The lease of the attempt that made the claim ``claimed``, as LeasedTask builds it."""
    assert isinstance(claimed, Claimed)
    lease = Lease(
        job_id, claimed.token, claimed.attempt, claimed.checkpoint, owner, 30.0, 10.0, key=KEY
    )
    lease.read_cursor = lambda: store.cursor(KEY)
    return lease


def test_a_stale_attempt_can_neither_store_a_page_nor_move_the_cursor(
    example: ModuleType, database_url: str, table_name: str
) -> None:
    from examples.webhook_sync import sink
    from examples.webhook_sync.demo.upstream import generate_events

    app = Celery("exactly_once", set_as_current=False)
    app.conf.update(leases_database_url=database_url, leases_table=table_name)

    @app.task(base=LeasedTask, bind=True, name="exactly_once.sync", shared=False)  # type: ignore[untyped-decorator]
    def sync(self: LeasedTask) -> None:
        """Only its leases settings and checkpoint() are used."""

    store = sync.lease_store
    engine = sa.create_engine(database_url)
    table = sink.events_table(f"{table_name}_events")
    page = generate_events("exactly-once", "acct_1", 50)
    cursor = {"after": page[-1]["id"], "events": 50}
    run = {"started_after": None, "pages": 1, "events": 50, "until": 100}
    try:
        sink.create(engine, table)
        # Given a job of the account's key whose first attempt's lease expired and was claimed
        # again by a second one
        job_id = f"job-{uuid.uuid4().hex}"
        sent = job_message(job_id, sync.name, args=["acct_1"], **{KEY_HEADER: KEY})
        store.register(sent)
        stale = attempt(store, job_id, store.claim(sent, owner="w1/1", duration=30.0), "w1/1")
        assert store.release(job_id)
        fresh = attempt(store, job_id, store.claim(sent, owner="w2/2", duration=30.0), "w2/2")
        assert fresh.token > stale.token

        # When the first (stale) attempt stores a page with the cursor and its checkpoint
        with running(stale), pytest.raises(LeaseLost):
            example.store_page(
                sync,
                engine,
                table,
                "acct_1",
                page,
                cursor=cursor,
                checkpoint=run,
                progress=(50, 100),
            )

        # Then the transaction rolled back: no event stored, neither the account's cursor nor
        # the job's checkpoint moved
        assert sink.count(engine, table, "acct_1") == 0
        assert store.cursor(KEY) is None
        job = store.get(job_id)
        assert job is not None
        assert (job.checkpoint, job.progress_done, job.owner) == (None, None, "w2/2")

        # And the attempt holding the lease stores the same page, the cursor after it and its
        # checkpoint, once; the key's next run reads that cursor
        with running(fresh):
            example.store_page(
                sync,
                engine,
                table,
                "acct_1",
                page,
                cursor=cursor,
                checkpoint=run,
                progress=(50, 100),
            )
        assert sorted(sink.stored_ids(engine, table, "acct_1")) == sorted(e["id"] for e in page)
        assert store.cursor(KEY) == cursor
        job = store.get(job_id)
        assert job is not None
        assert (job.checkpoint, job.progress_done, job.progress_total) == (run, 50, 100)
    finally:
        engine.dispose()
        store.engine.dispose()
