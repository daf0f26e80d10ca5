"""Where the features meet: each defect found where keys, debounce, groups, rates, retries,
operators and messages sent by name combine, as a regression test against real databases.

Each test fails without its fix in ``celery_leases.lifecycle`` (or the store): a grouped job no
one admits, a reaper that starves groups, retries that skip a rate, newest wins escaped by a
hand-back, a late trigger waiting for the reaper on a free key, debounce running an old payload,
and a database clock stepped back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask, control, lifecycle, reap
from celery_leases.config import settings_for
from celery_leases.db.rows import Claimed, Refused
from celery_leases.db.store import Store, store_for
from celery_leases.lease import Lease
from celery_leases.message import GROUP_HEADER, KEY_HEADER
from celery_leases.worker.keeper import all_keepers
from tests.databases.test_keys import published
from tests.support.memory import memory_app
from tests.support.message import job_message

OWNER = "worker-a/1"


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = memory_app("lifecycle_tests", database_url, table_name, task_ignore_result=True)

    @app.task(base=LeasedTask, shared=False, name="tests.tenant", lease_group="{0}",
              lease_group_limit=1)  # fmt: skip
    def tenant(group: str, n: int) -> int:
        return n

    @app.task(base=LeasedTask, shared=False, name="tests.rated", lease_group="{0}",
              lease_group_rate="1/s")  # fmt: skip
    def rated(group: str, n: int) -> int:
        return n

    @app.task(base=LeasedTask, shared=False, name="tests.keyed", lease_key="acct:{1}",
              lease_group="{0}", lease_group_limit=1)  # fmt: skip
    def keyed(group: str, account: str, n: int = 0) -> int:
        return n

    @app.task(base=LeasedTask, shared=False, name="tests.newest", lease_key="acct:{0}",
              lease_key_strategy="newest")  # fmt: skip
    def newest(account: str, n: int = 0) -> int:
        return n

    @app.task(base=LeasedTask, shared=False, name="tests.coalesced", lease_key="acct:{0}")
    def coalesced(account: str, n: int = 0) -> int:
        return n

    @app.task(base=LeasedTask, shared=False, name="tests.debounced", lease_key="acct:{0}",
              lease_debounce=(2.0, 10.0))  # fmt: skip
    def debounced(account: str, n: int = 0) -> int:
        return n

    yield app
    store = store_for(settings_for(app))
    for keeper in all_keepers():
        if keeper.store is store:
            keeper.stop()
            keeper.join(timeout=5)
    store.engine.dispose()
    app.close()


def store_of(app: Celery) -> Store:
    return store_for(settings_for(app))


def claimed(store: Store, job_id: str) -> Claimed:
    job = store.get(job_id)
    assert job is not None
    outcome = store.claim(job.message, owner=OWNER, duration=30.0)
    assert isinstance(outcome, Claimed), outcome
    return outcome


def lease_of(app: Celery, job_id: str, outcome: Claimed) -> Lease:
    job = store_of(app).get(job_id)
    assert job is not None
    return Lease(
        job_id, outcome.token, outcome.attempt, None, OWNER, 30.0, 10.0,
        key=job.lease_key, group=job.lease_group,
    )  # fmt: skip


def moved(store: Store, table: sa.Table, where: Any, **values: Any) -> None:
    """Write ``values`` (SQL expressions on ``table``) on the rows ``where`` selects."""
    with store.engine.begin() as connection:
        connection.execute(sa.update(table).where(where).values(**values))


def has_group_row(store: Store, group: str) -> bool:
    g = store.groups_table
    with store.engine.connect() as connection:
        return connection.execute(sa.select(g.c.name).where(g.c.name == group)).first() is not None


def run_after(store: Store, job_id: str) -> float:
    """When the job may run (its token's time, for a job of a rated group)."""
    t = store.table
    with store.engine.connect() as connection:
        found = connection.execute(sa.select(t.c.run_after).where(t.c.id == job_id)).scalar()
    assert found is not None
    return float(found)


class ClientDied(BaseException):
    """A client process dying between two of its writes (its next write never happens)."""


# -- a grouped job that no one admits -------------------------------------------------------


def test_a_client_that_dies_between_recording_and_admitting_leaves_a_job_the_reaper_admits(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_of(app)

    # Given a client that dies after recording the first job of a new group, before admitting
    def dies(*_: Any, **__: Any) -> Any:
        raise ClientDied()

    monkeypatch.setattr(Store, "admit", dies)
    with pytest.raises(ClientDied):
        app.tasks["tests.tenant"].delay("t1", 0)
    monkeypatch.undo()
    assert published(app) == [] and has_group_row(store, "t1")

    # When the reaper passes
    report = reap(app)

    # Then it admits the job: the group's row was made before the job was recorded
    assert len(report.admitted) == 1 and published(app) == report.admitted
    assert store.groups(names=["t1"])[0].limit == 1


def test_the_follow_up_of_a_keyed_grouped_job_sent_by_name_is_admitted_at_its_end(
    app: Celery,
) -> None:
    store = store_of(app)
    headers = {KEY_HEADER: "acct:a", GROUP_HEADER: "t1"}
    # Given a keyed job of group t1 sent by name (no client recorded it, nor its group)
    by_name = job_message(
        "n1",
        "tests.keyed",
        args=["t1", "a"],
        recorded=False,
        routing_key=app.conf.task_default_queue,
        **headers,
    )
    outcome = store.claim(by_name, owner=OWNER, duration=30.0)
    assert isinstance(outcome, Claimed) and not has_group_row(store, "t1")
    # and a trigger of its key sent by name while it runs, kept on the key
    trigger = job_message(
        "n2",
        "tests.keyed",
        args=["t1", "a", 1],
        recorded=False,
        routing_key=app.conf.task_default_queue,
        **headers,
    )
    refused = store.claim(trigger, owner=OWNER, duration=30.0)
    assert isinstance(refused, Refused) and refused.reason == "coalesced"

    # When the job ends, and its end is handed on
    assert store.finish("n1", outcome.token, result=None)
    lifecycle.hand_on(app, store, lifecycle.Ended(key="acct:a", group="t1", task="tests.keyed"))

    # Then the follow-up is recorded in the group, the group's row made from the task's
    # options, and admitted at once
    assert published(app) == ["n2"]
    assert store.groups(names=["t1"])[0].limit == 1


def test_an_operators_retry_of_a_grouped_job_sent_by_name_is_admitted(app: Celery) -> None:
    store = store_of(app)
    # Given a job of group t1 sent by name, which failed
    by_name = job_message(
        "n1",
        "tests.tenant",
        args=["t1", 0],
        recorded=False,
        routing_key=app.conf.task_default_queue,
        **{GROUP_HEADER: "t1"},
    )
    outcome = store.claim(by_name, owner=OWNER, duration=30.0)
    assert isinstance(outcome, Claimed)
    assert store.fail("n1", outcome.token, error="boom")

    # When an operator retries it
    said = control.retry(app, store, "n1")

    # Then it is admitted and published (its group's row made from the task's options)
    assert "queued again" in said and "waits" not in said
    assert published(app) == ["n1"]


# -- the reaper's admission ---------------------------------------------------------------


def test_a_group_with_room_behind_full_groups_is_admitted_by_the_reapers_pass(
    app: Celery,
) -> None:
    app.conf.leases_reap_batch = 3
    store = store_of(app)
    tenant = app.tasks["tests.tenant"]
    # Given six full groups (limit 1: one job admitted, one waiting), longest served first
    for n in range(6):
        tenant.delay(f"full{n}", 0)
        tenant.delay(f"full{n}", 1)
    # and, served last, a group whose job ended where nothing admitted its next (its worker
    # died between the two), with one waiting
    done = tenant.delay("room", 0)
    assert store.finish(done.id, claimed(store, done.id).token, result=None)
    queue = app.conf.task_default_queue
    waiting = job_message("r1", "tests.tenant", args=["room", 1], routing_key=queue,
                          **{GROUP_HEADER: "room"})  # fmt: skip
    assert store.register(waiting).outcome == "new"
    published(app)

    # When the reaper passes (its batch is 3 groups)
    report = reap(app)

    # Then the group with room is admitted: the full ones are not read in its way
    assert report.admitted == ["r1"] and published(app) == ["r1"]


# -- a rate that retries skip ----------------------------------------------------------------


def test_a_retry_of_a_rated_job_takes_a_token_of_its_groups_rate(app: Celery) -> None:
    store = store_of(app)
    rated = app.tasks["tests.rated"]
    # Given a job of a group at 1/s, admitted (its token taken) and running
    first = rated.delay("api", 0)
    assert published(app) == [first.id]
    outcome = claimed(store, first.id)
    token = run_after(store, first.id)

    # When it retries at once (Celery's self.retry(countdown=0))
    lease = lease_of(app, first.id, outcome)
    job = store.get(first.id)
    assert job is not None
    recording = lifecycle.retry_now(rated, lease, job.message.new_version(), 0.0)

    # Then it waits for its group's admission, which takes the next token: it is published
    # again due a second after its first start, never at once
    assert recording.message is None
    assert published(app) == [first.id]
    again = store.get(first.id)
    assert again is not None and again.state == "queued" and again.admitted_at is not None
    assert run_after(store, first.id) - token >= 1.0 - 1e-6  # the next token, a second on
    refused = store.claim(again.message, owner=OWNER, duration=30.0)
    assert isinstance(refused, Refused) and refused.reason == "early"


def test_a_grouped_job_with_a_countdown_is_admitted_when_it_is_due_not_before(
    app: Celery,
) -> None:
    store = store_of(app)
    # Given a job of a group with room, sent with a countdown
    result = app.tasks["tests.rated"].apply_async(("api", 0), countdown=30)

    # Then it holds no place and no token before its due time: its message goes for then, to
    # ask for its admission
    job = store.get(result.id)
    assert job is not None and job.waiting
    assert published(app) == [result.id]
    assert store.admit("api") == []


# -- newest wins, and a hand-back between its writes ----------------------------------------


#: How often a test polls ``lock_waiters``, by dialect (see there).
LOCK_POLL = {"postgresql": 0.02, "mysql": 0.15}


def lock_waiters(store: Store) -> int:
    """How many statements on this test's table wait for a row lock (PostgreSQL, MariaDB).

    MariaDB's ``information_schema.innodb_trx`` is a cache that InnoDB refreshes only once it
    has gone unread for 100 ms (``CACHE_MIN_IDLE_TIME_US``): polled more often, it never shows
    a wait that began after the first poll. Poll it at ``LOCK_POLL[dialect]``."""
    name = store.table.name
    with store.engine.connect() as connection:
        if store.dialect.name == "postgresql":
            found = connection.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE :like"
                ),
                {"like": f"%{name}%"},
            )
        else:
            found = connection.execute(
                sa.text(
                    "SELECT count(*) FROM information_schema.innodb_trx "
                    "WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE :like"
                ),
                {"like": f"%{name}%"},
            )
        return int(found.scalar_one())


def test_a_newest_trigger_supersedes_a_job_handed_back_while_it_supersedes(
    app: Celery,
) -> None:
    store = store_of(app)
    if store.dialect.name == "sqlite":
        pytest.skip("SQLite runs one write transaction at a time: no write can come between")
    newest = app.tasks["tests.newest"]
    # Given the key's job running
    first = newest.delay("a", 1)
    outcome = claimed(store, first.id)
    t = store.table
    # When a newer trigger supersedes it while the job's own transaction holds its row and
    # hands it back (a retry, a preemption): running when the trigger looked, queued after
    done = threading.Event()
    later: list[Any] = []
    with store.engine.begin() as connection:
        connection.execute(sa.select(t.c.id).where(t.c.id == first.id).with_for_update())
        thread = threading.Thread(target=lambda: (later.append(newest.delay("a", 2)), done.set()))
        thread.start()
        deadline = time.monotonic() + 20
        while lock_waiters(store) == 0 and not done.is_set():
            assert time.monotonic() < deadline, "the trigger never waited for the job's row"
            time.sleep(LOCK_POLL[store.dialect.name])
        params = {"b_id": first.id, "b_token": outcome.token, "b_reap_in": 0.0}
        connection.execute(store.sql.end.hand_back, params)
    thread.join(timeout=30)

    # Then the job handed back is superseded all the same, and the newest trigger's run starts
    job = store.get(first.id)
    assert job is not None and job.state == "superseded"
    assert later and published(app)[-1] == later[0].id


# -- a late trigger on a free key ------------------------------------------------------------


def test_a_trigger_that_read_a_holder_which_then_ended_starts_its_run_at_once(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_of(app)
    first = app.tasks["tests.coalesced"].delay("a", 1)
    outcome = claimed(store, first.id)
    published(app)
    # Given a trigger that read the key's job while it ran (an old read)...
    monkeypatch.setattr(Store, "_holder", lambda self, message: first.id)
    # ...and that job ended and settled the key (nothing waited on it) before the trigger
    # wrote itself on the key
    assert store.finish(first.id, outcome.token, result=None)
    assert store.settle("acct:a").followup is None

    # When the trigger writes itself on the key
    later = app.tasks["tests.coalesced"].delay("a", 2)
    monkeypatch.undo()

    # Then its run starts at once, not at the reaper's next pass
    assert published(app) == [later.id]


# -- debounce ----------------------------------------------------------------------------


def test_triggers_during_a_debounced_run_form_a_follow_up_with_the_newest_arguments(
    app: Celery,
) -> None:
    store = store_of(app)
    debounced = app.tasks["tests.debounced"]
    first = debounced.delay("a", 1)
    k = store.keys
    t = store.table
    moved(store, t, t.c.id == first.id, run_after=t.c.run_after - 3)  # its quiet is over
    outcome = claimed(store, first.id)
    published(app)

    # Given three triggers while its run runs, the first of them 9 s ago
    calls = [debounced.delay("a", n) for n in (2, 3, 4)]
    assert len({c.id for c in calls}) == 1
    moved(store, k, k.c.lease_key == "acct:a", pending_since=k.c.pending_since - 9)

    # When the run ends
    assert store.finish(first.id, outcome.token, result=None)
    settled = store.settle("acct:a")

    # Then one follow-up runs the newest trigger's arguments, due at the first trigger's max
    # wait (10 s after it: in ~1 s), not at once, nor a full quiet after the last
    assert settled.followup is not None and settled.followup.args == ["a", 4]
    assert 0.5 < settled.due_in <= 1.0
    # and a trigger before it is due moves into it, bounded by the same first trigger
    assert debounced.delay("a", 5).id == calls[0].id
    job = store.get(calls[0].id)
    assert job is not None and job.message.args == ["a", 5]
    refused = store.claim(job.message, owner=OWNER, duration=30.0)
    assert isinstance(refused, Refused) and refused.reason == "early"
    assert (refused.expires_in or 0.0) <= 1.0


# -- a database clock stepped back -------------------------------------------------------------


def test_a_clock_stepped_back_does_not_stop_a_rated_groups_admissions(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_of(app)
    rated = app.tasks["tests.rated"]
    first = rated.delay("api", 0)
    second = rated.delay("api", 1)
    assert published(app) == [first.id, second.id]  # the second due a second later
    third = rated.delay("api", 2)
    assert published(app) == []  # its token is over a second away: it waits
    # Given the clock stepped back an hour behind the bucket's last count
    g = store.groups_table
    moved(store, g, g.c.name == "api", refilled_at=g.c.refilled_at + 3600, tokens=0.0)

    # When its admission runs (the reaper's)
    reap(app)

    # Then it admits by the bucket counted from now, and says the clock stepped back
    assert published(app) == [third.id]
    assert "stepped back" in caplog.text
    # and the bucket refills from then on: two seconds later (moved back, not slept) the
    # next call is admitted, not an hour later
    fourth = rated.delay("api", 3)
    assert published(app) == []
    moved(store, g, g.c.name == "api", refilled_at=g.c.refilled_at - 2)
    reap(app)
    assert published(app) == [fourth.id]


def test_a_message_due_later_than_its_rate_allows_runs_now_after_a_clock_step_back(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_of(app)
    first = app.tasks["tests.rated"].delay("api", 0)
    # Given its admission wrote its due time by a clock an hour ahead of the database's now
    t = store.table
    moved(store, t, t.c.id == first.id, run_after=t.c.run_after + 3600)

    # When its message comes
    job = store.get(first.id)
    assert job is not None
    outcome = store.claim(job.message, owner=OWNER, duration=30.0)

    # Then it runs (no admission makes a job of a 1/s group due more than a second ahead)
    assert isinstance(outcome, Claimed)
    assert "stepped back" in caplog.text
