"""The edges of real deployments, against real databases, in this process: a statement
interrupted by a soft time limit, a caller's transaction under snapshot isolation, a message
over MariaDB's packet limit, a client killed between recording a keyed job and publishing it,
a serializer that is not JSON, ``leases_max_attempts`` at the claim, a retry after checkpoints,
and a trigger behind a job's countdown."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery
from celery.signals import task_prerun

from celery_leases import ArgumentsError, LeasedTask, WriteConflict
from celery_leases.config import settings_for
from celery_leases.db.rows import Claimed, Refused
from celery_leases.db.statements import GAVE_UP_MAX_ATTEMPTS
from celery_leases.db.store import Store, store_for
from celery_leases.lease import Lease
from celery_leases.message import DB_RETRY_HEADER, KEY_HEADER
from celery_leases.publish import Recorder
from celery_leases.reaper import reap
from celery_leases.settings import DEFAULTS, validate
from celery_leases.worker.keeper import all_keepers
from tests.support.memory import memory_app
from tests.support.message import job_message

OWNER = "worker@edges/test/1"


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


def held(store: Store, job_id: str, *, session: Any = None, holder: str | None = None) -> int:
    """The token of a new job ``job_id`` this process claims, kept by a holder of its own."""
    holder = holder or uuid.uuid4().hex
    store.renew_holder(holder, owner=OWNER, shortest=30.0, session=session)
    message = job_message(job_id)
    store.register(message)
    outcome = store.claim(message, owner=OWNER, duration=30.0, holder=holder)
    assert isinstance(outcome, Claimed) and outcome.bound, outcome
    return outcome.token


# -- 1. a statement interrupted mid-way (a soft time limit) ------------------------------------


def _soft_time_limit_in(seconds: float) -> None:
    def raise_it(signum: int, frame: Any) -> None:
        raise SoftTimeLimitExceeded()

    signal.signal(signal.SIGALRM, raise_it)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _blocking(store: Store, job_id: str) -> tuple[sa.Connection, Any]:
    """A transaction of another connection that holds the job's row locked."""
    connection = store.engine.connect()
    transaction = connection.begin()
    t = store.table
    connection.execute(sa.select(t.c.id).where(t.c.id == job_id).with_for_update())
    return connection, transaction


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
@pytest.mark.parametrize("shared", [False, True], ids=["own connection", "keeper's session"])
def test_a_statement_a_soft_time_limit_interrupts_leaves_no_connection_in_use(
    store: Store, shared: bool
) -> None:
    # Given a job held by this process, its checkpoint blocked behind a lock another
    # transaction holds (so the time limit lands inside the statement), on the process's own
    # connection or on its keeper's session (a prefork pool process shares that one)
    session = store.db.session(shared=shared)
    token = held(store, "j1", session=session if shared else None)
    ident = session.ident()
    connection, transaction = _blocking(store, "j1")
    try:
        # When the soft time limit lands inside the checkpoint's statement
        _soft_time_limit_in(0.5)
        with pytest.raises(SoftTimeLimitExceeded):
            store.checkpoint("j1", token, '"interrupted"')
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        transaction.rollback()
        connection.close()

    # Then the connection it left mid-statement is never used again: the task's last
    # checkpoint, the next jobs and the keeper's renewals all work at once (on PostgreSQL the
    # connection would say "another command is already in progress" forever)
    assert store.checkpoint("j1", token, '"last"') == (True, None)
    assert store.get("j1").checkpoint == "last"  # type: ignore[union-attr]
    assert held(store, "j2") > 0
    holder = uuid.uuid4().hex
    store.renew_holder(holder, owner=OWNER, shortest=30.0, session=session)
    if shared:
        assert session.ident() != ident  # a new session, to which its leases bind again
    session.close()


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_soft_time_limit_inside_a_checkpoint_in_the_callers_transaction_invalidates_it(
    store: Store,
) -> None:
    # Given a job held by this process and a unit's transaction of the caller's, on an
    # SQLAlchemy connection of the caller's own engine, whose checkpoint meets a row lock
    token = held(store, "j1")
    engine = sa.create_engine(store.db.engine.url)
    blocker, blocking = _blocking(store, "j1")
    try:
        with engine.connect() as connection:
            connection.begin()
            # When the soft time limit lands inside the checkpoint's statement
            _soft_time_limit_in(0.5)
            try:
                with pytest.raises(SoftTimeLimitExceeded):
                    store.checkpoint("j1", token, '"interrupted"', connection=connection)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            # Then the caller's connection is invalidated: SQLAlchemy never hands it out
            # again, and the transaction is gone with it
            assert connection.invalidated
    finally:
        blocking.rollback()
        blocker.close()
    with engine.begin() as connection:  # the engine's next connection is a fresh one
        assert store.checkpoint("j1", token, '"next"', connection=connection) == (True, None)
    assert store.get("j1").checkpoint == "next"  # type: ignore[union-attr]
    engine.dispose()


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_keeper_whose_session_an_interrupted_statement_ended_binds_a_new_one_at_once(
    store: Store,
) -> None:
    from celery_leases.worker.keeper import Keeper

    # Given a keeper whose session the process's statements share (a prefork pool process),
    # renewing every 30 s, and a job it holds
    keeper = Keeper(store)
    keeper.session = store.db.session(shared=True)
    keeper.session.on_lost = keeper._lost_session
    keeper.start()
    try:
        holder = keeper.holder_for(OWNER, 30.0)
        assert holder is not None
        message = job_message("j1")
        store.register(message)
        claimed = store.claim(message, owner=OWNER, duration=30.0, holder=holder)
        assert isinstance(claimed, Claimed) and claimed.bound
        keeper.add(Lease("j1", claimed.token, 1, None, OWNER, 30.0, 10.0))
        connection, transaction = _blocking(store, "j1")
        try:
            # When a soft time limit lands inside a checkpoint's statement on that session
            _soft_time_limit_in(0.5)
            with pytest.raises(SoftTimeLimitExceeded):
                store.checkpoint("j1", claimed.token, '"interrupted"')
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            transaction.rollback()
            connection.close()

        # Then the keeper binds its holder to a new session at once, not at its next tick:
        # a reaper pass then finds no holder gone, and the job stays with its attempt
        h = store.holders
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and keeper._session_lost:
            time.sleep(0.01)
        with store.engine.connect() as c:
            session = c.execute(sa.select(h.c.session).where(h.c.id == holder)).scalar()
        assert session is not None and session == keeper.session.ident()
        assert store.expire_orphaned(batch=10) == []
        assert store.get("j1").holder == holder  # type: ignore[union-attr]
    finally:
        keeper.stop()
        keeper.join(timeout=5)
        keeper.session.close()


# -- 7. a caller's transaction under snapshot isolation ------------------------------------------


def _snapshot(connection: sa.Connection, level: str) -> None:
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SET TRANSACTION ISOLATION LEVEL {level}")
    else:  # MariaDB 11.6.2 and newer: the default; here, asked for
        connection.exec_driver_sql("SET SESSION innodb_snapshot_isolation = ON")


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_transactional_checkpoint_under_snapshot_isolation_never_meets_a_renewal(
    store: Store, level: str
) -> None:
    if store.dialect.name != "postgresql" and level == "SERIALIZABLE":
        pytest.skip("MariaDB's snapshot isolation is one setting")
    # Given a job kept by this process's holder, and a transaction of the task's at snapshot
    # isolation that has read (its snapshot is taken)
    session = store.db.session()
    holder = uuid.uuid4().hex
    token = held(store, "j1", session=session, holder=holder)
    with store.engine.connect() as connection:
        if connection.dialect.name != "postgresql":
            _snapshot(connection, level)
            connection.commit()
        transaction = connection.begin()
        if connection.dialect.name == "postgresql":
            _snapshot(connection, level)
        t = store.table
        connection.execute(sa.select(t.c.state).where(t.c.id == "j1")).scalar()

        # When the keeper renews the lease meanwhile, then the task checkpoints in it
        store.renew_holder(holder, owner=OWNER, shortest=30.0, session=session)
        saved, _ = store.checkpoint("j1", token, '{"page": 2}', connection=connection)
        transaction.commit()

    # Then the checkpoint is saved: a renewal writes the holder's row, never the job's
    assert saved
    assert store.get("j1").checkpoint == {"page": 2}  # type: ignore[union-attr]
    session.close()


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_transaction_that_loses_to_a_concurrent_write_is_a_conflict_not_an_outage(
    store: Store,
) -> None:
    # Given a transaction of the task's at snapshot isolation that has read the job
    token = held(store, "j1")
    with store.engine.connect() as connection:
        if connection.dialect.name != "postgresql":
            _snapshot(connection, "REPEATABLE READ")
            connection.commit()
        transaction = connection.begin()
        if connection.dialect.name == "postgresql":
            _snapshot(connection, "REPEATABLE READ")
        t = store.table
        connection.execute(sa.select(t.c.state).where(t.c.id == "j1")).scalar()

        # When an operator cancels the job meanwhile (a write of the row it read)
        assert store.request_stop(["j1"], "cancel") == 1

        # Then the checkpoint in that transaction fails as a conflict, to run again, and says so
        with pytest.raises(WriteConflict, match="concurrent transaction"):
            store.checkpoint("j1", token, '{"page": 2}', connection=connection)
        transaction.rollback()


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_a_claim_that_meets_a_lock_timeout_is_delivered_again_not_failed(
    database_url: str, table_name: str
) -> None:
    from celery.contrib.testing.worker import start_worker

    # Given a database whose sessions give up on a row lock after 0.3 s (lock_timeout)
    url = f"{database_url}?options=-c%20lock_timeout%3D300"
    app = memory_app("edges_claim_conflict", url, table_name, leases_db_retry_max_delay=0.5)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.locked")
    def locked(self: LeasedTask) -> int:
        return self.lease.attempt

    deliveries: list[Any] = []

    def delivered(sender: Any = None, task_id: str = "", task: Any = None, **_: Any) -> None:
        if getattr(task, "name", None) == "tests.locked":
            deliveries.append(task.request.get(DB_RETRY_HEADER))

    store = store_for(settings_for(app))
    result = locked.delay()
    task_prerun.connect(delivered, weak=False)
    try:
        with logging_restored(), store.engine.connect() as blocker:
            # And the job's row locked by another transaction when the worker claims it
            t = store.table
            blocker.execute(sa.select(t.c.id).where(t.c.id == result.id).with_for_update())
            with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and len(deliveries) < 3:
                    time.sleep(0.05)
                # Then the claim's conflict sends the message again later, again and again
                # (the job is not failed, and not lost)...
                job = store.get(result.id)
                assert job is not None and job.state == "queued", job
                assert deliveries[:3] == [None, 1, 2]
                # ...and once the lock is gone, it runs
                blocker.rollback()
                assert result.get(timeout=30) == 1
    finally:
        task_prerun.disconnect(delivered)
        store.engine.dispose()
        app.close()


# -- 9. a message over MariaDB's max_allowed_packet ---------------------------------------------


@pytest.mark.parametrize("database_url", ["mariadb"], indirect=True)
def test_a_message_over_the_packet_limit_is_refused_at_once_with_the_databases_reason(
    store: Store,
) -> None:
    limit = int(store.engine.connect().exec_driver_sql("SELECT @@max_allowed_packet").scalar())
    huge = ["x" * (limit + 1024)]

    # A client's publish is refused before anything is recorded
    with pytest.raises(ArgumentsError, match="max_allowed_packet"):
        store.register(job_message("big", args=huge))
    assert store.get("big") is None

    # And a message sent by name from elsewhere fails its claim at once, not as an outage
    # (it would be delivered again forever)
    by_name = job_message("big-by-name", args=huge, recorded=False)
    with pytest.raises(ArgumentsError, match="max_allowed_packet"):
        store.claim(by_name, owner=OWNER, duration=30.0)

    # The connection is fine: the next operation works
    assert held(store, "small") > 0


# -- 6. a client killed between recording a keyed job and publishing it -------------------------


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = memory_app("edges", database_url, table_name, leases_reap_grace=5.0)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.sync", lease_key="{0}")
    def sync(self: LeasedTask, account: str) -> str:
        self.checkpoint({"done": True})
        return account

    yield app
    store = store_for(settings_for(app))
    for keeper in all_keepers():
        if keeper.store is store:
            keeper.stop()
            keeper.join(timeout=5)
    store.engine.dispose()
    app.close()


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_a_keyed_job_whose_client_died_before_publishing_is_sent_by_the_reaper(
    app: Celery, table_name: str
) -> None:
    # Given a keyed job recorded by a client killed before it published the message (with the
    # default settings: leases_queued_timeout off)
    sync = app.tasks["tests.sync"]
    store = store_for(settings_for(app))
    orphan = job_message("orphaned", "tests.sync", args=["42"], routing_key=table_name)
    recorded = Recorder(sync).record(orphan)
    assert recorded.key == "42"
    # and triggers of its key that came since, which it holds
    later = sync.delay("42")
    assert later.id != "orphaned" and store.get(later.id) is None

    # When its wait for a worker (leases_reap_grace: 5 s) has passed, a reaper pass sends it
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(t).where(t.c.id == "orphaned").values(expires_at=t.c.expires_at - 5)
        )
    report = reap(app)

    # Then it is published, and the key is not held for good: its run serves the trigger
    # that waited (it started after it)
    assert report.republished == ["orphaned"]
    assert sync.apply(("42",), task_id="orphaned").get() == "42"
    served = store.get(later.id)
    assert served is not None and (served.state, served.served_by) == ("done", "orphaned")


# -- 10. serializers, leases_max_attempts, NaN ----------------------------------------------------


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_leased_task_sent_with_a_serializer_that_is_not_json_is_refused_clearly(
    app: Celery,
) -> None:
    app.conf.update(accept_content=["json", "pickle"])
    store = store_for(settings_for(app))

    with pytest.raises(ArgumentsError, match=r"'pickle' serializer.*JSON"):
        app.tasks["tests.sync"].apply_async(("42",), task_id="pickled", serializer="pickle")

    assert store.get("pickled") is None


def test_no_attempt_past_leases_max_attempts_is_claimed_whatever_sent_it(
    database_url: str, table_name: str
) -> None:
    store = Store(
        validate(DEFAULTS | {"database_url": database_url, "table": table_name, "max_attempts": 2})
    )
    try:
        # Given a job that ran twice, handed back each time (Celery retries)
        message = job_message("j1")
        store.register(message)
        for _ in range(2):
            outcome = store.claim(message, owner=OWNER, duration=30.0)
            assert isinstance(outcome, Claimed)
            store.hand_back("j1", outcome.token, reap_in=0.0)

        # When its next delivery comes, then it is refused, and the job fails for good
        refused = store.claim(message, owner=OWNER, duration=30.0)
        assert isinstance(refused, Refused) and refused.reason == "failed"
        job = store.get("j1")
        assert job is not None
        assert (job.state, job.attempts, job.error, job.notify) == (
            "failed",
            2,
            GAVE_UP_MAX_ATTEMPTS,
            "FAILURE",
        )
    finally:
        store.engine.dispose()


# -- 12. a retry after checkpoints; a trigger behind a countdown ---------------------------------


@contextlib.contextmanager
def logging_restored() -> Iterator[None]:
    """Celery's in-process worker sets up Celery's logging (the root and ``celery.task``, the
    parent of celery-leases' loggers, at ERROR): give the next tests theirs back."""
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    saved = [(logger, logger.level, list(logger.handlers), logger.propagate) for logger in loggers]
    try:
        yield
    finally:
        for logger, level, handlers, propagate in saved:
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate = propagate


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("start_over", [False, True], ids=["resumes", "starts over"])
def test_a_retry_after_checkpoints_resumes_from_the_checkpoint_unless_it_is_cleared(
    database_url: str, table_name: str, start_over: bool
) -> None:
    from celery.contrib.testing.worker import start_worker

    app = memory_app("edges_retry", database_url, table_name)
    seen: list[Any] = []

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.pages", max_retries=1)
    def pages(self: LeasedTask) -> Any:
        seen.append(self.lease.checkpoint)
        if self.request.retries == 0:
            self.checkpoint({"page": 2})
            if start_over:
                self.checkpoint(None)  # the retry starts from the beginning
            raise self.retry(countdown=0)
        return self.lease.checkpoint

    try:
        with (
            logging_restored(),
            start_worker(app, pool="threads", concurrency=1, perform_ping_check=False),
        ):
            result = pages.delay()
            assert result.get(timeout=30) == (None if start_over else {"page": 2})
        assert seen == [None, None if start_over else {"page": 2}]
    finally:
        store_for(settings_for(app)).engine.dispose()
        app.close()


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
@pytest.mark.parametrize("asks", ["retry", "replace"])
def test_a_retry_or_replace_asked_inside_the_tasks_transaction_waits_for_it_to_end(
    database_url: str, table_name: str, asks: str
) -> None:
    from celery.contrib.testing.worker import start_worker

    app = memory_app("edges_inside", database_url, table_name)
    engine = sa.create_engine(database_url)
    seen: list[Any] = []

    @app.task(bind=True, shared=False, name="tests.replacement")
    def replacement(self: Any) -> str:
        return "replaced"

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.inside", max_retries=1)
    def inside(self: LeasedTask) -> Any:
        seen.append(self.lease.checkpoint)
        if self.request.retries == 0:
            self.checkpoint({"page": 1})
            # The page and its checkpoint in the task's transaction, which holds the job's row
            # (SQLite: the whole file) until it ends; and the retry (or replace) asked inside it
            with engine.begin() as connection:
                self.checkpoint({"page": 2}, connection=connection)
                if asks == "retry":
                    raise self.retry(countdown=0)
                raise self.replace(replacement.si())
        return self.lease.checkpoint

    try:
        with (
            logging_restored(),
            start_worker(app, pool="threads", concurrency=1, perform_ping_check=False),
        ):
            result = inside.delay()
            # Then the transaction is not kept waiting on the job's row (a wait that only the
            # lease's end, 30 s, or SQLite's busy timeout would end): the retry resumes from
            # the last committed checkpoint (the block rolled back with its checkpoint), the
            # replacement runs
            outcome = result.get(timeout=20)
        if asks == "retry":
            assert outcome == {"page": 1}
            assert seen == [None, {"page": 1}]
        else:
            assert outcome == "replaced"
            job = store_for(settings_for(app)).get(result.id)
            assert job is not None and job.state == "replaced"
    finally:
        engine.dispose()
        store_for(settings_for(app)).engine.dispose()
        app.close()


def test_a_trigger_behind_a_job_with_a_long_countdown_waits_for_that_countdown(
    store: Store,
) -> None:
    # Given a keyed job queued with a countdown of an hour, and a trigger of its key
    key = {KEY_HEADER: "acct:1"}
    first = job_message("t1", "tests.sync", eta="2999-01-01T00:00:00+00:00", **key)
    store.register(first, countdown=3600)
    assert store.register(job_message("t2", "tests.sync", **key)).job_id == "t2"

    # Then nothing runs for it before that job starts: it serves the trigger when it does
    assert store.settle("acct:1").followup is None
    assert store.get("t2") is None
    outcome = store.claim(first, owner=OWNER, duration=30.0)
    assert isinstance(outcome, Claimed)
    time.sleep(0.01)
    store.finish("t1", outcome.token, result='"ok"')
    assert store.settle("acct:1").served
    assert store.get("t2").served_by == "t1"  # type: ignore[union-attr]


def test_a_retry_that_stored_retry_over_a_revoke_leaves_the_job_revoked_for_the_client(
    database_url: str, table_name: str
) -> None:
    from types import SimpleNamespace

    from celery.exceptions import TaskRevokedError

    from celery_leases.worker.signals import keep_revoked_after_retry, record_revoke

    app = memory_app("edges_retry_over_revoke", database_url, table_name)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.retried")
    def retried(self: LeasedTask) -> None:
        raise self.retry(countdown=0.1)

    backend, store = app.backend, store_for(settings_for(app))
    first, second, live = (retried.delay() for _ in range(3))

    # Given a retry's message a worker discarded as expired the moment it was sent: Celery
    # stored REVOKED, then the retrying trace stored RETRY, then the worker's main process
    # recorded the revoke (task_revoked)
    backend.mark_as_revoked(first.id, "expired")
    backend.mark_as_retry(first.id, RuntimeError("the database is restarting"))
    record_revoke(sender=retried, request=SimpleNamespace(id=first.id, hostname="w"), expired=True)
    # ... and the same, the retrying trace's RETRY stored after the revoke was recorded
    record_revoke(sender=retried, request=SimpleNamespace(id=second.id, hostname="w"), expired=True)
    backend.mark_as_retry(second.id, RuntimeError("the database is restarting"))
    keep_revoked_after_retry(sender=retried, request=SimpleNamespace(id=second.id))
    # ... and a retry of a job that lives on
    backend.mark_as_retry(live.id, RuntimeError("the database is restarting"))
    keep_revoked_after_retry(sender=retried, request=SimpleNamespace(id=live.id))

    # Then the revoked ones are REVOKED for their clients (whose get() would wait forever on
    # RETRY), and the live one's retry is left as it is
    states = [backend.get_state(r.id) for r in (first, second, live)]
    assert states == ["REVOKED", "REVOKED", "RETRY"]
    assert [store.get(r.id).state for r in (first, second, live)] == [  # type: ignore[union-attr]
        "revoked",
        "revoked",
        "queued",
    ]
    with pytest.raises(TaskRevokedError, match="expired in Celery"):
        first.get(timeout=1)
