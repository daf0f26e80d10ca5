"""The "newest wins" strategy of lease keys (``lease_key_strategy="newest"``) against real
databases: a trigger of a busy key supersedes the key's job, and the key's next run has the
newest trigger's arguments."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.rows import Claimed, Refused
from celery_leases.db.store import Store, store_for
from celery_leases.errors import ConfigurationError
from celery_leases.message import KEY_HEADER, KEY_STRATEGY_HEADER, Message
from celery_leases.settings import DEFAULTS, validate
from celery_leases.worker.keeper import all_keepers
from tests.support.memory import memory_app
from tests.support.message import job_message

OWNER = "worker-a/1"
KEY = "account:42"


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


def trigger(job_id: str, since: int = 0, strategy: str = "newest") -> Message:
    return job_message(
        job_id,
        "tests.sync",
        args=[KEY],
        kwargs={"since": since},
        **{KEY_HEADER: KEY, KEY_STRATEGY_HEADER: strategy},
    )


def claimed(store: Store, message: Message, owner: str = OWNER) -> Claimed:
    outcome = store.claim(message, owner=owner, duration=30.0)
    assert isinstance(outcome, Claimed), outcome
    return outcome


def stop_of(store: Store, job_id: str) -> str | None:
    job = store.get(job_id)
    assert job is not None
    return job.stop_requested


def pending_message(store: Store) -> Message:
    k = store.keys
    with store.engine.connect() as connection:
        text = connection.execute(sa.select(k.c.pending).where(k.c.lease_key == KEY)).scalar()
    return Message.loads(text)


@pytest.mark.parametrize("strategy", ["newest", "coalesce"])
def test_a_trigger_while_the_keys_job_runs_supersedes_it_only_under_newest(
    store: Store, strategy: str
) -> None:
    # Given the key's job, running
    first = trigger("t1", strategy=strategy)
    store.register(first)
    lease = claimed(store, first)

    # When another trigger of the key comes
    second = store.register(trigger("t2", since=5, strategy=strategy))

    # Then it waits on the key either way; under newest the run is asked to stop, and its
    # next checkpoint (saved first: a completed unit) says so
    assert (second.outcome, second.job_id, second.freed) == ("coalesced", "t2", False)
    expected = "supersede" if strategy == "newest" else None
    assert stop_of(store, "t1") == expected
    assert store.checkpoint("t1", lease.token, '{"page":1}') == (True, expected)
    job = store.get("t1")
    assert job is not None and job.checkpoint == {"page": 1}


def test_the_run_after_a_superseded_one_has_the_newest_triggers_arguments(store: Store) -> None:
    # Given a running job of the key, and three triggers while it runs
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    waiting = [store.register(trigger(f"t{n}", since=n)) for n in (2, 3, 4)]

    # Then they share the first one's id, and the newest one's arguments
    assert {r.job_id for r in waiting} == {"t2"}
    assert pending_message(store).kwargs == {"since": 4}

    # When the run stops at its checkpoint, superseded
    assert store.fail("t1", lease.token, error="superseded", state="superseded")

    # Then the key's next run starts at once, under the shared id, with the newest arguments
    followup = store.settle(KEY).followup
    assert followup is not None and (followup.id, followup.kwargs) == ("t2", {"since": 4})
    job = store.get("t1")
    assert job is not None and job.state == "superseded" and job.stop_requested is None
    assert isinstance(store.claim(followup, owner=OWNER, duration=30.0), Claimed)


def test_a_coalesced_key_keeps_the_first_triggers_arguments(store: Store) -> None:
    first = trigger("t1", strategy="coalesce")
    store.register(first)
    claimed(store, first)
    for n in (2, 3, 4):
        store.register(trigger(f"t{n}", since=n, strategy="coalesce"))
    assert pending_message(store).kwargs == {"since": 2}


def test_a_trigger_while_the_keys_job_is_queued_supersedes_it_at_once(store: Store) -> None:
    # Given the key's job, queued and not yet claimed
    first = trigger("t1")
    assert store.register(first).outcome == "new"

    # When a newer trigger comes
    second = store.register(trigger("t2", since=7))

    # Then the queued job ends superseded (the reaper tells the backend REVOKED), the key is
    # free, and the trigger's run starts now with its own arguments
    assert (second.outcome, second.job_id, second.freed) == ("coalesced", "t2", True)
    job = store.get("t1")
    assert job is not None
    assert (job.state, job.notify, job.expires_in) == ("superseded", "REVOKED", None)
    followup = store.settle(KEY).followup
    assert followup is not None and (followup.id, followup.kwargs) == ("t2", {"since": 7})
    # The superseded job's message is dropped at its claim
    refused = store.claim(first, owner=OWNER, duration=30.0)
    assert isinstance(refused, Refused) and refused.reason == "superseded"


def test_a_delivery_sent_by_name_supersedes_the_keys_queued_job_at_its_claim(
    store: Store,
) -> None:
    # Given the key's job, queued
    store.register(trigger("t1"))

    # When a worker receives a newest trigger of the key sent by name (never recorded)
    by_name = job_message(
        "t2",
        "tests.sync",
        args=[KEY],
        kwargs={"since": 3},
        recorded=False,
        **{KEY_HEADER: KEY, KEY_STRATEGY_HEADER: "newest"},
    )
    refused = store.claim(by_name, owner=OWNER, duration=30.0)

    # Then it waits on the key, the queued job is superseded, and its run can start now
    assert isinstance(refused, Refused)
    assert (refused.reason, refused.serving, refused.freed) == ("coalesced", "t2", True)
    job = store.get("t1")
    assert job is not None and job.state == "superseded"
    followup = store.settle(KEY).followup
    assert followup is not None and (followup.id, followup.kwargs) == ("t2", {"since": 3})


def test_a_trigger_never_supersedes_the_run_recorded_for_its_own_waiting_triggers(
    store: Store,
) -> None:
    # Given a superseded run whose follow-up was recorded for the triggers waiting on the key
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    store.register(trigger("t2", since=2))
    assert store.fail("t1", lease.token, error="superseded", state="superseded")
    assert store.settle(KEY).followup is not None

    # When a trigger that read the key before that follow-up existed pends as that id
    # (the follow-up t2, queued, holds the key)
    assert store._supersede(KEY, "t2") is None

    # Then the follow-up is left alone
    job = store.get("t2")
    assert job is not None and job.state == "queued"


def test_a_stale_attempt_of_a_superseded_job_is_still_fenced(store: Store) -> None:
    # Given a superseded run whose lease expired before its next checkpoint, claimed again
    first = trigger("t1")
    store.register(first)
    stale = claimed(store, first)
    store.register(trigger("t2", since=2))
    store.release("t1")
    fresh = claimed(store, first, owner="worker-b/1")

    # Then the stale attempt writes nothing, nor ends the job; the new attempt keeps the
    # supersede (a claim keeps it, as it keeps a cancel) and ends the job at its checkpoint
    assert store.checkpoint("t1", stale.token, '{"page":9}') == (False, None)
    assert not store.fail("t1", stale.token, error="superseded", state="superseded")
    assert store.checkpoint("t1", fresh.token, '{"page":1}') == (True, "supersede")
    assert store.fail("t1", fresh.token, error="superseded", state="superseded")
    job = store.get("t1")
    assert job is not None and (job.state, job.checkpoint) == ("superseded", {"page": 1})


def test_a_cancel_stands_and_a_shutdown_hands_a_superseded_job_back_ended(store: Store) -> None:
    # A pending cancel is not overwritten by a newer trigger
    store.register(first := trigger("t1"))
    claimed(store, first)
    assert store.request_stop(["t1"], "cancel") == 1
    store.register(trigger("t2"))
    assert stop_of(store, "t1") == "cancel"

    # A shutdown's preemption does not overwrite a supersede, and a hand-back ends the job
    other = job_message("u1", "tests.sync", args=["k2"], **{KEY_HEADER: "k2"})
    store.register(other)
    lease = claimed(store, other)
    newer = job_message("u2", "tests.sync", **{KEY_HEADER: "k2", KEY_STRATEGY_HEADER: "newest"})
    store.register(newer)
    assert store.request_stop_owned_by("worker-a", "preempt") == 0
    assert store.hand_back("u1", lease.token, reap_in=0.0) == "superseded"
    job = store.get("u1")
    assert job is not None and (job.state, job.notify) == ("superseded", "REVOKED")


def test_a_run_that_ignores_the_supersede_and_ends_done_leaves_the_newest_run_to_follow(
    store: Store,
) -> None:
    # Given a run asked to stop superseded, on a worker older than the strategy: its
    # checkpoints ignore a stop request it does not know, and it ends done
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    store.register(trigger("t2", since=2))
    store.register(trigger("t3", since=3))
    assert store.finish("t1", lease.token, result="null")

    # Then it served no trigger (it started before them): their run follows, newest args
    settled = store.settle(KEY)
    assert not settled.served
    assert settled.followup is not None
    assert (settled.followup.id, settled.followup.kwargs) == ("t2", {"since": 3})


# -- through Celery: the task option, a real attempt, the result backend ------------------


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = memory_app("newest_tests", database_url, table_name)

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.newest",
        lease_key="acct:{account}",
        lease_key_strategy="newest",
    )
    def newest(self: LeasedTask, account: str, since: int = 0) -> Any:
        for page in range(since, since + 3):
            if page == 1 and since == 0:  # two newer calls while this one runs
                self.delay(account, since=10)
                self.delay(account, since=20)
            self.save_cursor({"page": page + 1})
            self.checkpoint({"page": page + 1})
        return "done"

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="tests.sync", lease_key="acct:{account}"
    )
    def sync(self: LeasedTask, account: str, since: int = 0) -> Any:
        return since

    yield app
    store = store_for(settings_for(app))
    for keeper in all_keepers():
        if keeper.store is store:
            keeper.stop()
            keeper.join(timeout=5)
    store.engine.dispose()
    app.close()


def published(app: Celery) -> list[Any]:
    """The (id, kwargs) of the task messages waiting in the memory broker's default queue."""
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue(app.conf.task_default_queue, no_ack=True)
        try:
            found = []
            while True:
                try:
                    message = queue.get(block=False)
                except queue.Empty:
                    return found
                found.append((message.headers["id"], message.decode()[1]))
        finally:
            queue.close()


def test_a_running_attempt_stops_superseded_at_its_next_checkpoint(app: Celery) -> None:
    # When a run of the key is triggered twice more while it runs (after its first page)
    store = store_for(settings_for(app))
    result = app.tasks["tests.newest"].apply(("42",), task_id="run-1")

    # Then it stopped at the checkpoint after those triggers, its cursor as committed, and
    # ended superseded: REVOKED in Celery
    job = store.get("run-1")
    assert job is not None and job.state == "superseded", (job, result.result)
    assert job.checkpoint == {"page": 2} and store.cursor("acct:42") == {"page": 2}
    assert app.AsyncResult("run-1").state == "REVOKED"
    with pytest.raises(TaskRevokedError, match="superseded"):
        app.AsyncResult("run-1").get(timeout=1, propagate=True)
    # And the key's next run was sent at once, with the newest call's arguments
    [(followup_id, kwargs)] = published(app)
    assert kwargs == {"since": 20}
    followup = store.get(followup_id)
    assert followup is not None and followup.state == "queued"


def test_one_call_may_ask_for_newest_and_a_queued_job_is_superseded_at_once(
    app: Celery,
) -> None:
    sync = app.tasks["tests.sync"]
    store = store_for(settings_for(app))
    first = sync.delay("42")

    second = sync.apply_async(("42",), {"since": 5}, lease_key_strategy="newest")

    assert store.get(first.id).state == "superseded"  # type: ignore[union-attr]
    assert first.state == "REVOKED"  # told at once, not at the reaper's next pass
    assert published(app) == [(first.id, {}), (second.id, {"since": 5})]
    assert store.get(second.id).state == "queued"  # type: ignore[union-attr]


def test_a_retry_stored_after_its_job_was_superseded_leaves_it_revoked_for_the_client(
    app: Celery,
) -> None:
    from types import SimpleNamespace

    from celery_leases.worker.signals import keep_revoked_after_retry

    # Given a job superseded by a newer trigger after its retry's message was sent and before
    # the retrying trace stored RETRY (Celery stores it after sending)
    sync = app.tasks["tests.sync"]
    first = sync.delay("42")
    sync.apply_async(("42",), {"since": 5}, lease_key_strategy="newest")
    app.backend.mark_as_retry(first.id, RuntimeError("retried"))

    # When the task_retry receiver runs after that write
    keep_revoked_after_retry(sender=sync, request=SimpleNamespace(id=first.id))

    # Then its client sees REVOKED, not a RETRY its get() would wait on forever
    assert first.state == "REVOKED"


def test_a_strategy_that_is_none_is_refused(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="lease_key_strategy"):
        app.tasks["tests.sync"].apply_async(("42",), lease_key_strategy="latest")
    with pytest.raises(ConfigurationError, match="lease_key_strategy"):

        @app.task(base=LeasedTask, shared=False, name="tests.bad", lease_key_strategy="oldest")
        def bad() -> None:
            return None

        bad.name  # noqa: B018  (binds the task)
