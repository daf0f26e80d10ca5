"""Leases kept by their holder (a keeper's row, bound to its database session): a holder whose
session ended (its process died) loses its jobs at the next reaper pass, not at their leases'
end; a live one keeps them. On SQLite, where there are no sessions, a holder's lock file tells.

Real databases; the holder is a real forked process that claims, renews and exits.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
import sqlalchemy as sa

from celery_leases.db.rows import Claimed
from celery_leases.db.session import Session
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
    return f"worker@{socket.gethostname()}/test/{pid}"


def hold(store: Store, session: Session | None) -> str:
    """A holder of this process, as a keeper makes it: marked alive, then renewed (on
    ``session``, bound to it; or on none)."""
    holder = uuid.uuid4().hex
    store.dialect.mark_alive(holder)
    store.renew_holder(holder, owner=owner_here(os.getpid()), shortest=LEASE, session=session)
    return holder


def claim_here(store: Store, job_id: str, holder: str | None = None) -> Claimed:
    """Claim a new job ``job_id`` as this process, kept by ``holder``."""
    message = job_message(job_id, "tests.job")
    store.register(message)
    outcome = store.claim(message, owner=owner_here(os.getpid()), duration=LEASE, holder=holder)
    assert isinstance(outcome, Claimed), outcome
    return outcome


def _hold_and_exit(settings: Settings, job_id: str, done: Connection) -> None:
    """A holder process: make its holder on its own session, claim the job with it, report,
    and exit without releasing anything."""
    try:
        store = Store(settings)
        session = store.db.session()
        holder = hold(store, session)
        outcome = claim_here(store, job_id, holder)
        done.send((holder, outcome.bound))
    except BaseException as exc:
        done.send((None, repr(exc)))
    os._exit(0)


def test_a_holder_whose_process_died_loses_its_jobs_at_the_next_reaper_pass(
    store: Store, settings: Settings
) -> None:
    # Given a job claimed by another process, kept by its holder, bound to that process's
    # session; and no other session of anyone's (a deployment of one worker)
    context = multiprocessing.get_context("fork")
    reports, done = context.Pipe(duplex=False)
    holder = context.Process(target=_hold_and_exit, args=(settings, "orphan-1", done))
    store.engine.dispose()  # the child must not share the parent's pooled connections
    holder.start()
    assert reports.poll(30), "the holder process reported nothing"
    holder_id, bound = reports.recv()
    assert bound is True, bound
    job = store.get("orphan-1")
    assert job is not None and job.state == "running" and job.holder == holder_id
    assert job.expires_in is not None and job.expires_in > LEASE - 60

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
    assert store.expire_orphaned(batch=10) == []  # its holder is gone: nothing more to end


def test_a_holder_whose_session_is_alive_keeps_its_jobs(store: Store) -> None:
    # Given a job claimed by this process, kept by its holder on its keeper session
    session = store.db.session()
    holder = hold(store, session)
    claim_here(store, "alive-1", holder)

    # When the reaper looks, then it leaves the job alone: the session is still there
    assert store.expire_orphaned(batch=10) == []
    store.release_stale()
    job = store.get("alive-1")
    assert job is not None and job.holder == holder and job.expires_in > LEASE - 60
    session.close()


def test_a_holders_renewal_keeps_its_jobs_without_writing_them(store: Store) -> None:
    # Given a job kept by a holder whose last renewal was long ago (by the database's clock)
    session = store.db.session()
    holder = hold(store, session)
    claim_here(store, "kept-1", holder)
    with store.engine.begin() as connection:
        t, h = store.table, store.holders
        connection.execute(t.update().values(renewed_at=t.c.renewed_at - LEASE + 5))
        connection.execute(h.update().values(renewed_at=h.c.renewed_at - LEASE + 5))
    before = store.get("kept-1")
    assert before is not None and before.expires_in < 10

    # When its holder renews, then the job's lease moves on with it, its row untouched
    store.renew_holder(holder, owner=owner_here(os.getpid()), shortest=LEASE, session=session)
    after = store.get("kept-1")
    assert after is not None and after.expires_in > LEASE - 60
    assert after.renewed_at == before.renewed_at
    session.close()


def test_a_job_whose_holder_row_is_gone_still_ends_with_its_own_lease(store: Store) -> None:
    # Given a job kept by a holder whose row is gone (deleted by hand, say), and whose own
    # last claim or checkpoint is older than its lease (by the database's clock)
    session = store.db.session()
    holder = hold(store, session)
    claim_here(store, "unkept-1", holder)
    with store.engine.begin() as connection:
        t, h = store.table, store.holders
        connection.execute(h.delete().where(h.c.id == holder))
        connection.execute(t.update().values(renewed_at=t.c.renewed_at - LEASE - 5))
    job = store.get("unkept-1")
    assert job is not None and job.state == "running" and job.expires_in < 0

    # When the reaper releases stale leases, then the job's lease ends, unbound, and the
    # expiry search finds it: it is not running forever with nobody to end it
    assert store.release_stale() == 1
    job = store.get("unkept-1")
    assert job is not None and job.holder is None
    reaped = store.collect_expired(batch=10, grace=0.0, max_stalled=None, max_attempts=None)
    assert [j.id for j in reaped.republish] == ["unkept-1"]
    session.close()


def test_a_hand_back_unbinds_the_job(store: Store) -> None:
    # Given a job kept by this process's holder
    session = store.db.session()
    outcome = claim_here(store, "back-1", hold(store, session))
    job = store.get("back-1")
    assert job is not None and job.holder is not None

    # When its attempt hands it back, then the row names no holder: whoever claims it next
    # binds its own
    store.hand_back("back-1", outcome.token, reap_in=0.0)
    job = store.get("back-1")
    assert job is not None and (job.state, job.holder) == ("queued", None)
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


def test_a_holder_renewed_off_its_session_is_bound_to_none(store: Store) -> None:
    # Given a job kept by a holder renewed through the pool (a pooler, or bind_session off)
    claim_here(store, "unbound-1", hold(store, None))

    # Then no session of its is judged: only its renewals' end ends it
    job = store.get("unbound-1")
    assert job is not None and job.holder is not None
    assert store.expire_orphaned(batch=10) == []


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_claim_never_binds_a_holder_whose_session_is_gone(store: Store) -> None:
    # Given a keeper whose holder is bound to a session that has ended (the keeper has not
    # seen it yet)
    session = store.db.session()
    holder = hold(store, session)
    gone = session.ident()
    session.close()
    assert gone is not None
    wait_for(lambda: _session_gone(store, gone), timeout=10, interval=0.1, what="the session")

    # When a claim is made with it, then the lease is bound to nothing (its own expiry ends
    # it), so a gone session never hands a live job to the reaper
    outcome = claim_here(store, "stale-1", holder)
    assert outcome.bound is False
    job = store.get("stale-1")
    assert job is not None and job.holder is None and job.expires_in > LEASE - 60
    assert store.expire_orphaned(batch=10) == []


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
@pytest.mark.parametrize("server", ["same", "another"])
def test_a_gone_session_is_a_death_on_the_server_it_renewed_on_and_a_restart_elsewhere(
    store: Store, server: str
) -> None:
    # Given a job kept by a holder bound to a session, whose last renewal was on this server,
    # or on another one (a server since restarted, or the primary before a failover to a
    # replica): the server's start it renewed under is another
    session = store.db.session()
    holder = hold(store, session)
    claim_here(store, "bound-1", holder)
    if server == "another":
        h = store.holders
        with store.engine.begin() as c:
            c.execute(sa.update(h).where(h.c.id == holder).values(server=h.c.server - 3600))

    # When its session ends
    gone = session.ident()
    session.close()
    assert gone is not None
    wait_for(lambda: _session_gone(store, gone), timeout=10, interval=0.1, what="the session")

    # Then on the same server that is a death: the reaper ends the lease at once; after a
    # restart or a failover every session ended at once: the lease waits for its expiry while
    # the live holder binds again at its next renewal
    orphaned = store.expire_orphaned(batch=10)
    if server == "same":
        assert [job_id for job_id, _ in orphaned] == ["bound-1"]
    else:
        assert orphaned == []
        assert store.get("bound-1").holder == holder  # type: ignore[union-attr]


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
            holder = hold(store, None)
            outcome = store.claim(
                message, owner=owner_here(os.getpid()), duration=LEASE, holder=holder
            )
            assert isinstance(outcome, Claimed), outcome
            token = outcome.token
            store.renew_holder(holder, owner="pooled", shortest=LEASE)
            assert store.checkpoint(job_id, token, f'{{"n": {j}}}') == (True, None)
            with store.engine.begin() as connection:
                saved = store.checkpoint(job_id, token, '{"n": -1}', connection=connection)
                assert saved == (True, None)
            assert store.finish(job_id, token, result=str(j))
            job = store.get(job_id)
            assert job is not None, job_id
            assert (job.state, job.holder, job.checkpoint, job.result) == (
                "done",
                None,
                {"n": -1},
                j,
            )
    finally:
        session.close()


# -- SQLite: a holder's lock file, from any PID namespace of the machine ----------------------

REAPER = """
import json, sys
from celery_leases.db.store import Store
from celery_leases.settings import DEFAULTS, validate
store = Store(validate(DEFAULTS | json.loads(sys.argv[1])))
print(json.dumps([job for job, _ in store.expire_orphaned(batch=10)]))
"""


def _reap_in_a_pid_namespace_of_its_own(settings: Settings) -> list[str]:
    """One orphan check, run by a process in a new PID namespace (as a reaper in another
    container sharing the SQLite file's volume is), on the same file."""
    known = {"database_url": settings.database_url, "table": settings.table}
    done = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            REAPER,
            json.dumps(known),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], check=False)
    return probe.returncode == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_on_sqlite_a_reaper_in_another_pid_namespace_never_takes_a_live_holder_for_gone(
    store: Store, settings: Settings
) -> None:
    if not _can_unshare():
        pytest.skip("unshare --pid needs privileges this machine does not give")
    # Given a job kept by a holder of a live process of this machine (this one), and a reaper
    # in a PID namespace of its own, where that process's pid means nothing (or another one)
    context = multiprocessing.get_context("fork")
    reports, done = context.Pipe(duplex=False)
    release, stop = context.Pipe()
    holder = context.Process(target=_hold_until_told, args=(settings, "live-1", done, stop))
    holder.start()
    assert reports.poll(30), "the holder process reported nothing"
    assert reports.recv()[1] is True

    # When that reaper looks, then the holder's lock file says it lives: nothing is ended
    assert _reap_in_a_pid_namespace_of_its_own(settings) == []
    job = store.get("live-1")
    assert job is not None and job.state == "running" and job.holder is not None

    # And once the holder's process has exited, that same reaper sees it gone
    release.send("stop")
    holder.join(timeout=30)
    assert _reap_in_a_pid_namespace_of_its_own(settings) == ["live-1"]


def _hold_until_told(settings: Settings, job_id: str, done: Connection, stop: Connection) -> None:
    try:
        store = Store(settings)
        session = store.db.session()
        holder = hold(store, session)
        outcome = claim_here(store, job_id, holder)
        done.send((holder, outcome.bound))
        stop.recv()
    except BaseException as exc:
        done.send((None, repr(exc)))
    os._exit(0)


@pytest.mark.parametrize("database_url", ["postgres", "mariadb"], indirect=True)
def test_a_connection_the_server_ended_raises_the_stores_error_on_every_later_use(
    store: Store,
) -> None:
    # Given a session whose connection the server ended (an administrator, a failover)
    session = store.db.session()
    ident = session.ident()
    other = store.db.session()
    kill = "SELECT pg_terminate_backend(%s)" if store.dialect.name == "postgresql" else "KILL %s"
    other.run(lambda c: c.query(kill, (ident,)))
    other.close()

    # When statements meet it, the first and every later one (a keeper's tick after the task's
    # checkpoint met it first: the driver then refuses even a cursor), then each raises
    # SQLAlchemy's error marked as a lost connection, which the store's callers classify
    direct = session._direct
    assert direct is not None
    for _ in range(2):
        with pytest.raises(sa.exc.DBAPIError) as raised:
            direct.query("SELECT 1")
        assert raised.value.connection_invalidated and direct.broken

    # And the session's next operation runs on a new connection
    assert session.run(lambda c: c.query("SELECT 1")) == [(1,)]
    assert session.ident() != ident
    session.close()


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_postgresql_connections_end_on_a_silent_network_and_the_users_socket_options_win(
    database_url: str, table_name: str
) -> None:
    # Given a store with the library's socket options, and one whose engine options set one
    # of them and another of libpq's own
    own = {"connect_args": {"tcp_user_timeout": 2_500, "application_name": "billing"}}
    plain = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    tuned = Store(
        validate(
            DEFAULTS | {"database_url": database_url, "table": table_name, "engine_options": own}
        )
    )
    try:
        # When each opens its connection, then a network that drops everything ends it (data
        # unacknowledged for 10 s, or a silent peer after keepalive probes) instead of
        # holding a renewal, a checkpoint and the pool slot until it heals
        def parameters(store: Store) -> dict[str, str]:
            session = store.db.session()
            try:
                return session.run(lambda c: c.connection.info.get_parameters())
            finally:
                session.close()

        expected = {
            "tcp_user_timeout": "10000",
            "keepalives": "1",
            "keepalives_idle": "10",
            "keepalives_interval": "5",
            "keepalives_count": "3",
            "connect_timeout": "10",
        }
        assert parameters(plain).items() >= expected.items()
        # And the user's options win key by key; the library's others stay
        tuned_parameters = parameters(tuned)
        assert tuned_parameters["tcp_user_timeout"] == "2500"
        assert tuned_parameters["application_name"] == "billing"
        assert tuned_parameters["keepalives_idle"] == "10"
    finally:
        plain.engine.dispose()
        tuned.engine.dispose()
