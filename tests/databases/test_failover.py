"""A failover to an asynchronous replica that missed the last commits never issues a fencing
token twice.

A private PostgreSQL primary and its streaming replica (``tests/support/replica.py``); the
store connects through both (libpq multi-host, ``target_session_attrs=read-write``), so it
follows the promotion by itself, as a worker's would. The replica misses attempt B's claim and
checkpoint, then is promoted: there the job is still at attempt A's token. Attempt B is alive
and does not know of the failover, so the token the next claim issues there must not be B's:
B's writes must be refused, and the job's tokens must keep growing.

And a failover of a synchronous pair (the chaos driver's ``--database postgres-failover``) loses
no commit, and can happen again: the harness builds a new standby after each.

PostgreSQL only (the pair is the test's own: the shared servers are not used).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from celery_leases.db import migrations
from celery_leases.db.rows import Claimed, Job
from celery_leases.db.store import Store
from celery_leases.errors import StoreUnavailable
from celery_leases.message import Message
from celery_leases.settings import DEFAULTS, validate
from tests.support.message import job_message
from tests.support.replica import ReplicatedPostgres, replicated_postgres
from tests.support.scenario import wait_for

JOB = "failover-1"
#: Attempt A's lease: short, so it is over (by the database's clock) when B claims the job.
A_LEASE = 1.0
#: B's and C's leases: far longer than the test, so each is live until the end.
LEASE = 300.0
#: Seconds the store may take to reach the promoted replica.
RECONNECT_TIMEOUT = 30.0


@pytest.fixture
def pair() -> Iterator[ReplicatedPostgres]:
    """A primary and its streaming replica of this test's own, removed at teardown."""
    with replicated_postgres() as pair:
        yield pair


@pytest.fixture
def store(pair: ReplicatedPostgres) -> Iterator[Store]:
    """A store on both clusters (the multi-host URL), its jobs table made on the primary."""
    store = Store(validate(DEFAULTS | {"database_url": pair.url, "table": "leases_failover"}))
    migrations.upgrade(store)
    yield store
    store.engine.dispose()


def claim(store: Store, message: Message, owner: str, duration: float) -> Claimed:
    """Claim the job of ``message`` as attempt ``owner``; the claim must succeed."""
    outcome = store.claim(message, owner=owner, duration=duration, holder=None)
    assert isinstance(outcome, Claimed), outcome
    return outcome


def checkpoint(store: Store, token: int, state: dict[str, object]) -> tuple[bool, str | None]:
    """Save ``state`` as the job's checkpoint under the lease ``token``: (saved, stop)."""
    return store.checkpoint(JOB, token, json.dumps(state))


def job(store: Store) -> Job:
    """The job as the database the store reaches now has it."""
    found = store.get(JOB)
    assert found is not None
    return found


def lease_over(job: Job) -> bool:
    """The job's lease has ended, by the database's clock."""
    return job.expires_in is not None and job.expires_in <= 0


def job_after_failover(store: Store) -> Job:
    """The job, read once the store reaches a database again: its first operations after the
    primary died may meet the dead connection (``StoreUnavailable``) before it reconnects."""
    deadline = time.monotonic() + RECONNECT_TIMEOUT
    while True:
        try:
            return job(store)
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_failover_to_a_replica_that_missed_a_claim_never_issues_its_token_again(
    pair: ReplicatedPostgres, store: Store
) -> None:
    # Given a job claimed by attempt A, on a short lease, and checkpointed on the primary;
    # the replica has replayed all of it
    message = job_message(JOB)
    store.register(message)
    a = claim(store, message, "worker-a/1/1", A_LEASE)
    assert checkpoint(store, a.token, {"n": 1}) == (True, None)
    assert pair.serving_port() == pair.primary.port
    pair.wait_replayed()

    # And a replica that then falls behind: it misses A's lease running out, and attempt B
    # claiming the job and checkpointing, all committed on the primary
    pair.stop_replica()
    wait_for(lambda: lease_over(job(store)), timeout=10, interval=0.05, what="A's lease to end")
    b = claim(store, message, "worker-b/1/1", LEASE)
    assert b.token > a.token
    assert checkpoint(store, b.token, {"n": 2}) == (True, None)

    # When the primary crashes and the replica is promoted, the store following it there,
    # where B's commits never happened: the job is still A's, its lease over
    pair.crash_primary()
    pair.promote_replica()
    promoted = job_after_failover(store)
    assert pair.serving_port() == pair.replica.port
    assert (promoted.state, promoted.token, promoted.checkpoint) == ("running", a.token, {"n": 1})
    assert lease_over(promoted)
    # And B's attempt, whose writes are refused there, can tell why: the database is behind it
    assert checkpoint(store, b.token, {"n": 3, "by": "B"}) == (False, None)
    assert store.lost_commits(JOB, b.token)

    # And attempt C claims the job there and checkpoints
    c = claim(store, message, "worker-c/1/1", LEASE)
    assert checkpoint(store, c.token, {"n": 2, "by": "C"}) == (True, None)

    # Then C's token was never issued before, and still grows: it is not B's, whose attempt
    # is alive and holds it
    tokens = f"tokens A={a.token}, B={b.token}, C={c.token}"
    assert c.token != b.token, f"the promoted database issued B's token again, to C: {tokens}"
    assert c.token > b.token, f"the token went backwards across the failover: {tokens}"

    # And B, unaware of the failover, is fenced out: its checkpoint and its finish are refused
    assert checkpoint(store, b.token, {"n": 3, "by": "B"}) == (False, None)
    assert store.finish(JOB, b.token, result=json.dumps("B")) is False
    assert not store.lost_commits(JOB, b.token)  # now a newer attempt's token refuses them

    # And the job runs under C's lease, with C's checkpoint
    final = job(store)
    assert (final.state, final.token, final.checkpoint) == ("running", c.token, {"n": 2, "by": "C"})


@pytest.fixture
def synchronous_store() -> Iterator[tuple[ReplicatedPostgres, Store]]:
    """A synchronous pair of this test's own and a store on both clusters."""
    with replicated_postgres(synchronous=True) as pair:
        store = Store(validate(DEFAULTS | {"database_url": pair.url, "table": "leases_sync"}))
        migrations.upgrade(store)
        yield pair, store
        store.engine.dispose()


def test_a_failover_of_a_synchronous_pair_loses_no_commit_and_can_happen_again(
    synchronous_store: tuple[ReplicatedPostgres, Store],
) -> None:
    pair, store = synchronous_store
    first, second = pair.primary.port, pair.replica.port
    # Given a job claimed and checkpointed on the primary (each commit waited for the standby)
    message = job_message(JOB)
    store.register(message)
    a = claim(store, message, "worker-a/1/1", LEASE)
    assert checkpoint(store, a.token, {"n": 1}) == (True, None)

    # When the primary crashes and the standby is promoted
    done = pair.fail_over()

    # Then the promoted server has every commit: the attempt's lease and checkpoint hold there
    promoted = job_after_failover(store)
    assert (done.old_port, done.new_port) == (first, second)
    assert pair.serving_port() == second
    assert (promoted.state, promoted.token, promoted.checkpoint) == ("running", a.token, {"n": 1})
    assert checkpoint(store, a.token, {"n": 2}) == (True, None)
    assert not store.lost_commits(JOB, a.token)

    # And a second failover, to the standby built on the first primary's port, loses nothing
    again = pair.fail_over()
    assert (again.old_port, again.new_port) == (second, first)
    final = job_after_failover(store)
    assert pair.serving_port() == first
    assert (final.token, final.checkpoint) == (a.token, {"n": 2})
    assert pair.synchronous_ready()
