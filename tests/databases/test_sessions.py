"""Leases bound to their holder's database session: a holder whose session ended (its process
died) loses its lease at the next reaper pass, not at its expiry; a live one keeps it.

Real databases; the holder is a real forked process that claims, renews and exits.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from celery_leases.db.rows import Claimed
from celery_leases.db.store import Store
from celery_leases.errors import LeaseError
from celery_leases.settings import DEFAULTS, Settings, validate
from tests.support.message import job_message
from tests.support.scenario import wait_for

LEASE = 300.0  # far longer than any test: only the session can end these leases early


@pytest.fixture
def settings(database_url: str, table_name: str) -> Settings:
    return validate(DEFAULTS | {"database_url": database_url, "table": table_name})


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    store = Store(settings)
    yield store
    store.engine.dispose()


def owner_here(pid: int) -> str:
    return f"worker@{socket.gethostname()}/{pid}"


def claim_here(store: Store, job_id: str, session: int | None = None) -> Claimed:
    """Claim a new job ``job_id`` as this process, bound to ``session`` (a ``Session.ident``)."""
    outcome = store.claim(
        job_message(job_id, "tests.job", recorded=False),
        owner=owner_here(os.getpid()),
        duration=LEASE,
        session=session,
    )
    assert isinstance(outcome, Claimed), outcome
    return outcome


def _hold_and_exit(settings: Settings, job_id: str, done: Connection) -> None:
    """A holder process: claim the job bound to its own session, renew it once on that
    session, report, and exit without releasing anything."""
    try:
        store = Store(settings)
        session = store.db.session()
        outcome = claim_here(store, job_id, session.ident())
        held = store.renew([(job_id, outcome.token)], session=session)
        done.send((session.ident(), job_id in held.held))
    except BaseException as exc:
        done.send((None, repr(exc)))
    os._exit(0)


def test_a_holder_whose_process_died_loses_its_lease_at_the_next_reaper_pass(
    store: Store, settings: Settings
) -> None:
    # Given a job claimed and renewed by another process, bound to that process's session,
    # and this process's own session (the reaper's worker has a keeper too), older than that
    witness = store.db.session()
    witness.ident()
    context = multiprocessing.get_context("fork")
    reports, done = context.Pipe(duplex=False)
    holder = context.Process(target=_hold_and_exit, args=(settings, "orphan-1", done))
    store.engine.dispose()  # the child must not share the parent's pooled connections
    holder.start()
    assert reports.poll(30), "the holder process reported nothing"
    session, renewed = reports.recv()
    assert renewed is True, renewed
    job = store.get("orphan-1")
    assert job is not None and job.state == "running" and job.session == session

    # When that process has exited (its lease still has minutes to run)
    holder.join(timeout=30)
    assert holder.exitcode == 0

    # Then a reaper pass ends its lease now, and the usual expiry path re-publishes it
    orphaned = wait_for(
        lambda: store.expire_orphaned(batch=10),
        timeout=10,
        interval=0.1,
        what="the holder's session to be seen gone",
    )
    assert orphaned == [("orphan-1", owner_here(holder.pid))]
    reaped = store.collect_expired(batch=10, grace=30.0, max_stalled=None, max_attempts=None)
    assert [j.id for j in reaped.republish] == ["orphan-1"]
    assert store.expire_orphaned(batch=10) == []  # queued now: nothing more to end
    witness.close()


def test_a_holder_whose_session_is_alive_keeps_its_lease(store: Store) -> None:
    # Given a job claimed by this process and renewed on its keeper session
    session = store.db.session()
    outcome = claim_here(store, "alive-1", session.ident())
    assert "alive-1" in store.renew([("alive-1", outcome.token)], session=session).held

    # When the reaper looks, then it leaves the job alone: the session is still there
    assert store.expire_orphaned(batch=10) == []
    job = store.get("alive-1")
    assert job is not None and job.session == session.ident() and job.expires_in > LEASE - 60
    session.close()


def test_a_hand_back_unbinds_the_job(store: Store) -> None:
    # Given a job bound to this process's session
    session = store.db.session()
    outcome = claim_here(store, "back-1", session.ident())
    job = store.get("back-1")
    assert job is not None and job.session == session.ident()

    # When its attempt hands it back, then the row names no session: whoever claims it next
    # binds its own (or, an older worker, none)
    store.hand_back("back-1", outcome.token, reap_in=0.0)
    job = store.get("back-1")
    assert job is not None and (job.state, job.session) == ("queued", None)
    session.close()


def test_an_error_that_is_not_a_disconnect_keeps_the_session(store: Store) -> None:
    session = store.db.session()
    before = session.ident()
    with pytest.raises(LeaseError):
        session.run(lambda c: c.query("SELECT no_such_column FROM no_such_table"))
    assert session.ident() == before
    if store.dialect.name != "sqlite":
        assert not _session_gone(store, before)  # the session, and its lock, are still there
    session.close()


def test_a_renewal_off_the_keeper_session_binds_nothing(store: Store) -> None:
    # Given a job claimed with no keeper session, renewed through the pool
    outcome = claim_here(store, "unbound-1")
    store.renew([("unbound-1", outcome.token)])

    # Then it is bound to no session: only its expiry ends it
    job = store.get("unbound-1")
    assert job is not None and job.session is None
    assert store.expire_orphaned(batch=10) == []


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_claim_never_binds_a_session_that_is_gone(store: Store) -> None:
    # Given a keeper whose cached session id belongs to a session that has ended
    session = store.db.session()
    gone = session.ident()
    session.close()
    wait_for(
        lambda: _session_gone(store, gone),
        timeout=10,
        interval=0.1,
        what=f"session {gone} to end",
    )

    # When a claim is made with it, then the lease is bound to nothing (expiry only), so a
    # stale id never hands a live job to the reaper
    claim_here(store, "stale-1", gone)
    job = store.get("stale-1")
    assert job is not None and job.session is None
    assert store.expire_orphaned(batch=10) == []


def _session_gone(store: Store, ident: int) -> bool:
    other = store.db.session()
    try:
        if store.dialect.name == "postgresql":
            sql = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
            return other.run(lambda c: c.query(sql, (ident,))[0][0]) == 0
        sql = "SELECT IS_USED_LOCK(CONCAT('celery_leases:', %s))"
        return other.run(lambda c: c.query(sql, (ident,))[0][0]) is None
    finally:
        other.close()


# -- behind a connection pooler ------------------------------------------------------------------


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_a_direct_connection_to_postgresql_is_bound_to_its_session(store: Store) -> None:
    # Given a store connected straight to PostgreSQL
    session = store.db.session()
    try:
        # When its keeper session opens
        ident = session.ident()

        # Then no pooler is seen, and the session's id is its backend pid
        assert store.db.pooler is None
        with store.engine.connect() as connection:
            pids = connection.exec_driver_sql("SELECT pid FROM pg_stat_activity").scalars()
            assert ident in set(pids)
    finally:
        session.close()


@pytest.mark.parametrize("database_url", ["pgbouncer"], indirect=True)
def test_behind_pgbouncer_in_transaction_mode_nothing_is_bound_and_every_operation_works(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a store whose connections go through PgBouncer in transaction mode, where each
    # transaction may run on another server connection
    session = store.db.session()
    try:
        # When a keeper asks for its session
        ident = session.ident()

        # Then the pooler is seen: no session to bind leases to (they end at their expiry),
        # said once in the log, and the driver prepares no statement (a prepared statement
        # lives on one server connection only)
        assert ident is None and session.ident() is None
        assert store.db.pooler is not None and "pooler" in store.db.pooler
        assert caplog.text.count("sits between this process and PostgreSQL") == 1
        with store.engine.connect() as connection:
            assert connection.connection.dbapi_connection.prepare_threshold is None

        # And a job's whole life works there, each statement run more often than psycopg's
        # threshold for preparing one (5): the record at dispatch, the claim, renewals,
        # checkpoints (on their own and in a transaction of the caller's) and the finish
        for j in range(8):
            job_id = f"j{j}"
            message = job_message(job_id)  # one version: the one recorded is the one claimed
            assert store.register(message).outcome == "new"
            outcome = store.claim(
                message, owner=owner_here(os.getpid()), duration=LEASE, session=ident
            )
            assert isinstance(outcome, Claimed), outcome
            token = outcome.token
            assert store.renew([(job_id, token)], session=None).held == frozenset({job_id})
            assert store.checkpoint(job_id, token, f'{{"n": {j}}}') == (True, None)
            with store.engine.begin() as connection:
                saved = store.checkpoint(job_id, token, '{"n": -1}', connection=connection)
                assert saved == (True, None)
            assert store.finish(job_id, token, result=str(j))
            job = store.get(job_id)
            assert job is not None, job_id
            assert (job.state, job.session, job.checkpoint, job.result) == (
                "done",
                None,
                {"n": -1},
                j,
            )
    finally:
        session.close()
