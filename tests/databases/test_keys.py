"""Lease keys against real databases: one live job per key, coalesced triggers, follow-ups, and
the fenced cursor of each key."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.errors import ended_idle_transaction
from celery_leases.db.rows import Claimed, Refused
from celery_leases.db.store import Store, store_for
from celery_leases.errors import ArgumentsError, InvalidJobState, LeaseError
from celery_leases.message import KEY_HEADER, Message
from celery_leases.settings import DEFAULTS, validate
from celery_leases.worker.keeper import all_keepers, keeper_for
from tests.support.driver import executed, sent
from tests.support.message import job_message

OWNER = "worker-a/1"
KEY = "account:42"


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


def trigger(job_id: str, key: str = KEY, **options: Any) -> Message:
    return job_message(job_id, "tests.sync", args=[key], **{KEY_HEADER: key}, **options)


def claimed(store: Store, message: Message, owner: str = OWNER) -> Claimed:
    outcome = store.claim(message, owner=owner, duration=30.0)
    assert isinstance(outcome, Claimed), outcome
    return outcome


def live_jobs(store: Store, key: str = KEY) -> list[str]:
    return [j.id for j in store.list_jobs(states=("queued", "running")) if j.lease_key == key]


def in_seconds(seconds: float) -> str:
    """A message's ``expires`` or ``eta`` header ``seconds`` from now."""
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).isoformat()


def pending(store: Store, key: str = KEY) -> str | None:
    """The id the triggers waiting on ``key`` were given (None: none waits)."""
    k = store.keys
    with store.engine.connect() as connection:
        found = connection.execute(sa.select(k.c.pending_id).where(k.c.lease_key == key)).scalar()
    return str(found) if found is not None else None


def test_a_trigger_while_the_keys_job_waits_unstarted_is_served_by_its_start(
    store: Store,
) -> None:
    first = trigger("t1")
    assert store.register(first).outcome == "new"

    second = store.register(trigger("t2"))

    # The trigger waits on the key (not on the job, which may never run), under its own id
    assert (second.outcome, second.job_id) == ("coalesced", "t2")
    assert live_jobs(store) == ["t1"]
    assert store.get("t2") is None and pending(store) == "t2"
    # When the job starts after it and ends, its run served the trigger: the trigger's
    # caller is told that run's end
    lease = claimed(store, first)
    assert store.finish("t1", lease.token, result='{"pages":3}')
    settled = store.settle(KEY)
    assert settled.served and settled.followup is None
    served = store.get("t2")
    assert served is not None
    assert (served.state, served.served_by, served.result, served.notify) == (
        "done",
        "t1",
        {"pages": 3},
        "SUCCESS",
    )
    assert live_jobs(store) == [] and pending(store) is None


def test_triggers_during_a_run_wait_on_the_key_under_the_first_ones_id(store: Store) -> None:
    first = trigger("t1")
    store.register(first)
    claimed(store, first)

    served = [store.register(trigger(f"t{n}")) for n in range(2, 7)]

    assert {(r.outcome, r.job_id) for r in served} == {("coalesced", "t2")}
    assert pending(store) == "t2"
    assert live_jobs(store) == ["t1"]


def test_a_trigger_of_a_busy_key_inserts_no_job_the_keys_index_would_refuse(
    store: Store,
) -> None:
    # Given a key whose run has started, with a trigger already waiting
    first = trigger("t1")
    store.register(first)
    claimed(store, first)
    store.register(trigger("t2"))

    # When one more trigger comes
    with sent(store) as statements:
        outcome = store.register(trigger("t3"))

    # Then it waits with the first after a read of the key's job, one write of the key's row
    # (read back where there is no RETURNING) and a read of the key's job again (had it ended
    # in between, the trigger would settle the key itself): no INSERT into the jobs that the
    # key's unique index would refuse (an ERROR line in PostgreSQL's log for each trigger)
    assert (outcome.outcome, outcome.job_id) == ("coalesced", "t2")
    jobs = f"INSERT INTO {store.table.name} "
    assert not any(s.upper().startswith(jobs.upper()) for s in statements), statements
    assert len(statements) == (3 if store.dialect.returning else 4), statements


def test_a_second_message_of_the_keys_own_job_is_a_copy_not_a_trigger(store: Store) -> None:
    # Given the key's job, running
    first = trigger("t1")
    store.register(first)
    claimed(store, first)

    # When a message with its own id (and key) is recorded again
    again = store.register(trigger("t1"))

    # Then it is a copy of that job (dropped at its claim), not a trigger
    assert (again.outcome, again.job_id) == ("running", "t1")
    assert pending(store) is None


def test_a_trigger_of_another_key_or_none_is_a_job_of_its_own(store: Store) -> None:
    store.register(trigger("t1"))
    assert store.register(trigger("t2", key="account:43")).outcome == "new"
    assert store.register(job_message("t3", "tests.sync")).outcome == "new"
    assert store.register(job_message("t4", "tests.sync")).outcome == "new"


def test_a_trigger_in_the_same_tick_as_the_runs_start_is_not_served_by_that_run(
    store: Store,
) -> None:
    # Given a run of the key that started, and a trigger kept while it ran, both at the same
    # reading of the database clock (SQLite's ticks in milliseconds): the run may well have
    # started before the trigger
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    store.register(trigger("t2"))
    t, k = store.table, store.keys
    with store.engine.begin() as connection:
        started = sa.select(t.c.started_at).where(t.c.id == "t1").scalar_subquery()
        connection.execute(sa.update(k).where(k.c.lease_key == KEY).values(pending_at=started))

    # When the run ends done, then a run for the trigger starts: the trigger is never taken
    # as served by a run that may have started before it
    assert store.finish("t1", lease.token, result=None)
    followup = store.settle(KEY).followup
    assert followup is not None and followup.id == "t2"


def test_the_run_for_waiting_triggers_starts_when_the_run_ends_and_only_once(
    store: Store,
) -> None:
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    store.register(trigger("t2"))
    assert store.settle(KEY).followup is None  # still running: nothing starts

    assert store.finish("t1", lease.token, result=None)
    followup = store.settle(KEY).followup

    assert followup is not None and followup.id == "t2" and followup.key == KEY
    assert live_jobs(store) == ["t2"] and pending(store) is None
    assert store.settle(KEY).followup is None
    # The run is claimed like any recorded job: its message is the recorded one
    assert isinstance(store.claim(followup, owner=OWNER, duration=30.0), Claimed)


@pytest.mark.parametrize("end", ["fail", "cancel", "give_up"])
def test_a_run_that_ends_any_other_way_leaves_its_triggers_a_run_too(
    store: Store, end: str
) -> None:
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    store.register(trigger("t2"))
    assert store.pending_keys(batch=10) == []  # t1 runs: it settles them when it ends

    if end == "fail":
        assert store.fail("t1", lease.token, error="boom")
    elif end == "cancel":
        assert store.end_live("t1", state="revoked", error="revoked")
    else:
        store.release("t1")
        assert store.give_up("t1", error="gave up")

    assert store.pending_keys(batch=10) == [KEY]
    followup = store.settle(KEY).followup
    assert followup is not None and followup.id == "t2"
    assert store.pending_keys(batch=10) == []


@pytest.mark.parametrize("end", ["fail", "revoke"])
def test_a_run_that_started_after_a_trigger_serves_it_only_by_ending_done(
    store: Store, end: str
) -> None:
    # Given a trigger that came while the key's job waited, and that job then started
    first = trigger("t1")
    store.register(first)
    store.register(trigger("t2"))
    lease = claimed(store, first)

    # When it ends failed or revoked (the work the trigger asked for was not done)
    if end == "fail":
        assert store.fail("t1", lease.token, error="boom")
    else:
        assert store.end_live("t1", state="revoked", error="revoked")

    # Then the trigger is not served by it: it runs under its own id
    settled = store.settle(KEY)
    assert not settled.served
    assert settled.followup is not None and settled.followup.id == "t2"
    assert live_jobs(store) == ["t2"]


@pytest.mark.parametrize("end", ["revoked", "cancelled", "expired"])
def test_triggers_waiting_behind_a_job_that_never_runs_get_a_run_of_their_own(
    store: Store, end: str
) -> None:
    # Given a keyed job queued with an expiry, and a trigger that came while it waited
    store.register(trigger("t1", expires=in_seconds(60)))
    store.register(trigger("t2"))

    # When that job ends without ever running (revoked, cancelled or expired while queued)
    if end == "cancelled":
        assert store.cancel_queued("t1")
    else:
        assert store.end_live("t1", state="revoked", error=end)

    # Then the trigger runs under its own id, without the first job's expiry
    followup = store.settle(KEY).followup
    assert followup is not None and followup.id == "t2"
    assert "expires" not in followup.headers and "eta" not in followup.headers
    assert live_jobs(store) == ["t2"]


def test_a_run_for_waiting_triggers_inherits_neither_expiry_nor_countdown(
    store: Store,
) -> None:
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    store.register(trigger("t2", expires=in_seconds(1), eta=in_seconds(3600)))
    store.finish("t1", lease.token, result=None)

    followup = store.settle(KEY).followup

    assert followup is not None
    assert "expires" not in followup.headers and "eta" not in followup.headers
    job = store.get("t2")
    assert job is not None and job.state == "queued"
    assert isinstance(store.claim(followup, owner=OWNER, duration=30.0), Claimed)


def test_a_trigger_after_the_end_before_the_run_is_recorded_starts_one_that_serves_both(
    store: Store,
) -> None:
    # Given a run that ended with a trigger waiting, not yet settled (its ender is slow, or
    # died and the reaper has not passed yet)
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    store.register(trigger("t2"))
    store.finish("t1", lease.token, result=None)

    # When another trigger comes: no job holds the key, so it is a job of its own
    message = trigger("t3")
    third = store.register(message)
    assert (third.outcome, third.job_id) == ("new", "t3")
    # The waiting trigger waits for it (it holds the key), and is served by its start
    assert store.settle(KEY).followup is None
    done = claimed(store, message)
    store.finish("t3", done.token, result='"ok"')
    assert store.settle(KEY).served
    served = store.get("t2")
    assert served is not None and (served.served_by, served.result) == ("t3", "ok")
    assert live_jobs(store) == [] and store.pending_keys(batch=10) == []


def test_a_trigger_racing_the_settling_of_its_key_is_never_lost(store: Store) -> None:
    # Given ended runs of many keys, each with a trigger waiting
    keys = [f"account:{n}" for n in range(8)]
    for key in keys:
        first = trigger(f"{key}/1", key=key)
        store.register(first)
        lease = claimed(store, first)
        store.register(trigger(f"{key}/2", key=key))
        store.finish(f"{key}/1", lease.token, result=None)

    # When each key is settled while a trigger of it comes at the same moment
    barrier = threading.Barrier(2 * len(keys))

    def settle(key: str) -> None:
        barrier.wait()
        store.settle(key)

    def trigger_now(key: str) -> str:
        barrier.wait()
        return store.register(trigger(f"{key}/3", key=key)).job_id

    with ThreadPoolExecutor(2 * len(keys)) as pool:
        settled = [pool.submit(settle, key) for key in keys]
        served = [pool.submit(trigger_now, key) for key in keys]
    for future in settled + served:
        future.result()

    # Then each key has one live job, and once the runs of each key end, every trigger had
    # a run that started after it: none waits, each has a job of its own or was served
    for key in keys:
        assert len(live_jobs(store, key)) == 1
        for _ in range(3):
            for job_id in live_jobs(store, key):
                job = store.get(job_id)
                assert job is not None
                lease = claimed(store, job.message)
                store.finish(job_id, lease.token, result=None)
            store.settle(key)
        assert live_jobs(store, key) == [] and pending(store, key) is None
        for n in (2, 3):
            job = store.get(f"{key}/{n}")
            assert job is not None and job.state == "done", (key, n, job)


def test_concurrent_triggers_of_one_key_record_one_job(store: Store) -> None:
    ids = [f"t{n}" for n in range(12)]
    barrier = threading.Barrier(len(ids))

    def send(job_id: str) -> tuple[str, str]:
        barrier.wait()
        registered = store.register(trigger(job_id))
        return registered.outcome, registered.job_id

    with ThreadPoolExecutor(len(ids)) as pool:
        outcomes = list(pool.map(send, ids))

    new = [job for outcome, job in outcomes if outcome == "new"]
    assert len(new) == 1, outcomes
    waiting = {job for outcome, job in outcomes if outcome == "coalesced"}
    assert waiting == ({pending(store)} if len(new) < len(ids) else set()), outcomes
    assert live_jobs(store) == new


def test_a_delivery_sent_by_name_while_the_key_is_busy_waits_on_the_key(store: Store) -> None:
    first = trigger("t1")
    store.register(first)
    claimed(store, first)

    refused = store.claim(trigger("t9", recorded=False), owner="w2/2", duration=30.0)

    assert isinstance(refused, Refused) and refused.reason == "coalesced"
    assert refused.serving == "t9"
    assert pending(store) == "t9"
    assert store.get("t9") is None


def test_a_failed_keyed_job_is_not_retried_while_its_key_has_a_live_job(store: Store) -> None:
    first = trigger("t1")
    store.register(first)
    store.fail("t1", claimed(store, first).token, error="boom")
    store.register(trigger("t2"))

    with pytest.raises(InvalidJobState, match="another job of its lease key"):
        store.requeue("t1")


def test_a_purge_of_the_ended_job_keeps_the_triggers_waiting_on_its_key(store: Store) -> None:
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    store.register(trigger("t2"))
    store.finish("t1", lease.token, result=None)
    with store.engine.begin() as connection:
        connection.execute(sa.update(store.table).values(finished_at=time.time() - 3600))

    assert store.purge(older_than=60.0, batch=10) == 1
    followup = store.settle(KEY).followup
    assert followup is not None and followup.id == "t2"


def test_a_key_the_table_cannot_hold_whole_is_refused(store: Store) -> None:
    with pytest.raises(ArgumentsError, match="lease key"):
        store.register(trigger("t1", key="k" * 256))
    assert store.get("t1") is None


# -- the cursor of a key ---------------------------------------------------------------------


def test_the_holder_saves_the_keys_cursor_and_the_next_run_reads_it(store: Store) -> None:
    first = trigger("t1")
    store.register(first)
    lease = claimed(store, first)
    assert store.cursor(KEY) is None

    assert store.save_cursor(KEY, "t1", lease.token, '{"since":10}')
    assert store.save_cursor(KEY, "t1", lease.token, '{"since":20}')
    store.finish("t1", lease.token, result=None)
    with store.engine.begin() as connection:  # ended an hour ago, by the database's clock
        connection.execute(
            sa.update(store.table).values(finished_at=store.table.c.finished_at - 3600)
        )
    store.purge(older_than=60.0, batch=10)

    assert store.get("t1") is None
    assert store.cursor(KEY) == {"since": 20}  # it outlives the job


def plan_of(store: Store, sql: str, params: Any) -> str:
    """How the database runs ``sql`` (as the driver got it) for any values of its parameters:
    SQLite's query plan; PostgreSQL's generic plan (a prepared statement's, after its first
    runs); MariaDB's EXPLAIN (access type and key)."""
    dialect = store.db.dialect.name
    with store.engine.connect() as connection:
        raw = connection.connection.dbapi_connection
        cursor = raw.cursor()
        try:
            if dialect == "sqlite":
                cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
                return " ".join(str(r[-1]) for r in cursor.fetchall())
            if dialect == "postgresql":
                names = list(params)
                for number, name in enumerate(names, 1):
                    sql = sql.replace(f"%({name})s", f"${number}")
                cursor.execute(f"PREPARE holder AS {sql}")
                cursor.execute("SET plan_cache_mode = force_generic_plan")
                values = ", ".join(f"'{params[name]}'" for name in names)
                cursor.execute(f"EXPLAIN EXECUTE holder({values})")
                return " ".join(r[0] for r in cursor.fetchall())
            cursor.execute("EXPLAIN " + sql, params)
            return " ".join(f"type={r[3]} key={r[5]}" for r in cursor.fetchall())
        finally:
            cursor.close()


def test_the_holder_of_a_key_is_found_by_an_index_whatever_the_table_holds(store: Store) -> None:
    """Not a scan of the jobs: the query's condition must be the partial index's predicate,
    values included (SQLite, PostgreSQL's generic plans), or MariaDB's generated live_key."""
    for n in range(50):  # other jobs, so a scan would look as cheap as it is
        store.register(job_message(f"other-{n}", "tests.other"))
    store.register(trigger("t1"))
    with executed() as seen:
        assert store.register(trigger("t2")).outcome == "coalesced"
    _, compiled, params = seen[0]  # the read of the key's holder
    sql, values = compiled.parameters(params)
    assert "FROM" in sql and "SELECT" in sql, sql

    plan = plan_of(store, sql, values)

    assert {
        "sqlite": "USING INDEX ix_",
        "postgresql": "Index Scan using ix_",
        "mysql": "type=const key=ix_",
    }[store.db.dialect.name] in plan, plan
    assert "_live_key" in plan, plan


def test_a_keys_cursor_is_set_or_cleared_only_while_no_job_holds_the_key(store: Store) -> None:
    assert store.set_cursor(KEY, '{"since":5}')  # no job of the key yet
    assert store.cursor(KEY) == {"since": 5}
    first = trigger("t1")
    store.register(first)

    # Queued, running, or with triggers waiting on it: the key is held, nothing written
    assert not store.set_cursor(KEY, '{"since":0}')
    lease = claimed(store, first)
    assert store.save_cursor(KEY, "t1", lease.token, '{"since":10}')
    assert not store.set_cursor(KEY, None)
    store.register(trigger("t2"))
    store.finish("t1", lease.token, result=None)
    assert not store.set_cursor(KEY, None)  # t1 ended, a trigger waits for its run
    assert store.cursor(KEY) == {"since": 10}

    followup = store.settle(KEY).followup
    assert followup is not None
    store.finish("t2", claimed(store, followup).token, result=None)
    assert store.set_cursor(KEY, '{"since":3}')  # rewound
    assert store.cursor(KEY) == {"since": 3}
    assert store.set_cursor(KEY, None)
    assert store.cursor(KEY) is None
    assert store.set_cursor("account:other", None)  # a key never seen: nothing to clear


def test_a_stale_attempt_cannot_write_the_keys_cursor(store: Store) -> None:
    first = trigger("t1")
    store.register(first)
    stale = claimed(store, first)
    store.save_cursor(KEY, "t1", stale.token, '{"since":10}')
    store.release("t1")
    fresh = claimed(store, first, owner="worker-b/2")

    assert not store.save_cursor(KEY, "t1", stale.token, '{"since":99}')
    assert store.save_cursor(KEY, "t1", fresh.token, '{"since":11}')
    store.finish("t1", fresh.token, result=None)
    assert not store.save_cursor(KEY, "t1", fresh.token, '{"since":12}')  # ended
    assert store.cursor(KEY) == {"since": 11}


# SQLite runs one writer at a time: no claim can run beside the write.
@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_cursor_write_racing_a_new_claim_is_fenced_out(store: Store) -> None:
    first = trigger("t1")
    store.register(first)
    stale = claimed(store, first)
    store.release("t1")
    # Given a new claim of the job, not yet committed (it holds the row)
    t = store.table
    connection = store.engine.connect()
    transaction = connection.begin()
    connection.execute(sa.update(t).where(t.c.id == "t1").values(token=t.c.token + 1))

    # When the stale attempt writes the cursor meanwhile, and the claim then commits
    saved: list[bool] = []
    writer = threading.Thread(
        target=lambda: saved.append(store.save_cursor(KEY, "t1", stale.token, '{"since":9}'))
    )
    writer.start()
    writer.join(0.5)
    assert writer.is_alive(), "the write did not wait for the claim's lock on the job's row"
    transaction.commit()
    connection.close()
    writer.join(10)

    # Then the write saw the new token and wrote nothing
    assert saved == [False]
    assert store.cursor(KEY) is None


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_transaction_left_idle_after_saving_a_cursor_for_longer_than_the_lease_is_ended(
    database_url: str, table_name: str
) -> None:
    # Given a held job of a 1 s lease, and a transaction of the caller's that saved the key's
    # cursor (no checkpoint) and then sat idle for 2.5 s: a worker frozen before its commit,
    # holding the lock on the job's row that keeps the reaper and the key's triggers waiting
    settings = DEFAULTS | {"database_url": database_url, "table": table_name, "duration": 1.0}
    store = Store(validate(settings))
    try:
        first = trigger("t1")
        store.register(first)
        lease = claimed(store, first)
        connection = store.engine.connect()
        transaction = connection.begin()
        assert store.save_cursor(KEY, "t1", lease.token, '{"since":10}', connection=connection)
        time.sleep(2.5)

        # When it commits
        with pytest.raises(sa.exc.DBAPIError) as ended:
            transaction.commit()
        connection.close()

        # Then the database had ended it after the lease's length: nothing of it is saved, and
        # the row is free for the reaper
        assert ended_idle_transaction(ended.value)
        assert store.cursor(KEY) is None
        assert store.release("t1")
    finally:
        store.engine.dispose()


# -- LeasedTask with a lease_key, in this process ---------------------------------------------


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("keys_tests", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        leases_database_url=database_url,
        leases_table=table_name,
        task_ignore_result=True,
        task_default_queue=table_name,  # memory:// queues live as long as this process
    )

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="tests.sync", lease_key="acct:{account}"
    )
    def sync(self: LeasedTask, account: str, pages: int = 3) -> Any:
        since = (self.lease.cursor or {}).get("page", 0)
        for page in range(since, since + pages):
            self.save_cursor({"page": page + 1})
        return {"from": since, "to": self.lease.cursor["page"]}

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.by_callable",
        lease_key=lambda a, b: f"{a}-{b}",
    )
    def by_callable(self: LeasedTask, a: int, b: int) -> None:
        return None

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.typo", lease_key="{acount}")
    def typo(self: LeasedTask, account: str) -> None:
        return None

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.frozen_sync",
        lease_key="acct:{account}",
        lease_duration=1.0,
    )
    def frozen_sync(self: LeasedTask, account: str) -> None:
        # The cursor saved in a transaction of its own, which then sits idle past the lease
        with store_for(settings_for(app)).engine.begin() as connection:
            self.save_cursor({"page": 1}, connection=connection)
            time.sleep(2.5)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.unkeyed")
    def unkeyed(self: LeasedTask) -> Any:
        return self.lease.cursor

    yield app
    store = store_for(settings_for(app))
    for keeper in all_keepers():
        if keeper.store is store:
            keeper.stop()
            keeper.join(timeout=5)
    store.engine.dispose()
    app.close()


def published(app: Celery) -> list[str]:
    """Ids of the task messages waiting in the memory broker's default queue."""
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue(app.conf.task_default_queue, no_ack=True)
        try:
            found = []
            while True:
                try:
                    found.append(queue.get(block=False).headers["id"])
                except queue.Empty:
                    return found
        finally:
            queue.close()


def test_a_keyed_call_records_its_key_from_the_tasks_arguments(app: Celery) -> None:
    store = store_for(settings_for(app))
    first = app.tasks["tests.sync"].delay("42")
    second = app.tasks["tests.by_callable"].apply_async((1, 2))
    third = app.tasks["tests.sync"].apply_async(("42",), lease_key="acct:other")

    assert [store.get(r.id).lease_key for r in (first, second, third)] == [  # type: ignore[union-attr]
        "acct:42",
        "1-2",
        "acct:other",
    ]
    assert store.get(first.id).message.key == "acct:42"  # type: ignore[union-attr]


def test_a_call_of_a_busy_key_publishes_nothing_and_returns_the_id_its_run_answers_to(
    app: Celery,
) -> None:
    sync = app.tasks["tests.sync"]
    first = sync.delay("42")

    again = [sync.delay("42") for _ in range(3)]

    # They wait on the key under the first waiting one's id: the run that serves them
    # answers to it
    assert {r.id for r in again} == {again[0].id} and again[0].id != first.id
    assert published(app) == [first.id]


def test_a_keyed_call_carrying_a_workflow_is_refused_and_records_nothing(app: Celery) -> None:
    sync = app.tasks["tests.sync"]
    store = store_for(settings_for(app))
    with pytest.raises(ArgumentsError, match="callbacks"):
        sync.apply_async(("42",), task_id="linked", link=app.tasks["tests.unkeyed"].si())
    assert store.get("linked") is None
    assert published(app) == []


def test_a_lease_key_the_arguments_cannot_fill_is_a_clear_error(app: Celery) -> None:
    store = store_for(settings_for(app))
    with pytest.raises(ArgumentsError, match=r"cannot be computed.*acount"):
        app.tasks["tests.typo"].apply_async(("42",), task_id="typo")
    assert store.get("typo") is None


def test_each_run_of_a_key_starts_from_the_cursor_the_last_one_saved(app: Celery) -> None:
    sync = app.tasks["tests.sync"]
    assert sync.apply(("42",)).get() == {"from": 0, "to": 3}
    assert sync.apply(("42",), kwargs={"pages": 2}).get() == {"from": 3, "to": 5}
    assert sync.apply(("7",)).get() == {"from": 0, "to": 3}


def test_a_task_without_a_lease_key_has_no_cursor(app: Celery) -> None:
    result = app.tasks["tests.unkeyed"].apply()
    assert isinstance(result.result, LeaseError)
    assert "no lease key" in str(result.result)


def test_a_keeper_tick_while_an_ended_run_settles_its_key_reports_no_lost_lease(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a keyed run whose settling of its key (after its finish, before the attempt lets
    # go of the lease) meets a tick of this process's keeper
    sync = app.tasks["tests.sync"]
    store = store_for(settings_for(app))
    keeper = keeper_for(store)
    settle = store.settle
    held: list[list[tuple[str, bool]]] = []

    def tick_first(key: str, **options: Any) -> Any:
        held.append([(lease.job_id, lease.lost) for lease in keeper.held()])
        keeper.tick()
        return settle(key, **options)

    store.settle = tick_first  # type: ignore[method-assign]

    # When it ends
    with caplog.at_level(logging.WARNING, logger="celery_leases"):
        result = sync.apply(("42",))

    # Then the tick neither renewed the ended job's lease nor called it lost
    assert result.get() == {"from": 0, "to": 3}
    assert held == [[(result.id, False)]]
    assert "lease lost" not in caplog.text
    assert not any(lease.lost for lease in keeper.held())


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_cursor_transaction_the_database_ended_for_idling_leaves_the_job_to_resume(
    app: Celery,
) -> None:
    # When a run's transaction that saved the cursor sits idle past its 1 s lease, and the
    # database ends it
    result = app.tasks["tests.frozen_sync"].apply(("42",), task_id="frozen")

    # Then nothing of it is saved, and the job is not failed: its attempt ended as a crash
    # would, the job left running for its lease to expire and the reaper to resume it
    store = store_for(settings_for(app))
    job = store.get("frozen")
    assert job is not None and job.state == "running", (job, result.result)
    assert store.cursor("acct:42") is None
