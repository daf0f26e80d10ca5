"""Debounced lease keys against real databases: a burst of triggers is one job, due a quiet
period after the last trigger and never later than the maximum wait after the first, run with
the last trigger's arguments; times on the database clock."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.identity import Facts
from celery_leases.db.rows import Claimed, Refused
from celery_leases.db.store import Store, store_for
from celery_leases.errors import ArgumentsError, ConfigurationError
from celery_leases.message import DEBOUNCE_HEADER, KEY_HEADER, Message
from celery_leases.settings import DEFAULTS, validate
from tests.databases.test_keys import live_jobs, pending, published
from tests.support.message import job_message

OWNER = "worker-a/1"
KEY = "account:42"
QUIET, MAX_WAIT = 10.0, 30.0


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


def trigger(job_id: str, payload: int = 0) -> Message:
    headers = {KEY_HEADER: KEY, DEBOUNCE_HEADER: [QUIET, MAX_WAIT]}
    return job_message(job_id, "tests.sync", args=[KEY, payload], **headers)


def register(store: Store, message: Message) -> Any:
    return store.register(message, countdown=QUIET, queued_timeout=30.0, debounce=(QUIET, MAX_WAIT))


def due_in(store: Store, job_id: str) -> float:
    """Seconds until the job is due, by the database clock (``run_after``)."""
    with store.engine.connect() as connection:
        row = connection.execute(store.sql.record.facts, {"b_id": job_id}).first()
    assert row is not None
    return float(Facts(*row).due_in or 0.0)


def moved_back(store: Store, job_id: str, column: str, seconds: float) -> None:
    """Move a time of the job back by ``seconds`` in the database (no sleeping)."""
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(t).where(t.c.id == job_id).values({column: t.c[column] - seconds})
        )


def test_a_burst_of_debounced_triggers_is_one_job_with_the_last_ones_arguments(
    store: Store,
) -> None:
    first = register(store, trigger("t1", payload=1))

    later = [register(store, trigger(f"t{n}", payload=n)) for n in range(2, 6)]

    assert first.outcome == "new"
    assert {(r.outcome, r.job_id) for r in later} == {("debounced", "t1")}
    assert live_jobs(store) == ["t1"] and pending(store) is None
    job = store.get("t1")
    assert job is not None and job.message.args == [KEY, 5]
    # The message to publish is the job's, as recorded: its id, its latest version
    last = later[-1].message
    assert (last.id, last.args, last.version) == ("t1", [KEY, 5], job.message.version)


def due(value: float | None, seconds: float, since: float) -> bool:
    """Whether ``value`` is a time ``seconds`` away set after ``since`` (``time.monotonic``):
    at most that, less at most the time since (a loaded machine may take a second or more
    between a write and its read: a fixed bound would fail then)."""
    elapsed = time.monotonic() - since
    return value is not None and seconds - elapsed - 0.01 <= value <= seconds + 1e-6


def test_each_trigger_moves_the_due_time_but_never_past_the_first_plus_the_max_wait(
    store: Store,
) -> None:
    first_sent = time.monotonic()
    register(store, trigger("t1"))
    assert due(due_in(store, "t1"), QUIET, first_sent)

    # A trigger 8 s later (the job's times moved back, not slept) moves it to now + quiet
    moved_back(store, "t1", "created_at", 8.0)
    moved_back(store, "t1", "run_after", 8.0)
    second_sent = time.monotonic()
    assert due(register(store, trigger("t2")).due_in, QUIET, second_sent)
    assert due(due_in(store, "t1"), QUIET, second_sent)

    # 25 s after the first trigger, the next one is due at first + max wait: in 5 s, not 10
    moved_back(store, "t1", "created_at", 17.0)
    third = register(store, trigger("t3"))
    assert due(third.due_in, MAX_WAIT - 25, first_sent)
    assert due(due_in(store, "t1"), MAX_WAIT - 25, first_sent)


def test_a_message_before_the_due_time_is_refused_and_one_at_it_claims(store: Store) -> None:
    register(store, trigger("t1"))
    latest_sent = time.monotonic()
    latest = register(store, trigger("t2")).message

    # The first trigger's message is an older version: dropped as any stale copy is
    stale = store.claim(trigger("t1"), owner=OWNER, duration=30.0)
    early = store.claim(latest, owner=OWNER, duration=30.0)

    assert isinstance(stale, Refused) and stale.reason == "stale"
    assert isinstance(early, Refused) and early.reason == "early"
    assert due(early.expires_in, QUIET, latest_sent)
    # At its due time, the latest message claims the job
    moved_back(store, "t1", "run_after", QUIET)
    assert isinstance(store.claim(latest, owner=OWNER, duration=30.0), Claimed)


def test_a_debounced_trigger_while_the_keys_job_runs_waits_as_its_follow_up(
    store: Store,
) -> None:
    first = register(store, trigger("t1"))
    moved_back(store, "t1", "run_after", QUIET)
    assert isinstance(store.claim(first_message(store, "t1"), owner=OWNER, duration=30.0), Claimed)

    during = [register(store, trigger(f"t{n}", payload=n)) for n in range(2, 5)]

    # Coalesced as any trigger of a running key: one follow-up, never a second run at once
    assert {(r.outcome, r.job_id) for r in during} == {("coalesced", "t2")}
    assert first.outcome == "new" and live_jobs(store) == ["t1"] and pending(store) == "t2"


def test_a_debounced_trigger_after_the_jobs_due_time_waits_as_its_follow_up(
    store: Store,
) -> None:
    # Given a burst's job due already, its message on its way (a lagging queue)
    register(store, trigger("t1", payload=1))
    moved_back(store, "t1", "run_after", QUIET)
    sent = first_message(store, "t1")

    # When triggers keep coming
    later = [register(store, trigger(f"t{n}", payload=n)) for n in range(2, 5)]

    # Then they wait as its follow-up, the job and its message are left as they are, and
    # that message claims it (a chaos run saw a stream of triggers keep it stale 17 s
    # past its maximum wait)
    assert {(r.outcome, r.job_id) for r in later} == {("coalesced", "t2")}
    assert pending(store) == "t2"
    job = store.get("t1")
    assert job is not None and job.message.args == [KEY, 1]
    assert isinstance(store.claim(sent, owner=OWNER, duration=30.0), Claimed)


def test_a_lost_debounced_message_is_published_by_the_reaper_after_its_due_time(
    store: Store,
) -> None:
    # Given a burst whose last message never reached the broker (its sender died)
    register(store, trigger("t1", payload=1))
    latest = register(store, trigger("t2", payload=2)).message

    def reaped() -> list[Message]:
        found = store.collect_expired(batch=10, grace=30.0, max_stalled=None, max_attempts=None)
        return [job.message for job in found.republish]

    # Then the reaper leaves it until its due time and the queued wait after it have passed,
    # and then publishes the burst's last message
    assert reaped() == []
    moved_back(store, "t1", "expires_at", QUIET)
    assert reaped() == []
    moved_back(store, "t1", "expires_at", 30.0)
    (message,) = reaped()
    assert (message.id, message.args, message.version) == ("t1", [KEY, 2], latest.version)


def first_message(store: Store, job_id: str) -> Message:
    job = store.get(job_id)
    assert job is not None
    return job.message


def bad(account: str) -> None:
    return None


# -- LeasedTask with lease_debounce, in this process ------------------------------------------


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("debounce_tests", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        leases_database_url=database_url,
        leases_table=table_name,
        task_ignore_result=True,
        task_default_queue=table_name,
    )

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.debounced",
        lease_key="acct:{account}",
        lease_debounce=(QUIET, MAX_WAIT),
    )
    def debounced(self: LeasedTask, account: str, payload: int = 0) -> Any:
        return payload

    yield app
    store_for(settings_for(app)).engine.dispose()
    app.close()


def test_debounced_calls_share_one_id_and_publish_the_jobs_message_each_time(
    app: Celery,
) -> None:
    task = app.tasks["tests.debounced"]
    store = store_for(settings_for(app))

    results = [task.delay("42", payload=n) for n in range(3)]

    assert len({r.id for r in results}) == 1
    assert published(app) == [results[0].id] * 3
    job = store.get(results[0].id)
    assert job is not None and job.message.kwargs == {"payload": 2}
    with pytest.raises(ArgumentsError, match="countdown"):
        task.apply_async(("43",), countdown=5)
    with pytest.raises(ArgumentsError, match="at most max_wait"):
        task.apply_async(("44",), lease_debounce=(1.0, 0.5))
    with pytest.raises(ConfigurationError, match=r"lease_debounce of tests\.bad"):
        app.task(base=LeasedTask, shared=False, name="tests.bad", lease_debounce=(5, 1))(bad)
