"""The lease store against real databases: claims, fencing, the database clock, the reaper."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases.db.errors import ended_idle_transaction
from celery_leases.db.rows import Claimed, Reaped, Refused
from celery_leases.db.statements import GAVE_UP_MAX_ATTEMPTS, GAVE_UP_NO_PROGRESS
from celery_leases.db.store import Store
from celery_leases.errors import InvalidJobState, JobNotFound
from celery_leases.message import Message
from celery_leases.settings import DEFAULTS, validate
from tests.support.concurrent import at_once
from tests.support.driver import sent
from tests.support.message import job_message

OWNER = "worker-a/1"


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


_messages: dict[str, Message] = {}


@pytest.fixture(autouse=True)
def _new_messages() -> None:
    _messages.clear()


def message(job_id: str, task: str = "tests.job", args: Any = (1,)) -> Message:
    """The one message of ``job_id`` in this test: the same version at its register and its
    claims, as a client's publish and the worker's delivery of it."""
    if job_id not in _messages:
        _messages[job_id] = job_message(job_id, task, args=args)
    return _messages[job_id]


def register(store: Store, job_id: str, *, task: str = "tests.job", args: Any = (1,)) -> bool:
    return store.register(message(job_id, task, args)).outcome == "new"


def claim(
    store: Store,
    job_id: str,
    *,
    owner: str = OWNER,
    duration: float = 30.0,
    holder: str | None = None,
) -> Any:
    return store.claim(message(job_id), owner=owner, duration=duration, holder=holder)


def holder_of(store: Store, name: str = "h1", shortest: float = 30.0) -> str:
    """A keeper's holder row ``name``, renewed now (no session: its renewals keep it)."""
    store.renew_holder(name, owner=OWNER, shortest=shortest)
    return name


def claimed(store: Store, job_id: str, **options: Any) -> Claimed:
    outcome = claim(store, job_id, **options)
    assert isinstance(outcome, Claimed), outcome
    return outcome


def move_back(store: Store, job_id: str, column: str = "expires_at", seconds: float = 100) -> None:
    """Move one of the job's times ``seconds`` into the past (expires a lease, ages a job)."""
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(t).where(t.c.id == job_id).values({column: t.c[column] - seconds})
        )


def reap(store: Store, **options: Any) -> Reaped:
    settings = {"batch": 100, "grace": 30.0, "max_stalled": None, "max_attempts": None}
    return store.collect_expired(**(settings | options))


def ids(jobs: list[Any]) -> list[str]:
    return [job.id for job in jobs]


# -- claims and fencing -------------------------------------------------------------------------


def test_registering_a_job_twice_keeps_the_first_record(store: Store) -> None:
    assert register(store, "j1", args=[1]) is True
    assert store.register(job_message("j1", args=[2])).outcome == "queued"

    job = store.get("j1")
    assert job is not None
    assert (job.state, job.args, job.token, job.attempts) == ("queued", [1], 0, 0)


def full_lease(expires_in: float | None, since: float, duration: float = 30.0) -> bool:
    """Whether ``expires_in`` is a lease of ``duration`` set after ``since`` (``time.monotonic``):
    at most the duration, less at most the time since (on a loaded machine a second or more
    may pass between a write and its read: a fixed bound such as ``29 <`` fails then)."""
    elapsed = time.monotonic() - since
    return expires_in is not None and duration - elapsed - 0.01 <= expires_in <= duration + 1e-6


def test_a_claim_on_a_queued_job_wins_and_bumps_token_and_attempts(store: Store) -> None:
    register(store, "j1")

    since = time.monotonic()
    outcome = claimed(store, "j1")

    assert (outcome.attempt, outcome.checkpoint, outcome.created) == (1, None, False)
    assert outcome.token > 0 and outcome.checkpoint_age is None
    job = store.get("j1")
    assert job is not None
    assert (job.state, job.owner, job.token, job.attempts) == ("running", OWNER, outcome.token, 1)
    assert full_lease(job.expires_in, since)


def test_a_claims_token_is_above_the_database_clock_and_one_more_than_a_later_token(
    store: Store,
) -> None:
    # Given a job whose row remembers an old token: a database promoted from a replica that
    # missed the claims after token 5, while an attempt of the lost history still holds one
    register(store, "j1")
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(sa.update(t).where(t.c.id == "j1").values(token=5))

    # When it is claimed, then its token is at least the database clock in milliseconds
    # (x 1024): above any the lost history handed out before the primary failed
    now_ms = store.ping() * 1000
    first = claimed(store, "j1")
    assert first.token >= int(now_ms) * 1024 - 1024

    # And a row whose token is ahead of the clock (claims made in the same millisecond) gets
    # one more
    move_back(store, "j1")
    ahead = first.token + 10**9
    with store.engine.begin() as connection:
        connection.execute(sa.update(t).where(t.c.id == "j1").values(token=ahead))
    assert claimed(store, "j1", owner="worker-b/2").token == ahead + 1


def test_a_second_claim_while_the_lease_is_live_is_refused_as_held(store: Store) -> None:
    register(store, "j1")
    since = time.monotonic()
    claimed(store, "j1")

    outcome = claim(store, "j1", owner="worker-b/2")

    assert isinstance(outcome, Refused)
    assert (outcome.reason, outcome.owner) == ("held", OWNER)
    assert full_lease(outcome.expires_in, since)
    job = store.get("j1")
    assert job is not None and (job.attempts, job.owner) == (1, OWNER)


def test_a_claim_after_the_lease_expired_wins_with_the_next_token_and_sees_the_checkpoint(
    store: Store,
) -> None:
    register(store, "j1")
    first = claimed(store, "j1")
    assert store.checkpoint("j1", first.token, '{"step":7}') == (True, None)
    move_back(store, "j1")

    second = claimed(store, "j1", owner="worker-b/2")

    assert (second.attempt, second.checkpoint) == (2, {"step": 7})
    assert second.token > first.token
    assert second.checkpoint_age is not None and 0 <= second.checkpoint_age < 5
    job = store.get("j1")
    assert job is not None and (job.owner, job.token) == ("worker-b/2", second.token)


def test_a_stale_token_can_neither_renew_nor_checkpoint_nor_end_the_job(store: Store) -> None:
    # Given attempt 1 lost its lease and attempt 2 holds the job with a checkpoint
    register(store, "j1")
    stale = claimed(store, "j1")
    move_back(store, "j1")
    fresh = claimed(store, "j1", owner="worker-b/2")
    store.checkpoint("j1", fresh.token, '"fresh"')

    # Then every write of attempt 1 is refused
    assert store.bind("j1", stale.token, holder_of(store)) is False
    assert store.detach("j1", stale.token) is False
    assert store.checkpoint("j1", stale.token, '"stale"') == (False, None)
    assert store.finish("j1", stale.token, result='"stale"') is False
    assert store.fail("j1", stale.token, error="stale") is False
    assert store.hand_back("j1", stale.token, reap_in=0.0) is None

    # And the job is still attempt 2's
    job = store.get("j1")
    assert job is not None
    assert (job.state, job.token, job.owner, job.checkpoint) == (
        "running",
        fresh.token,
        "worker-b/2",
        "fresh",
    )
    assert job.result is None and job.error is None


def test_a_finished_job_is_done_and_a_later_claim_is_refused_as_done(store: Store) -> None:
    register(store, "j1")
    lease = claimed(store, "j1")

    assert store.finish("j1", lease.token, result='{"total":42}') is True

    job = store.get("j1")
    assert job is not None
    assert (job.state, job.owner, job.expires_in, job.result) == ("done", None, None, {"total": 42})
    assert job.finished_at is not None
    outcome = claim(store, "j1", owner="worker-b/2")
    assert isinstance(outcome, Refused) and outcome.reason == "done"
    move_back(store, "j1", "finished_at")
    assert isinstance(claim(store, "j1"), Refused)


def test_a_claim_of_an_unknown_id_creates_the_job_already_claimed(store: Store) -> None:
    outcome = claimed(store, "sent-by-name")

    assert (outcome.attempt, outcome.checkpoint, outcome.created) == (1, None, True)
    job = store.get("sent-by-name")
    assert job is not None
    assert (job.state, job.owner, job.token, job.attempts, job.task, job.args) == (
        "running",
        OWNER,
        outcome.token,
        1,
        "tests.job",
        [1],
    )
    assert isinstance(claim(store, "sent-by-name", owner="worker-b/2"), Refused)


def test_a_released_job_is_queued_again_and_claimable_with_its_checkpoint(store: Store) -> None:
    register(store, "j1")
    lease = claimed(store, "j1")
    store.checkpoint("j1", lease.token, "[3]")

    assert store.hand_back("j1", lease.token, reap_in=None) == "queued"

    job = store.get("j1")
    assert job is not None
    assert (job.state, job.owner, job.expires_in, job.checkpoint) == ("queued", None, None, [3])
    again = claimed(store, "j1")
    assert again.token > lease.token and again.checkpoint == [3]


def test_a_release_with_a_reap_delay_sets_when_the_reaper_takes_the_job(store: Store) -> None:
    register(store, "j1")
    lease = claimed(store, "j1")

    since = time.monotonic()
    store.hand_back("j1", lease.token, reap_in=60.0)

    job = store.get("j1")
    assert job is not None and full_lease(job.expires_in, since, duration=60.0)


def test_a_failed_job_keeps_its_checkpoint_and_error(store: Store) -> None:
    register(store, "j1")
    lease = claimed(store, "j1")
    store.checkpoint("j1", lease.token, '{"page":4}', progress=(4, 10))

    assert store.fail("j1", lease.token, error="ValueError: boom") is True

    job = store.get("j1")
    assert job is not None
    assert (job.state, job.error, job.checkpoint, job.owner) == (
        "failed",
        "ValueError: boom",
        {"page": 4},
        None,
    )
    assert (job.progress_done, job.progress_total) == (4, 10)
    assert isinstance(claim(store, "j1"), Refused)


# -- the database clock -------------------------------------------------------------------------


def test_the_database_clock_is_epoch_seconds_close_to_this_machines_clock(store: Store) -> None:
    before = time.time()
    now = store.now()
    after = time.time()

    assert before - 1 < now < after + 1


def test_the_database_clock_has_sub_second_resolution(store: Store) -> None:
    reads = []
    started = time.monotonic()
    for _ in range(5):
        reads.append(store.now())
        time.sleep(0.013)
    elapsed = time.monotonic() - started

    assert reads == sorted(reads)
    assert reads[-1] - reads[0] <= elapsed + 0.01  # no more time than passed here
    # Whole-second clocks (SQLite's CURRENT_TIMESTAMP) would give integers, mostly equal.
    assert any(read % 1 != 0 for read in reads)
    assert len(set(reads)) > 1


def test_lease_expiry_is_computed_by_the_database_clock(store: Store) -> None:
    # (No sleep on a short lease: on a loaded machine 0.3 s passed between two claims, CI.)
    register(store, "j1")
    since = time.monotonic()
    first = claimed(store, "j1", duration=30.0)
    job = store.get("j1")
    assert job is not None and full_lease(job.expires_in, since)
    assert isinstance(claim(store, "j1", owner="worker-b/2"), Refused)

    move_back(store, "j1", seconds=30.5)  # the database's clock is now past the expiry

    assert claimed(store, "j1", owner="worker-b/2").token > first.token


# -- renewals and stop requests -----------------------------------------------------------------


def move_holder_back(store: Store, holder: str, seconds: float) -> None:
    h = store.holders
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(h).where(h.c.id == holder).values(renewed_at=h.c.renewed_at - seconds)
        )


def test_a_holders_renewal_extends_its_jobs_leases_by_their_duration(store: Store) -> None:
    holder = holder_of(store)
    register(store, "j1")
    claimed(store, "j1", duration=20.0, holder=holder)
    move_back(store, "j1", column="renewed_at", seconds=15)
    move_holder_back(store, holder, seconds=15)
    job = store.get("j1")
    assert job is not None and job.expires_in is not None and job.expires_in < 6

    since = time.monotonic()
    store.renew_holder(holder, owner=OWNER, shortest=20.0)

    job = store.get("j1")
    assert job is not None and full_lease(job.expires_in, since, duration=20.0)


def test_one_renewal_keeps_every_job_of_its_holder_and_none_another_attempt_took(
    store: Store,
) -> None:
    # Given 7 jobs of one holder: one taken over since by another attempt, one finished
    holder = holder_of(store)
    tokens = {}
    for n in range(7):
        register(store, f"j{n}")
        tokens[f"j{n}"] = claimed(store, f"j{n}", holder=holder).token
    store.release("j5")
    claimed(store, "j5", owner="worker-b/2")
    store.finish("j6", tokens["j6"], result=None)
    for n in range(5):
        move_back(store, f"j{n}", column="renewed_at", seconds=25)
    move_holder_back(store, holder, seconds=25)

    # When the holder renews once
    since = time.monotonic()
    store.renew_holder(holder, owner=OWNER, shortest=30.0)

    # Then the five it holds have their whole lease again, the others are not its own
    jobs = {n: store.get(f"j{n}") for n in range(7)}
    assert all(
        jobs[n].holder == holder and full_lease(jobs[n].expires_in, since)  # type: ignore[union-attr]
        for n in range(5)
    )
    assert jobs[5].holder != holder and jobs[5].owner == "worker-b/2"  # type: ignore[union-attr]
    assert jobs[6].state == "done" and jobs[6].holder is None  # type: ignore[union-attr]


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_renewal_never_waits_for_a_job_a_transactional_checkpoint_holds(store: Store) -> None:
    # Given two jobs of one holder, one locked by a checkpoint in a transaction still open
    holder = holder_of(store, shortest=20.0)
    register(store, "j1")
    register(store, "j2")
    claimed(store, "j1", duration=20.0, holder=holder)
    two = claimed(store, "j2", duration=20.0, holder=holder)
    move_back(store, "j1", column="renewed_at", seconds=15)
    move_holder_back(store, holder, seconds=15)
    with store.engine.connect() as connection, connection.begin():
        saved, _ = store.checkpoint("j2", two.token, '{"n": 1}', connection=connection)
        assert saved

        # When the process's renew tick runs meanwhile (in a thread: a wait would block it
        # for the database's lock timeout, 50 s on MariaDB)
        done: list[bool] = []
        tick = threading.Thread(
            target=lambda: done.append(
                store.renew_holder(holder, owner=OWNER, shortest=20.0) is None
            )
        )
        since = time.monotonic()
        tick.start()
        tick.join(timeout=20)

        # Then it wrote its holder's row only, never waiting for the locked job: the other
        # job's lease is renewed with it
        assert done == [True], "the renew tick waited for the locked row"
        job = store.get("j1")
        assert job is not None and full_lease(job.expires_in, since, duration=20.0)


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_transaction_left_idle_after_its_checkpoint_for_longer_than_the_lease_is_ended(
    store: Store,
) -> None:
    # Given a held job with a 1 s lease, and a transaction of the caller's that saved a
    # checkpoint and then sat idle (a worker frozen before its commit) for 2.5 s
    register(store, "j1")
    lease = claimed(store, "j1", duration=1.0)
    connection = store.engine.connect()
    transaction = connection.begin()
    store.checkpoint("j1", lease.token, '{"n": 1}', connection=connection, idle_limit=1.0)
    time.sleep(2.5)

    # When it commits
    with pytest.raises(sa.exc.DBAPIError) as ended:
        transaction.commit()
    connection.close()

    # Then the database has ended it: nothing of it is saved, the error says why, and the
    # row's lock is free for the reaper and the next claim
    assert ended_idle_transaction(ended.value)
    job = store.get("j1")
    assert job is not None and job.checkpoint is None
    assert isinstance(claim(store, "j1", owner="worker-b/2"), Claimed)


@pytest.mark.parametrize("database_url", ["mariadb"], indirect=True)
def test_on_mariadb_a_connection_returned_to_its_pool_gets_the_default_idle_bound_back(
    store: Store,
) -> None:
    # Given a pool of one connection, and a transactional checkpoint on it with a 3.2 s lease
    register(store, "j1")
    lease = claimed(store, "j1", duration=3.2)
    engine = sa.create_engine(store.db.url, pool_size=1, max_overflow=0)
    variable = "SELECT @@session.idle_write_transaction_timeout"
    try:
        with engine.connect() as connection, connection.begin():
            store.checkpoint("j1", lease.token, '{"n": 1}', connection=connection, idle_limit=3.2)
            during = connection.exec_driver_sql(variable).scalar()

        # When the connection goes back to the pool and is taken out again
        with engine.connect() as connection:
            after = connection.exec_driver_sql(variable).scalar()

        # Then the bound held during the caller's transaction only (the lease, rounded up),
        # not for the pool's later users
        assert (during, after) == (4, 0)
    finally:
        engine.dispose()


def test_a_stop_request_reaches_the_attempt_at_its_next_checkpoint(store: Store) -> None:
    register(store, "j1")
    register(store, "j2")
    lease = claimed(store, "j1")
    other = claimed(store, "j2")

    assert store.request_stop(["j1"], "cancel") == 1

    assert store.checkpoint("j1", lease.token, "1") == (True, "cancel")
    assert store.checkpoint("j1", lease.token, "2", progress=(2, 3)) == (True, "cancel")
    assert store.checkpoint("j2", other.token, "1") == (True, None)
    job = store.get("j1")
    assert job is not None and (job.checkpoint, job.progress_done) == (2, 2)
    # A stale token is refused whether or not the job has a stop request.
    assert store.checkpoint("j1", lease.token - 1, "3") == (False, None)


def test_a_stop_request_only_reaches_running_jobs_and_ends_with_them(store: Store) -> None:
    register(store, "queued")
    register(store, "running")
    lease = claimed(store, "running")

    assert store.request_stop(["queued", "running", "never-recorded"], "preempt") == 1
    queued = store.get("queued")
    assert queued is not None and queued.stop_requested is None

    store.finish("running", lease.token, result=None)
    job = store.get("running")
    assert job is not None and job.stop_requested is None


def test_a_stop_request_by_owner_prefix_reaches_only_that_workers_jobs(store: Store) -> None:
    for job_id, owner in (("a", "node_1/10"), ("b", "node_1/11"), ("c", "nodex1/12")):
        register(store, job_id)
        claimed(store, job_id, owner=owner)

    # "_" must not act as a LIKE wildcard: "nodex1" is another worker.
    assert store.request_stop_owned_by("node_1/", "preempt") == 2

    stops = {job.id: job.stop_requested for job in store.list_jobs()}
    assert stops == {"a": "preempt", "b": "preempt", "c": None}


# -- the reaper ---------------------------------------------------------------------------------


def test_the_reaper_leaves_live_leases_and_queued_jobs_alone(store: Store) -> None:
    register(store, "queued")
    register(store, "running")
    claimed(store, "running")

    assert reap(store) == Reaped([], [])


def test_an_expired_job_is_requeued_and_returned_once_by_sequential_reapers(store: Store) -> None:
    register(store, "j1")
    lease = claimed(store, "j1")
    store.checkpoint("j1", lease.token, '"cp"')
    move_back(store, "j1")

    since = time.monotonic()
    first = reap(store, grace=30.0)
    second = reap(store, grace=30.0)

    assert ids(first.republish) == ["j1"] and first.gave_up == []
    assert first.previous_owners == {"j1": OWNER}
    assert second == Reaped([], [])
    job = store.get("j1")
    assert job is not None
    assert (job.state, job.owner, job.checkpoint, job.stalled_attempts) == (
        "queued",
        None,
        "cp",
        0,
    )
    assert full_lease(job.expires_in, since)
    assert first.republish[0].checkpoint == "cp"


def reap_in_two_threads_at_once(store: Store) -> list[Reaped]:
    return at_once(2, lambda _: reap(store))


def test_an_expired_job_is_returned_once_when_two_reapers_run_at_the_same_time(
    store: Store,
) -> None:
    for round_ in range(5):
        # Given an expired attempt that saved no checkpoint
        job_id = f"j{round_}"
        register(store, job_id)
        claimed(store, job_id)
        move_back(store, job_id)

        # When two threads reap at once
        first, second = reap_in_two_threads_at_once(store)

        # Then exactly one of them returns the job, and it was marked once
        assert sorted(ids(first.republish) + ids(second.republish)) == [job_id]
        job = store.get(job_id)
        assert job is not None and (job.state, job.stalled_attempts) == ("queued", 1)


def test_each_notice_is_taken_by_exactly_one_of_several_reapers_running_at_once(
    store: Store, database_url: str, table_name: str
) -> None:
    # Given 60 jobs cancelled while queued, each to be told REVOKED in the result backend
    for n in range(60):
        register(store, f"j{n}")
        assert store.cancel_queued(f"j{n}")

    # When four reapers, each with a store of its own (as four processes), take notices at once
    settings = validate(DEFAULTS | {"database_url": database_url, "table": table_name})

    def take(_: int) -> list[tuple[str, str | None]]:
        own = Store(settings)
        taken = []
        try:
            while batch := own.take_notices(batch=3):
                taken += [(job.id, job.notify) for job in batch]
        finally:
            own.engine.dispose()
        return taken

    taken = [item for batch in at_once(4, take) for item in batch]

    # Then every job was handed out once, with its state to store (never without one: a job
    # taken without one was stored as FAILURE)
    assert sorted(taken) == sorted((f"j{n}", "REVOKED") for n in range(60))
    assert store.take_notices(batch=100) == []


def test_a_requeued_job_whose_message_was_lost_is_reaped_again_after_the_grace(
    store: Store,
) -> None:
    register(store, "j1")
    claimed(store, "j1")
    move_back(store, "j1")
    assert ids(reap(store, grace=30.0).republish) == ["j1"]
    assert reap(store).republish == []

    move_back(store, "j1")

    again = reap(store, grace=30.0, max_stalled=2)
    assert ids(again.republish) == ["j1"] and again.gave_up == []
    job = store.get("j1")
    assert job is not None and (job.state, job.stalled_attempts) == ("queued", 1)


def test_a_queued_job_with_no_expiry_is_never_reaped(store: Store) -> None:
    register(store, "j1")
    lease = claimed(store, "j1")
    store.hand_back("j1", lease.token, reap_in=None)

    assert reap(store) == Reaped([], [])


def crash_without_checkpoint(store: Store, job_id: str) -> None:
    claimed(store, job_id)
    move_back(store, job_id)


def test_a_job_whose_attempts_all_ended_without_a_checkpoint_is_given_up(store: Store) -> None:
    register(store, "poison")

    crash_without_checkpoint(store, "poison")
    assert ids(reap(store, max_stalled=3).republish) == ["poison"]
    crash_without_checkpoint(store, "poison")
    assert ids(reap(store, max_stalled=3).republish) == ["poison"]
    crash_without_checkpoint(store, "poison")
    third = reap(store, max_stalled=3)

    assert third.republish == [] and ids(third.gave_up) == ["poison"]
    job = store.get("poison")
    assert job is not None
    assert (job.state, job.owner, job.attempts, job.stalled_attempts) == ("failed", None, 3, 3)
    assert job.error == GAVE_UP_NO_PROGRESS and "checkpoint" in job.error
    assert job.finished_at is not None
    assert isinstance(claim(store, "poison"), Refused)


def test_an_attempt_that_saved_a_checkpoint_resets_the_count_of_stalled_attempts(
    store: Store,
) -> None:
    register(store, "j1")
    crash_without_checkpoint(store, "j1")
    reap(store, max_stalled=2)

    lease = claimed(store, "j1")
    store.checkpoint("j1", lease.token, "1")
    move_back(store, "j1")
    assert ids(reap(store, max_stalled=2).republish) == ["j1"]
    job = store.get("j1")
    assert job is not None and job.stalled_attempts == 0

    crash_without_checkpoint(store, "j1")
    assert ids(reap(store, max_stalled=2).republish) == ["j1"]


def test_a_job_that_reached_max_attempts_is_given_up_with_that_reason(store: Store) -> None:
    register(store, "j1")
    for attempt in (1, 2):
        lease = claimed(store, "j1")
        store.checkpoint("j1", lease.token, str(attempt))
        move_back(store, "j1")
        outcome = reap(store, max_stalled=3, max_attempts=2)
        assert ids(outcome.gave_up if attempt == 2 else outcome.republish) == ["j1"]

    job = store.get("j1")
    assert job is not None
    assert (job.state, job.attempts, job.checkpoint) == ("failed", 2, 2)
    assert job.error == GAVE_UP_MAX_ATTEMPTS


def test_max_attempts_without_a_stall_limit_gives_the_max_attempts_reason(store: Store) -> None:
    register(store, "j1")
    crash_without_checkpoint(store, "j1")

    outcome = reap(store, max_stalled=None, max_attempts=1)

    assert ids(outcome.gave_up) == ["j1"]
    job = store.get("j1")
    assert job is not None and job.error == GAVE_UP_MAX_ATTEMPTS


def test_the_reaper_handles_expired_jobs_in_batches_oldest_first(store: Store) -> None:
    for n in range(5):
        register(store, f"j{n}")
        claimed(store, f"j{n}")
        move_back(store, f"j{n}", seconds=100 + 10 * n)

    first = reap(store, batch=2)
    rest = reap(store, batch=10)

    assert sorted(ids(first.republish)) == ["j3", "j4"]
    assert sorted(ids(rest.republish)) == ["j0", "j1", "j2"]


def test_purge_deletes_only_finished_jobs_older_than_the_retention(store: Store) -> None:
    # Given old and recent jobs in every state
    for job_id in ("old-done", "old-failed", "new-done", "old-running", "old-queued"):
        register(store, job_id)
    leases = {job_id: claimed(store, job_id) for job_id in ("old-done", "new-done", "old-running")}
    store.finish("old-done", leases["old-done"].token, result=None)
    store.finish("new-done", leases["new-done"].token, result=None)
    lease = claimed(store, "old-failed")
    store.fail("old-failed", lease.token, error="boom")
    for job_id in ("old-done", "old-failed"):
        move_back(store, job_id, "finished_at", seconds=3600)
    for job_id in ("old-running", "old-queued"):
        move_back(store, job_id, "created_at", seconds=3600)

    # When purging what finished over 10 minutes ago
    purged = store.purge(older_than=600, batch=100)

    # Then only the old finished jobs are gone
    assert purged == 2
    left = {job.id for job in store.list_jobs(limit=100)}
    assert left == {"new-done", "old-running", "old-queued"}
    assert store.purge(older_than=600, batch=100) == 0


# -- one statement per worker operation ---------------------------------------------------------


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_claim_checkpoint_finish_and_a_renewal_of_fifty_leases_are_one_statement_each(
    store: Store,
) -> None:
    holder = holder_of(store)
    for n in range(50):
        register(store, f"j{n}")
    for n in range(1, 50):
        claimed(store, f"j{n}", holder=holder)
    register(store, "j0")

    with sent(store) as claim_sql:
        token = claimed(store, "j0", holder=holder).token
    with sent(store) as renew_sql:
        store.renew_holder(holder, owner=OWNER, shortest=30.0)
    with sent(store) as checkpoint_sql:
        assert store.checkpoint("j0", token, "1", progress=(1, 2)) == (True, None)
    with sent(store) as finish_sql:
        assert store.finish("j0", token, result="2") is True

    assert all(job.holder == holder for job in store.list_jobs(states=["running"]))
    # On PostgreSQL each is one round trip (in autocommit: no BEGIN, no COMMIT).
    assert len(claim_sql) == 1, claim_sql
    assert len(renew_sql) == 1, renew_sql
    assert len(checkpoint_sql) == 1, checkpoint_sql
    assert len(finish_sql) == 1, finish_sql


@pytest.mark.parametrize("database_url", ["mariadb"], indirect=True)
def test_on_mariadb_a_renewal_of_fifty_leases_is_one_statement_not_fifty(store: Store) -> None:
    holder = holder_of(store)
    token = 0
    for n in range(50):
        register(store, f"j{n}")
        token = claimed(store, f"j{n}", holder=holder).token

    with sent(store) as renew_sql:
        store.renew_holder(holder, owner=OWNER, shortest=30.0)
    with sent(store) as checkpoint_sql:
        store.checkpoint("j49", token, "1")

    assert len(renew_sql) == 1, renew_sql
    assert len(checkpoint_sql) == 1, checkpoint_sql


# -- hostile and odd values ---------------------------------------------------------------------


def test_ids_and_task_names_containing_sql_are_stored_and_read_back_as_plain_text(
    store: Store,
) -> None:
    hostile = f"x'); DROP TABLE {store.table.name}; --"
    register(store, hostile, task=hostile)
    lease = claimed(store, hostile)
    store.checkpoint(hostile, lease.token, '"ok"')
    claimed(store, 'y"; DELETE FROM ' + store.table.name + "; --")

    job = store.get(hostile)
    assert job is not None and (job.id, job.task, job.checkpoint) == (hostile, hostile, "ok")
    assert {job.id for job in store.list_jobs(task=hostile)} == {hostile}
    assert len(store.list_jobs(limit=10)) == 2


# -- operator actions ---------------------------------------------------------------------------


def test_a_queued_job_can_be_cancelled_and_its_message_is_then_refused(store: Store) -> None:
    register(store, "j1")

    assert store.cancel_queued("j1") is True

    job = store.get("j1")
    assert job is not None and (job.state, job.error) == ("cancelled", "cancelled by an operator")
    outcome = claim(store, "j1")
    assert isinstance(outcome, Refused) and outcome.reason == "cancelled"
    assert store.cancel_queued("j1") is False


def test_a_failed_job_requeued_by_an_operator_resumes_from_its_checkpoint(store: Store) -> None:
    register(store, "j1")
    crash_without_checkpoint(store, "j1")
    reap(store)
    lease = claimed(store, "j1")
    store.checkpoint("j1", lease.token, '"half"')
    store.fail("j1", lease.token, error="boom")

    job = store.requeue("j1")

    assert (job.state, job.error, job.finished_at, job.checkpoint) == ("queued", None, None, "half")
    assert job.stalled_attempts == 0
    assert claimed(store, "j1").checkpoint == "half"


def test_a_running_job_cannot_be_requeued_and_an_unknown_one_is_not_found(store: Store) -> None:
    register(store, "j1")
    claimed(store, "j1")

    with pytest.raises(InvalidJobState, match="job j1 is running"):
        store.requeue("j1")
    with pytest.raises(JobNotFound):
        store.requeue("never-recorded")


def test_expiring_a_running_job_lets_the_next_reaper_pass_take_it(store: Store) -> None:
    register(store, "j1")
    claimed(store, "j1")

    assert store.release("j1") is True

    assert ids(reap(store).republish) == ["j1"]
    assert store.release("j1") is False


def test_warming_compiles_the_hot_statements_and_opens_no_connection(store: Store) -> None:
    # Given a store of a process that has not used it yet
    connected: list[object] = []
    sa.event.listen(store.engine, "connect", lambda *_: connected.append(1))

    # When it is warmed (a worker's main process, before forking its pool)
    store.warm()

    # Then every hot statement is compiled, and no connection was opened
    compiled = store.db.direct._compiled
    assert all(statement in compiled for statement in store.sql.hot())
    assert connected == []
    # and a claim, checkpoint and finish after it compile nothing more
    before = len(compiled)
    register(store, "j1")
    lease = claimed(store, "j1")
    store.checkpoint("j1", lease.token, "1")
    store.finish("j1", lease.token, result="1")
    assert len(compiled) == before


def test_an_expired_copy_of_a_message_ends_a_job_only_when_no_live_lease_holds_it(
    store: Store,
) -> None:
    # Given a job an attempt runs under a live lease, one whose lease expired, and a queued one
    register(store, "held")
    held = claimed(store, "held")
    register(store, "lapsed")
    claimed(store, "lapsed")
    store.release("lapsed")
    register(store, "waiting")

    # When a worker discards an expired copy of each one's message (the reaper sent it again)
    ended = {
        job_id: store.end_unheld(job_id, state="revoked", error="expired in Celery")
        for job_id in ("held", "lapsed", "waiting")
    }

    # Then the running attempt is left alone, as Celery lets a running task go on, and the
    # other two end revoked
    assert ended == {"held": False, "lapsed": True, "waiting": True}
    assert store.checkpoint("held", held.token, "1") == (True, None)
    assert [store.get(i).state for i in ("held", "lapsed", "waiting")] == [  # type: ignore[union-attr]
        "running",
        "revoked",
        "revoked",
    ]
