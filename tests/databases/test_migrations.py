"""The jobs table's migrations: created and upgraded only by them, checked in one read."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import celery_leases
from celery_leases import ConfigurationError, get_job
from celery_leases.db import migrations
from celery_leases.db.dbapi import Direct
from celery_leases.db.schema import groups_table, holders_table, jobs_table, keys_table
from celery_leases.db.store import Store
from celery_leases.settings import DEFAULTS, validate
from tests.support.concurrent import at_once
from tests.support.message import job_message


def new_store(url: str, table: str) -> Store:
    return Store(validate(DEFAULTS | {"database_url": url, "table": table}))


@pytest.fixture
def store(database_url: str, fresh_table_name: str) -> Iterator[Store]:
    """A store whose table does not exist yet."""
    store = new_store(database_url, fresh_table_name)
    yield store
    store.engine.dispose()


def tables(store: Store) -> set[str]:
    with store.engine.connect() as connection:
        return set(sa.inspect(connection).get_table_names())


def test_the_head_revision_makes_exactly_the_table_the_code_reads_and_writes(
    store: Store,
) -> None:
    migrations.upgrade(store)

    assert_the_code_schema(store)


def assert_the_code_schema(store: Store) -> None:
    """``store``'s tables are exactly the ones its code reads and writes, at the head."""
    assert migrations.current(store) == migrations.head()
    expected = sa.MetaData()
    jobs_table(expected, store.table.name, store.dialect)
    keys_table(expected, store.table.name)
    holders_table(expected, store.table.name)
    groups_table(expected, store.table.name)
    name = store.table.name

    def ours_only(found: str | None, kind: str, parents: Any) -> bool:
        # The shared database holds other tests' tables too, made and dropped while this one
        # reflects: read only this table's own (a table dropped mid-reflection fails it).
        return kind != "table" or found == name or str(found).startswith(f"{name}_")

    with store.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"include_name": ours_only})
        diff = compare_metadata(context, expected)
    ours = [d for d in diff if name in repr(d) and "_version" not in repr(d)]
    assert ours == []


def run_by_hand(store: Store, statements: list[str]) -> None:
    """Run ``statements`` one by one as a DBA would (``psql -f``: autocommit, the script's
    own BEGIN and COMMIT)."""
    engine = sa.create_engine(store.engine.url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            for statement in statements:
                connection.exec_driver_sql(statement)
    finally:
        engine.dispose()


@pytest.mark.parametrize("start", [None, "0003"])
def test_the_revisions_sql_run_by_hand_makes_the_table_the_code_reads_and_writes(
    store: Store, start: str | None
) -> None:
    # Given an empty database, or a table at an older revision
    if start is not None:
        migrations.upgrade(store, revision=start)

    # When the SQL of the upgrade is written (nothing runs), then run by hand
    statements = migrations.sql(store)
    assert migrations.current(store) == start
    run_by_hand(store, statements)

    # Then the table is exactly the one the revisions make when they run, at the head, and
    # the SQL of a table at the head is nothing
    store.schema_changed()
    assert_the_code_schema(store)
    assert migrations.sql(store) == []
    if start is not None:
        assert not any("CREATE TABLE" in s and "_holders" in s for s in statements)


def test_the_sql_of_a_table_made_before_the_migrations_is_refused_naming_upgrade(
    store: Store,
) -> None:
    jobs_table(sa.MetaData(), store.table.name, store.dialect).create(store.engine)

    with pytest.raises(ConfigurationError) as raised:
        migrations.sql(store)

    assert "was made before the migrations" in str(raised.value)
    assert "leases upgrade" in str(raised.value)


def test_the_revisions_are_one_line_numbered_by_their_file_names() -> None:
    script = ScriptDirectory(str(migrations.HERE))

    walked = [r.revision for r in script.walk_revisions("base", "heads")]

    assert script.get_heads() == [migrations.head()]
    assert tuple(reversed(walked)) == migrations.revisions()
    for revision in script.walk_revisions("base", "heads"):
        assert revision.path.rsplit("/", 1)[1].startswith(f"{revision.revision}_")


def test_a_read_on_a_missing_table_names_init_db_and_creates_nothing(store: Store) -> None:
    with pytest.raises(ConfigurationError) as raised:
        store.get("job-1")

    assert f"no leases table {store.table.name!r} in " in str(raised.value)
    assert "celery -A proj leases init-db" in str(raised.value)
    assert store.table.name not in tables(store)


def test_get_job_on_a_missing_table_raises_instead_of_creating_it(
    database_url: str, fresh_table_name: str
) -> None:
    app = celery_leases_app(database_url, fresh_table_name)
    try:
        with pytest.raises(ConfigurationError, match="init-db"):
            get_job(app, "job-1")
        with pytest.raises(ConfigurationError, match="init-db"):
            get_job(app, "job-1")  # the check is not remembered as passed
    finally:
        close(app)
    store = new_store(database_url, fresh_table_name)
    try:
        assert fresh_table_name not in tables(store)
    finally:
        store.engine.dispose()


def test_migrate_creates_the_table_with_its_own_version_table_and_runs_again_as_a_no_op(
    database_url: str, fresh_table_name: str
) -> None:
    app = celery_leases_app(database_url, fresh_table_name)
    store = new_store(database_url, fresh_table_name)
    had_alembic_version = "alembic_version" in tables(store)  # someone else's, on a shared db
    try:
        first = celery_leases.migrate(app)
        again = celery_leases.migrate(app)
        assert get_job(app, "job-1") is None
    finally:
        close(app)

    assert (first.existed, first.before, first.after) == (False, None, migrations.head())
    assert first.describe().endswith(f": created (revision {migrations.head()})")
    assert (again.existed, again.changed) == (True, False)
    try:
        assert {fresh_table_name, f"{fresh_table_name}_version"} <= tables(store)
        assert ("alembic_version" in tables(store)) == had_alembic_version
    finally:
        store.engine.dispose()


def test_a_process_first_operation_checks_the_schema_in_one_statement(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a migrated table and a process that has not used it yet
    migrations.upgrade(store)
    fresh = new_store(str(store.db.url), store.table.name)
    statements: list[str] = []
    sa.event.listen(
        fresh.engine, "before_cursor_execute", lambda *a: statements.append(a[2].split()[0])
    )
    # The hot path's statements bypass SQLAlchemy's events (celery_leases/db/dbapi.py).
    execute = Direct.execute

    def counted(self: Direct, statement: Any, params: Any = None) -> Any:
        statements.append(type(statement).__name__)
        return execute(self, statement, params)

    monkeypatch.setattr(Direct, "execute", counted)
    try:
        # When it reads a job, then another
        fresh.get("job-1")
        first = len(statements)
        fresh.get("job-2")

        # Then the first read cost one statement more than the second: the version read
        assert first == len(statements) - first + 1
    finally:
        fresh.engine.dispose()


def test_a_table_at_an_older_revision_is_refused_naming_the_upgrade_command(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a table at the head revision, and code whose head is a later revision
    migrations.upgrade(store)
    shipped = migrations.revisions()
    monkeypatch.setattr(migrations, "revisions", lambda: (*shipped, "9998"))

    with pytest.raises(ConfigurationError) as raised:
        store.get("job-1")

    older = f"is at revision {shipped[-1]}, older than this celery-leases needs (9998)"
    assert older in str(raised.value)
    assert "celery -A proj leases upgrade" in str(raised.value)


def test_a_table_a_newer_release_migrated_is_used_with_a_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    migrations.upgrade(store)
    version = migrations.version_table_name(store.table.name)
    with store.engine.begin() as connection:
        connection.execute(sa.text(f"UPDATE {version} SET version_num = '9999'"))

    with caplog.at_level(logging.WARNING, logger="celery_leases"):
        store.register(job_message("job-1", "tests.job"))

    job = store.get("job-1")
    assert job is not None and job.state == "queued"
    assert "is at revision 9999, newer than this celery-leases knows" in caplog.text


def test_processes_migrating_at_once_create_the_table_once(store: Store) -> None:
    url, name = str(store.db.url), store.table.name

    def migrate(_: int) -> migrations.Migrated:
        own = new_store(url, name)
        try:
            return migrations.upgrade(own)
        finally:
            own.engine.dispose()

    outcomes = at_once(4, migrate)
    assert sum(not o.existed for o in outcomes) == 1
    assert migrations.current(store) == migrations.head()
    with store.engine.connect() as connection:
        version = migrations.version_table_name(name)
        assert connection.execute(sa.text(f"SELECT COUNT(*) FROM {version}")).scalar() == 1


def test_a_downgrade_to_base_drops_the_table_and_a_read_then_names_init_db(store: Store) -> None:
    migrations.upgrade(store)
    store.register(job_message("job-1", "tests.job"))

    dropped = migrations.downgrade(store)

    assert dropped.after == "base" and "dropped with its jobs" in dropped.describe()
    assert store.table.name not in tables(store)
    with pytest.raises(ConfigurationError, match="init-db"):
        store.get("job-1")


def test_upgrade_to_an_unknown_revision_is_a_configuration_error(store: Store) -> None:
    with pytest.raises(ConfigurationError, match=r"cannot migrate .* to 'nope'"):
        migrations.upgrade(store, revision="nope")


# -- PostgreSQL: the view ------------------------------------------------------------------------


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_the_postgres_view_shows_times_as_timestamptz_and_json_as_jsonb(store: Store) -> None:
    # Given a job claimed and checkpointed, and one whose checkpoint someone damaged
    migrations.upgrade(store)
    for job_id in ("job-1", "job-2"):
        sent = job_message(job_id, "tests.job")
        store.register(sent)
        claimed = store.claim(sent, owner="w/1", duration=30.0)
        assert store.checkpoint(job_id, claimed.token, '{"page": 7, "cursor": "c7"}')[0]  # type: ignore[union-attr]
    table = store.table.name
    with store.engine.begin() as connection:
        connection.execute(
            sa.text(f"UPDATE {table} SET checkpoint = 'not json' WHERE id = 'job-2'")
        )

    # When someone queries the view with PostgreSQL's own types
    with store.engine.connect() as connection:
        rows = connection.execute(
            sa.text(
                f"SELECT id, checkpoint->>'cursor', pg_typeof(created_at)::text, "
                f"expires_at > now(), message->'headers'->>'task' "
                f"FROM {table}_view ORDER BY id"
            )
        ).all()

    # Then times are timestamptz, JSON is jsonb, and the damaged value is NULL, not an error
    assert [tuple(r) for r in rows] == [
        ("job-1", "c7", "timestamp with time zone", True, "tests.job"),
        ("job-2", None, "timestamp with time zone", True, "tests.job"),
    ]


def celery_leases_app(url: str, table: str) -> Any:
    from celery import Celery

    app = Celery("migrations_tests", set_as_current=False)
    app.conf.update(leases_database_url=url, leases_table=table)
    return app


def close(app: Any) -> None:
    from celery_leases.config import settings_for
    from celery_leases.db.store import store_for

    store_for(settings_for(app)).engine.dispose()
    app.close()


@pytest.mark.parametrize("setting", [True, False])
def test_a_starting_worker_migrates_only_with_leases_migrate_on_start(
    database_url: str, fresh_table_name: str, setting: bool
) -> None:
    from types import SimpleNamespace

    from celery_leases import LeasedTask
    from celery_leases.worker.signals import migrate_on_start

    app = celery_leases_app(database_url, fresh_table_name)
    app.conf.leases_migrate_on_start = setting

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.on_start")
    def job(self: LeasedTask) -> None:
        pass

    try:
        # When a worker of the app starts (its worker_init handler, in its main process)
        migrate_on_start(sender=SimpleNamespace(app=app))
    finally:
        close(app)

    store = new_store(database_url, fresh_table_name)
    try:
        assert (fresh_table_name in tables(store)) is setting
    finally:
        store.engine.dispose()


def test_processes_connecting_at_once_to_a_new_sqlite_file_all_connect(tmp_path: Any) -> None:
    # Given new SQLite files, each met by eight connections at once (a worker's pool processes
    # and beat starting together): the first connection of each switches the file to WAL,
    # which needs the file to itself; SQLite refuses the others at once, without a busy wait
    def connect(path: str) -> Any:
        def open_one(_: int) -> Any:
            own = new_store(f"sqlite:///{path}", "leases_jobs")
            try:
                with own.engine.connect() as connection:
                    return connection.exec_driver_sql("PRAGMA journal_mode").scalar()
            finally:
                own.engine.dispose()

        return open_one

    # When they connect, then every one does, and finds the file in WAL mode
    for n in range(40):
        assert at_once(8, connect(str(tmp_path / f"new-{n}.sqlite3"))) == ["wal"] * 8
