"""Fence your own writes with ``self.lease.token``: a stale attempt's write is refused.

The pattern the docs' guarantees page gives for storage the leases database does not cover: keep
the highest token that wrote a record, and write only ``WHERE last_token <= :token``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask, LeaseLost, lifecycle
from celery_leases.config import settings_for
from celery_leases.db.rows import Claimed
from celery_leases.db.store import Store, store_for
from celery_leases.lease import Lease, current
from celery_leases.states import State
from tests.support.message import job_message


def accounts_table(table_name: str) -> sa.Table:
    """The user's own storage, named after this test's jobs table: tests on other pytest-xdist
    workers use the same server database, and one's teardown must not drop another's table (a
    fixed name did, mid-statement, in CI); ``fresh_table_name`` drops it at teardown."""
    return sa.Table(
        f"{table_name}_accounts",
        sa.MetaData(),
        sa.Column("id", sa.String(50), primary_key=True),
        sa.Column("balance", sa.Integer, nullable=False),
        sa.Column("last_token", sa.BigInteger, nullable=False),
    )


def fenced_write(
    connection: sa.Connection, accounts: sa.Table, account: str, balance: int, token: int
) -> bool:
    """The documented pattern: True when written, False when a newer attempt already wrote."""
    result = connection.execute(
        sa.update(accounts)
        .where(accounts.c.id == account, accounts.c.last_token <= token)
        .values(balance=balance, last_token=token)
    )
    return result.rowcount == 1


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("fencing", broker="memory://", set_as_current=False)
    app.conf.leases_database_url = database_url
    app.conf.leases_table = table_name
    yield app
    store_for(settings_for(app)).engine.dispose()


@pytest.fixture
def accounts(app: Celery, table_name: str) -> sa.Table:
    table = accounts_table(table_name)
    table.create(store_for(settings_for(app)).engine)
    return table


def two_attempts(store: Store) -> tuple[Claimed, Claimed]:
    """Attempt 1 claims, pauses past its lease; attempt 2 claims the expired job."""
    sent = job_message("job", "t")
    store.register(sent)
    first = store.claim(sent, owner="a/1", duration=30)
    assert isinstance(first, Claimed)
    store.release("job")
    second = store.claim(sent, owner="b/2", duration=30)
    assert isinstance(second, Claimed)
    return first, second


def test_a_stale_attempts_fenced_write_is_refused_and_the_newer_value_stays(
    app: Celery, accounts: sa.Table
) -> None:
    store = store_for(settings_for(app))
    with store.engine.begin() as connection:
        connection.execute(sa.insert(accounts).values(id="acct", balance=0, last_token=0))
    first, second = two_attempts(store)
    assert second.token > first.token

    # When the newer attempt writes, then the stale one wakes up and writes
    with store.engine.begin() as connection:
        assert fenced_write(connection, accounts, "acct", 200, second.token)
    with store.engine.begin() as connection:
        stale_written = fenced_write(connection, accounts, "acct", 100, first.token)

    # Then the stale write is refused and the newer value stays
    assert not stale_written
    with store.engine.connect() as connection:
        row = connection.execute(sa.select(accounts.c.balance, accounts.c.last_token)).one()
    assert tuple(row) == (200, second.token)


def test_a_stale_attempts_transactional_checkpoint_rolls_back_its_own_writes(
    app: Celery, accounts: sa.Table
) -> None:
    @app.task(base=LeasedTask, bind=True, shared=False)
    def step(self: LeasedTask) -> None:
        pass

    store = store_for(settings_for(app))
    first, _ = two_attempts(store)
    stale = Lease("job", first.token, 1, None, "a/1", 30.0, 10.0)
    current.stack.append(stale)
    try:
        # When the stale attempt writes and checkpoints in one transaction
        with pytest.raises(LeaseLost), store.engine.begin() as connection:
            connection.execute(sa.insert(accounts).values(id="stale", balance=1, last_token=1))
            step.checkpoint({"page": 9}, connection=connection)
    finally:
        current.stack.remove(stale)

    # Then its write rolled back with the refused checkpoint
    with store.engine.connect() as connection:
        assert connection.execute(sa.select(sa.func.count()).select_from(accounts)).scalar() == 0
    assert store.get("job").checkpoint is None


def test_a_refused_write_that_finds_the_database_behind_the_attempt_says_it_lost_commits(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    @app.task(base=LeasedTask, bind=True, shared=False)
    def step(self: LeasedTask) -> None:
        pass

    store = store_for(settings_for(app))
    first, second = two_attempts(store)
    # Given the database went back behind the second attempt, as after a failover to a
    # replica that missed its claim: the job is at the first attempt's token again
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(sa.update(t).where(t.c.id == "job").values(token=first.token))
    assert store.lost_commits("job", second.token)
    assert not store.lost_commits("job", first.token)

    # When the second attempt checkpoints
    live = Lease("job", second.token, 2, None, "b/2", 30.0, 10.0)
    current.stack.append(live)
    try:
        with pytest.raises(LeaseLost), caplog.at_level("ERROR", logger="celery_leases"):
            step.checkpoint({"page": 3})
    finally:
        current.stack.remove(live)

    # Then its refusal says the database lost commits, not that another attempt holds the job
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "the database is behind this attempt" in record.getMessage()
    assert "checkpoint not saved" in record.getMessage()

    # And a refusal by a newer attempt's claim is not taken for it
    assert not store.lost_commits("job", first.token - 1)


def test_a_refused_checkpoint_says_why_newer_attempt_job_ended_or_lease_ended(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """A revoke's terminate ends the job in the worker's main process just before its signal
    reaches the pool process: a checkpoint between the two is refused, and its log line must
    not say another attempt holds the job (the chaos check of two attempts at once reads it)."""

    @app.task(base=LeasedTask, bind=True, shared=False)
    def step(self: LeasedTask) -> None:
        pass

    store = store_for(settings_for(app))

    def refusal(token: int) -> str:
        lease = Lease("job", token, 1, None, "a/1", 30.0, 10.0)
        current.stack.append(lease)
        caplog.clear()
        try:
            with pytest.raises(LeaseLost) as raised, caplog.at_level("WARNING", "celery_leases"):
                step.checkpoint({"page": 3})
        finally:
            current.stack.remove(lease)
        (record,) = [r for r in caplog.records if "lease lost on job" in r.getMessage()]
        assert "checkpoint not saved" in record.getMessage()
        assert str(raised.value).startswith("job job: this attempt lost its lease (")
        return record.getMessage()

    # Given a job whose first attempt's lease was taken by a second attempt's claim
    first, second = two_attempts(store)
    # Then the first attempt's checkpoint says another attempt holds it
    assert "another attempt holds it" in refusal(first.token)

    # Given the second attempt's job revoked as a revoke's terminate ends it, at its token
    lifecycle.end_in_celery(app, store, "job", State.REVOKED, "terminated in Celery (w@h)")
    # Then its checkpoint says the job ended, and why, not that another attempt holds it
    said = refusal(second.token)
    assert "the job ended meanwhile (revoked: terminated in Celery (w@h))" in said
    assert "another attempt" not in said

    # Given the second attempt's lease ended under it instead, and the reaper sent the job
    # again, not claimed yet (its row at the same token, queued)
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(t).where(t.c.id == "job").values(state="queued", owner=None, error=None)
        )
    # Then its checkpoint says its lease ended
    said = refusal(second.token)
    assert "its lease ended before this write (the job is now queued)" in said
