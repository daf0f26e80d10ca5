"""The keeper thread against a real database: it renews what is held when it is due, and
a process running one short task after another does not wake it for each one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from celery_leases.checkpoint import stop_point
from celery_leases.db.rows import Claimed
from celery_leases.db.store import Store
from celery_leases.errors import LeaseLost
from celery_leases.lease import Lease
from celery_leases.settings import DEFAULTS, validate
from celery_leases.worker.keeper import Keeper
from tests.support.message import job_message
from tests.support.proxy import TcpProxy
from tests.support.scenario import wait_for
from tests.support.worker import REPO_ROOT

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


def ended(store: Store, keeper: Keeper, lease: Lease) -> None:
    """The attempt of ``lease`` ends done, as an attempt ends: its end recorded, then let go."""
    assert store.finish(lease.job_id, lease.token, result="null")
    lease.released = True
    keeper.remove(lease)


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
    ended(store, keeper, first)
    wait_for(lambda: asleep(keeper), timeout=5, what="the keeper asleep")

    # When 20 short tasks are held and let go one after another
    woken = 0
    for n in range(20):
        lease = held_lease(store, keeper, f"short-{n}")
        keeper.add(lease)
        woken += keeper._wake.is_set()
        ended(store, keeper, lease)

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
    ended(store, keeper, first)
    wait_for(lambda: asleep(keeper), timeout=5, what="the keeper asleep")

    # When a lease whose stall timeout (0.1 s) ends long before that is added
    lease = held_lease(store, keeper, "stalls", renew=10.0)
    lease.stall_timeout = 0.1
    keeper.add(lease)

    # Then the keeper wakes for it and sees the stall when it happens, not at its next tick
    wait_for(lambda: lease.stall_reported, timeout=5, what="the stall seen")


def holder_of(store: Store, job_id: str) -> str | None:
    """The holder whose renewals keep the running job's lease (None: it ends by itself)."""
    job = store.get(job_id)
    assert job is not None and job.state == "running"
    return job.holder


def test_an_attempt_that_ends_without_recording_its_end_is_let_go_by_the_keeper(
    store: Store, keeper: Keeper
) -> None:
    # Given two leases of this process, bound to its holder, and a keeper renewing them
    kept = held_lease(store, keeper, "kept")
    lost = held_lease(store, keeper, "lost")
    keeper.add(kept)
    keeper.add(lost)
    assert holder_of(store, "lost") == keeper.holder

    # When one attempt ends and its end cannot be recorded (the database failed it, say)
    keeper.remove(lost)

    # Then the keeper lets its job go: its lease runs out (within one lease, not while the
    # holder renews) and the reaper sends it again; the other lease is still kept
    wait_for(lambda: holder_of(store, "lost") is None, timeout=5, what="the job let go")
    job = store.get("lost")
    assert job is not None and job.expires_in is not None and job.expires_in <= 31.0
    assert holder_of(store, "kept") == keeper.holder


def test_a_job_bound_to_the_holder_that_no_attempt_holds_is_let_go_by_the_sweep(
    store: Store, keeper: Keeper
) -> None:
    # Given a lease the keeper renews, and a job bound to its holder that no attempt of
    # this process holds (a claim whose reply was lost), claimed a while ago
    kept = held_lease(store, keeper, "kept")
    keeper.add(kept)
    held_lease(store, keeper, "unheld")
    time.sleep(0.2)

    # When the keeper sweeps its holder's jobs
    keeper.sweep(margin=0.1)

    # Then the unheld job is let go; the held one is still kept
    assert holder_of(store, "unheld") is None
    assert holder_of(store, "kept") == keeper.holder


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_lease_whose_renewals_fail_until_its_end_stops_the_attempt_at_its_next_stop_point(
    database_url: str, table_name: str
) -> None:
    # Given a job held by a keeper whose database then goes away (a proxy in between, stopped:
    # every renewal fails), on a short lease
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 0)
    proxy.start()
    proxied = database_url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")
    settings = DEFAULTS | {"database_url": proxied, "table": table_name, "db_retry_max_delay": 0.2}
    store = Store(validate(settings))
    keeper = Keeper(store)
    try:
        lease = held_lease(store, keeper, "cut-1")
        lease.duration, lease.deadline = 1.0, time.monotonic() + 1.0
        keeper.add(lease)
        stop_point(lease)  # a live lease: nothing to stop for
        proxy.stop()

        # When the keeper ticks past the lease's end, its renewals failing
        deadline = time.monotonic() + 10
        while not lease.lost and time.monotonic() < deadline:
            keeper.tick()
            time.sleep(0.2)

        # Then the lease counts as lost, and the attempt's next stop point raises LeaseLost,
        # before any checkpoint: code between checkpoints stops there
        assert lease.lost
        with pytest.raises(LeaseLost):
            stop_point(lease)
    finally:
        proxy.stop()
        store.engine.dispose()


#: A process with a keeper thread that then blocks SIGTERM in its main thread, as billiard does
#: while a pool process writes its last message to the worker; it says when, waits for a line
#: (the test has sent SIGTERM by then), says it is alive, and lets SIGTERM in.
BLOCKED_MAIN = """
import signal, sys
from pathlib import Path
from celery_leases.db.store import Store
from celery_leases.settings import DEFAULTS, validate
from celery_leases.worker.keeper import Keeper

keeper = Keeper(Store(validate(DEFAULTS | {"database_url": sys.argv[1], "table": sys.argv[2]})))
keeper.start()
status = Path(f"/proc/self/task/{keeper.native_id}/status")
for _ in range(500):  # until its thread has run far enough to set its own mask, 5 s at most
    blocked = next(line for line in status.read_text().splitlines() if line.startswith("SigBlk"))
    if int(blocked.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
        break
    keeper._stopped.wait(0.01)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("blocked", flush=True)
sys.stdin.readline()
print("alive", flush=True)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
print("not reached", flush=True)
"""


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_sigterm_waits_for_the_main_thread_of_a_process_with_a_keeper_thread(
    database_url: str, table_name: str
) -> None:
    # Given a process whose keeper thread runs, and whose main thread blocks SIGTERM (billiard,
    # while a pool process writes its death to the worker under the lock its replacement
    # shares; SIGTERM's action is the default by then)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_MAIN, database_url, table_name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "blocked\n"

        # When it gets SIGTERM (the worker sends two after a hard time limit)
        child.send_signal(signal.SIGTERM)
        with contextlib.suppress(BrokenPipeError):
            child.stdin.write("go\n")
            child.stdin.flush()

        # Then the keeper thread did not take it: it waits until the main thread lets it in,
        # and the process ends by it then
        assert child.stdout.readline() == "alive\n", "the SIGTERM killed it in another thread"
        assert child.wait(30) == -signal.SIGTERM
        assert child.stdout.read() == ""
    finally:
        child.kill()
        child.wait(30)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                with contextlib.suppress(BrokenPipeError):
                    stream.close()
