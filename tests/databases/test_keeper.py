"""The keeper thread against a real database: it renews what is held when it is due, and
a process running one short task after another does not wake it for each one."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from celery_leases.db.rows import Claimed
from celery_leases.db.store import Store
from celery_leases.lease import Lease
from celery_leases.settings import DEFAULTS, validate
from celery_leases.worker.keeper import Keeper
from tests.support.message import job_message
from tests.support.scenario import wait_for

RENEW = 0.3  # seconds between renew ticks in these tests


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


@pytest.fixture
def keeper(store: Store) -> Iterator[Keeper]:
    keeper = Keeper(store)
    keeper.start()
    yield keeper
    keeper.stop()
    keeper.join(timeout=10)


def held_lease(store: Store, keeper: Keeper, job_id: str, renew: float = RENEW) -> Lease:
    """A new job claimed by this process, kept by ``keeper``'s holder, as an attempt holds it
    (a 30 s lease)."""
    owner = f"w/{os.getpid()}"
    outcome = store.claim(
        job_message(job_id, "tests.job", recorded=False),
        owner=owner,
        duration=30.0,
        holder=keeper.holder_for(owner, 30.0),
    )
    assert isinstance(outcome, Claimed), outcome
    lease = Lease(job_id, outcome.token, outcome.attempt, None, owner, 30.0, renew)
    lease.bound = outcome.bound
    return lease


def asleep(keeper: Keeper) -> bool:
    """The keeper has gone back to sleep, knowing when it wakes next."""
    return keeper._wakes_at is not None and not keeper._wake.is_set()


def expiry(store: Store, job_id: str) -> float:
    job = store.get(job_id)
    assert job is not None and job.expires_in is not None
    return job.created_at + job.age + job.expires_in  # the database clock's expiry time


def test_short_tasks_back_to_back_do_not_wake_the_keeper_and_a_long_one_is_renewed(
    store: Store, keeper: Keeper
) -> None:
    # Given a keeper that has held one lease and let it go (it now sleeps a renew interval)
    first = held_lease(store, keeper, "first")
    keeper.add(first)
    keeper.remove(first)
    wait_for(lambda: asleep(keeper), timeout=5, what="the keeper asleep")

    # When 20 short tasks are held and let go one after another
    woken = 0
    for n in range(20):
        lease = held_lease(store, keeper, f"short-{n}")
        keeper.add(lease)
        woken += keeper._wake.is_set()
        keeper.remove(lease)

    # Then none of them woke it
    assert woken == 0

    # And when a task holds its lease past a renew interval, the keeper renews it: its
    # expiry moves on, a renew interval or two after the claim
    long = held_lease(store, keeper, "long")
    claimed = expiry(store, "long")
    keeper.add(long)
    wait_for(lambda: expiry(store, "long") > claimed, timeout=3 * RENEW + 2, what="a renewal")
    assert long.deadline > time.monotonic() + 25.0 and not long.lost


def test_a_lease_with_a_stall_deadline_before_the_next_tick_wakes_the_keeper(
    store: Store, keeper: Keeper
) -> None:
    # Given a keeper asleep until its next tick, a renew interval (10 s) away
    first = held_lease(store, keeper, "first", renew=10.0)
    keeper.add(first)
    keeper.remove(first)
    wait_for(lambda: asleep(keeper), timeout=5, what="the keeper asleep")

    # When a lease whose stall timeout (0.1 s) ends long before that is added
    lease = held_lease(store, keeper, "stalls", renew=10.0)
    lease.stall_timeout = 0.1
    keeper.add(lease)

    # Then the keeper wakes for it and sees the stall when it happens, not at its next tick
    wait_for(lambda: lease.stall_reported, timeout=5, what="the stall seen")
