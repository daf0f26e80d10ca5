"""How ``apply_async`` commits a job's record on PostgreSQL: a plain job's INSERT commits
asynchronously (``synchronous_commit`` off for that one statement's transaction, its message
being the job's second copy), every other record waits for its WAL flush, and the setting never
outlives the statement's transaction (docs/guarantees.md, "A job accepted is never lost at
dispatch").

A trigger on the jobs table copies ``current_setting('synchronous_commit')`` of each INSERT's
own transaction into a side table: that is the setting its commit follows. The calls go through
``LeasedTask.apply_async`` (``memory://`` broker), so the library decides which record is
flushed, on its own connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.store import store_for

pytestmark = pytest.mark.parametrize("database_url", ["postgres"], indirect=True)


@pytest.fixture
def commits(database_url: str, table_name: str) -> Iterator[sa.Table]:
    """``<table>_commits``: (job id, ``synchronous_commit`` of the transaction that inserted
    its row, the server process of its connection), one row per INSERT into the jobs table."""
    engine = sa.create_engine(database_url)
    log = sa.Table(
        f"{table_name}_commits",
        sa.MetaData(),
        sa.Column("job_id", sa.Text),
        sa.Column("sync", sa.Text),
        sa.Column("backend", sa.Integer),
    )
    log.create(engine)
    function = f"{table_name}_sync_of"
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                f"CREATE FUNCTION {function}() RETURNS trigger AS $$ BEGIN "
                f"INSERT INTO {log.name} (job_id, sync, backend) "
                f"VALUES (NEW.id, current_setting('synchronous_commit'), pg_backend_pid()); "
                f"RETURN NEW; END $$ LANGUAGE plpgsql"
            )
        )
        connection.execute(
            sa.text(
                f"CREATE TRIGGER {function} AFTER INSERT ON {table_name} "
                f"FOR EACH ROW EXECUTE FUNCTION {function}()"
            )
        )
        # The server's own setting: what every other transaction commits with.
        assert connection.execute(sa.text("SHOW synchronous_commit")).scalar_one() == "on"
    yield log
    with engine.begin() as connection:
        connection.execute(sa.text(f"DROP FUNCTION IF EXISTS {function}() CASCADE"))
    engine.dispose()


def make_app(database_url: str, table_name: str, **settings: object) -> Celery:
    app = Celery("record_commit", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        leases_database_url=database_url,
        leases_table=table_name,
        task_ignore_result=True,
        task_default_queue=table_name,  # memory:// queues live as long as this process
        **settings,
    )

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.plain")
    def plain(self: LeasedTask, n: int) -> int:
        return n

    @app.task(
        base=LeasedTask, bind=True, shared=False, name="tests.keyed", lease_key="acct:{account}"
    )
    def keyed(self: LeasedTask, account: str) -> str:
        return account

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.grouped",
        lease_group="tenant:{tenant}",
        lease_group_limit=10,
    )
    def grouped(self: LeasedTask, tenant: str) -> str:
        return tenant

    return app


@pytest.fixture
def apps(database_url: str, table_name: str) -> Iterator[list[Celery]]:
    made: list[Celery] = []
    yield made
    for app in made:
        store_for(settings_for(app)).engine.dispose()
        app.close()


def sync_of(engine: sa.Engine, commits: sa.Table) -> dict[str, str]:
    """Each job's ``synchronous_commit`` at its INSERT."""
    with engine.connect() as connection:
        return {str(j): str(s) for j, s, _ in connection.execute(sa.select(commits))}


def backends_of(engine: sa.Engine, commits: sa.Table) -> set[int]:
    """The server processes (connections) the INSERTs ran on."""
    with engine.connect() as connection:
        return {int(b) for b in connection.execute(sa.select(commits.c.backend)).scalars()}


def test_only_a_plain_jobs_record_commits_without_waiting_for_its_flush(
    database_url: str, table_name: str, commits: sa.Table, apps: list[Celery]
) -> None:
    # Given a client of the default settings (leases_record_sync_commit off)
    app = make_app(database_url, table_name)
    apps.append(app)

    # When it sends a plain job, a keyed job, a job of a group, then a plain job again
    app.tasks["tests.plain"].apply_async((1,), task_id="plain-1")
    app.tasks["tests.keyed"].apply_async(("a",), task_id="keyed-1")
    app.tasks["tests.grouped"].apply_async(("t",), task_id="grouped-1")
    app.tasks["tests.plain"].apply_async((2,), task_id="plain-2")

    # Then only the plain jobs' records committed with synchronous_commit off; the keyed and
    # grouped ones, inserted on the same connection right after the first, waited for their
    # flush: the setting ended with the plain record's own transaction
    store = store_for(settings_for(app))
    assert sync_of(store.engine, commits) == {
        "plain-1": "off",
        "keyed-1": "on",
        "grouped-1": "on",
        "plain-2": "off",
    }
    assert len(backends_of(store.engine, commits)) == 1  # all four on the client's one connection
    assert {job.id: job.state for job in store.list_jobs(states=("queued",))} == {
        "plain-1": "queued",
        "keyed-1": "queued",
        "grouped-1": "queued",
        "plain-2": "queued",
    }


def test_leases_record_sync_commit_makes_a_plain_jobs_record_wait_for_its_flush(
    database_url: str, table_name: str, commits: sa.Table, apps: list[Celery]
) -> None:
    app = make_app(database_url, table_name, leases_record_sync_commit=True)
    apps.append(app)

    app.tasks["tests.plain"].apply_async((1,), task_id="plain-1")

    assert sync_of(store_for(settings_for(app)).engine, commits) == {"plain-1": "on"}
