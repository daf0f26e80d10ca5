"""LeasedTask run in this process (``task.apply()``, eager mode) against a real database."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import socket
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, Task
from celery.signals import after_task_publish

import celery_leases
from celery_leases import (
    ArgumentsError,
    CheckpointError,
    ConfigurationError,
    CorruptJob,
    LeasedTask,
    StoreUnavailable,
    get_job,
)
from celery_leases.config import settings_for
from celery_leases.db.store import Store, store_for
from celery_leases.process import INSTANCE
from celery_leases.worker.keeper import all_keepers
from tests.support.legacy import make_schema_3_table
from tests.support.message import job_message

SQL = "x'); DROP TABLE {table}; --"

#: Checkpoints over the test app's 200 bytes: in characters, and in UTF-8 bytes only (122
#: characters, 242 bytes).
TOO_BIG = {"too big": "x" * 500, "too big in bytes": "\u00e9" * 120}

NOT_JSON = {
    "an object": lambda: object(),
    "a set": lambda: {1, 2},
    "NaN": lambda: float("nan"),
    "infinity": lambda: {"rate": float("inf")},
    "bytes": lambda: b"\x00\x01",
}


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("eager_tests", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        leases_database_url=database_url,
        leases_table=table_name,
        leases_max_checkpoint_bytes=200,
    )
    define_tasks(app)
    yield app
    store = store_for(settings_for(app))
    for keeper in all_keepers():
        if keeper.store is store:
            keeper.stop()
            keeper.join(timeout=5)
    store.engine.dispose()
    app.close()


@pytest.fixture
def store(app: Celery) -> Store:
    return store_for(settings_for(app))


def define_tasks(app: Celery) -> None:
    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.count_to")
    def count_to(self: LeasedTask, n: int) -> int:
        for i in range(self.lease.checkpoint or 0, n):
            self.checkpoint(i + 1, progress=(i + 1, n))
        return n

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.bad_checkpoint")
    def bad_checkpoint(self: LeasedTask, kind: str) -> str:
        self.checkpoint({"good": 1})
        bad = TOO_BIG[kind] if kind in TOO_BIG else NOT_JSON[kind]()
        try:
            self.checkpoint(bad)
        except CheckpointError as exc:
            return str(exc)
        return "no error"

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.saved_then_changed")
    def saved_then_changed(self: LeasedTask) -> Any:
        state = {"pages": (1, 2)}
        self.checkpoint(state)
        state["pages"] = "changed after the save"
        return self.lease.checkpoint

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.echo")
    def echo(self: LeasedTask, value: Any) -> Any:
        self.checkpoint(value)
        return self.lease.checkpoint

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.lease_copies")
    def lease_copies(self: LeasedTask) -> Any:
        self.checkpoint({"page": 3})
        lease = self.lease
        copies = {
            "asdict": dataclasses.asdict(lease),
            "deepcopy": copy.deepcopy(lease),
            "pickle": pickle.loads(pickle.dumps(lease)),
        }
        as_dict = copies.pop("asdict")
        found = {
            way: [c.checkpoint, c.token == lease.token, c.carried] for way, c in copies.items()
        }
        return {"asdict": [as_dict["checkpoint"], as_dict["token"] == lease.token, None], **found}

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.lease_fields")
    def lease_fields(self: LeasedTask) -> dict[str, Any]:
        lease = self.lease
        fields = {
            "job_id": lease.job_id,
            "token": lease.token,
            "attempt": lease.attempt,
            "checkpoint": lease.checkpoint,
            "owner": lease.owner,
        }
        self.checkpoint({"seen": lease.attempt})
        return fields

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.fails")
    def fails(self: LeasedTask) -> None:
        self.checkpoint({"page": 2})
        raise ValueError("boom on page 2")

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.in_memory")
    def in_memory(self: LeasedTask) -> Any:
        self.checkpoint({"step": 1})
        self.checkpoint({"step": 2})
        return {"lease": self.lease.job_id, "checkpoint": self.lease.checkpoint}

    @app.task(
        base=LeasedTask, bind=True, shared=False, name=SQL.format(table=app.conf.leases_table)
    )
    def hostile_name(self: LeasedTask) -> str:
        self.checkpoint(SQL)
        return "ok"


def task(app: Celery, name: str) -> Any:
    return app.tasks[name]


def expire(store: Store, job_id: str) -> None:
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(t).where(t.c.id == job_id).values(expires_at=t.c.expires_at - 100)
        )


def write_raw(store: Store, job_id: str, **columns: Any) -> None:
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(sa.update(t).where(t.c.id == job_id).values(columns))


# -- checkpoints --------------------------------------------------------------------------------


def test_a_task_run_in_process_holds_a_lease_checkpoints_and_ends_done(app: Celery) -> None:
    result = task(app, "tests.count_to").apply(args=(3,), task_id="job-1")

    assert result.get() == 3
    job = get_job(app, "job-1")
    assert job is not None
    assert (job.state, job.checkpoint, job.attempts, job.result) == ("done", 3, 1, 3)
    assert (job.progress_done, job.progress_total) == (3, 3)
    assert (job.task, job.args, job.owner, job.expires_in) == ("tests.count_to", [3], None, None)


@pytest.mark.parametrize("kind", [*NOT_JSON, *TOO_BIG])
def test_a_checkpoint_that_cannot_be_stored_raises_and_keeps_the_previous_one(
    app: Celery, kind: str
) -> None:
    result = task(app, "tests.bad_checkpoint").apply(args=(kind,), task_id="job-1")

    message = result.get()
    assert message.startswith("checkpoint of job job-1 ")
    assert message.endswith("the previous checkpoint is kept")
    if kind in TOO_BIG:
        assert "over leases_max_checkpoint_bytes (200)" in message
    else:
        assert "is not JSON-serializable" in message
    job = get_job(app, "job-1")
    assert job is not None and (job.state, job.checkpoint) == ("done", {"good": 1})


def test_a_tasks_own_max_checkpoint_bytes_overrides_the_apps(app: Celery) -> None:
    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.roomy",
        lease_max_checkpoint_bytes=1000,
    )
    def roomy(self: LeasedTask) -> None:
        self.checkpoint("x" * 500)

    task(app, "tests.roomy").apply(task_id="job-1").get()

    job = get_job(app, "job-1")
    assert job is not None and job.checkpoint == "x" * 500


def test_the_lease_tells_the_attempt_its_job_token_attempt_checkpoint_and_owner(
    app: Celery, store: Store
) -> None:
    # Given a first attempt that ran, then was put back as if its lease had expired
    first = task(app, "tests.lease_fields").apply(task_id="job-1").get()
    write_raw(store, "job-1", state="running", expires_at=store.now())
    expire(store, "job-1")

    # When the job runs again
    second = task(app, "tests.lease_fields").apply(task_id="job-1").get()

    # Then the second attempt has the next token and the first attempt's checkpoint
    owner = f"{socket.gethostname()}/{INSTANCE}/{os.getpid()}"
    assert second["token"] > first["token"] > 0
    assert first == {
        "job_id": "job-1",
        "token": first["token"],
        "attempt": 1,
        "checkpoint": None,
        "owner": owner,
    }
    assert second == {
        "job_id": "job-1",
        "token": second["token"],
        "attempt": 2,
        "checkpoint": {"seen": 1},
        "owner": owner,
    }


def test_a_failing_task_ends_failed_with_its_error_and_keeps_its_checkpoint(app: Celery) -> None:
    result = task(app, "tests.fails").apply(task_id="job-1")

    assert result.failed()
    job = get_job(app, "job-1")
    assert job is not None
    assert (job.state, job.error, job.checkpoint) == (
        "failed",
        "ValueError: boom on page 2",
        {"page": 2},
    )
    assert (job.owner, job.expires_in) == (None, None)


def test_after_a_checkpoint_the_attempt_reads_what_a_resume_would_not_the_object_it_saved(
    app: Celery,
) -> None:
    # JSON's value (a list for the tuple), and not the caller's object, changed after the save.
    result = task(app, "tests.saved_then_changed").apply(task_id="job-1")

    assert result.get() == {"pages": [1, 2]}
    job = get_job(app, "job-1")
    assert job is not None and job.checkpoint == {"pages": [1, 2]}


def test_text_utf8_cannot_hold_is_stored_escaped_and_read_back_the_same(app: Celery) -> None:
    # A lone surrogate: JSON escapes it and Celery's serializer sends it so; UTF-8 has none
    value = {"name": "caf\u00e9 \ud800", "n": 1}

    result = task(app, "tests.echo").apply(args=(value,), task_id="job-1")

    assert result.get() == value
    job = get_job(app, "job-1")
    assert job is not None and job.state == "done"
    assert (job.args, job.checkpoint, job.result) == ([value], value, value)


def test_a_running_attempts_lease_can_be_copied_pickled_and_turned_into_a_dict(
    app: Celery,
) -> None:
    # (what it keeps of its store, which holds an engine, is left out of a copy)
    result = task(app, "tests.lease_copies").apply(task_id="job-1")

    assert result.get() == {
        "asdict": [{"page": 3}, True, None],
        "deepcopy": [{"page": 3}, True, None],
        "pickle": [{"page": 3}, True, None],
    }


def test_a_direct_call_runs_without_a_lease_and_keeps_checkpoints_in_memory(
    app: Celery, store: Store
) -> None:
    outcome = task(app, "tests.in_memory")()

    assert outcome == {"lease": "(direct call)", "checkpoint": {"step": 2}}
    assert store.list_jobs() == []


def test_a_direct_call_still_refuses_a_checkpoint_that_is_not_json(app: Celery) -> None:
    message = task(app, "tests.bad_checkpoint")("NaN")

    assert message.startswith("checkpoint of job (direct call) is not JSON-serializable")


# -- publishing ---------------------------------------------------------------------------------


@pytest.fixture
def published() -> Iterator[list[str]]:
    """Ids of the task messages that went out to the broker while the test runs."""
    ids: list[str] = []

    def seen(headers: dict[str, Any] | None = None, **_: Any) -> None:
        ids.append((headers or {}).get("id", "?"))

    after_task_publish.connect(seen, weak=False)
    yield ids
    after_task_publish.disconnect(seen)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((object(),), {}), ((), {"n": {1, 2}})],
)
def test_arguments_that_are_not_json_are_refused_before_anything_is_published_or_recorded(
    app: Celery, store: Store, published: list[str], args: Any, kwargs: Any
) -> None:
    with pytest.raises(ArgumentsError, match=r"tests\.count_to must be JSON-serializable.*"):
        task(app, "tests.count_to").apply_async(args, kwargs, task_id="job-1")

    assert published == []
    assert store.list_jobs() == []


def test_nan_and_infinity_are_recorded_and_resumed_as_celerys_json_sends_them(
    app: Celery, store: Store, published: list[str]
) -> None:
    # Celery's JSON serializer sends NaN and Infinity: a job carrying them is recorded, and
    # the attempt that runs it (a resumed one too) gets them back
    @app.task(base=LeasedTask, bind=True, name="tests.echo_floats", shared=False)
    def echo(self: LeasedTask, values: list[float]) -> list[str]:
        return [repr(v) for v in values]

    echo.apply_async(([float("nan"), float("inf"), 1.5],), task_id="job-nan")

    assert published == ["job-nan"]
    job = get_job(app, "job-nan")
    assert job is not None and job.state == "queued"
    assert [repr(v) for v in job.args[0]] == ["nan", "inf", "1.5"]
    assert echo.apply(args=job.args, task_id="job-nan").get() == ["nan", "inf", "1.5"]


def test_a_published_job_is_recorded_as_queued_with_its_arguments(
    app: Celery, store: Store, published: list[str]
) -> None:
    task(app, "tests.count_to").apply_async((5,), task_id="job-1", queue="slow")

    assert published == ["job-1"]
    job = get_job(app, "job-1")
    assert job is not None
    assert (job.state, job.args, job.kwargs, job.route, job.attempts) == (
        "queued",
        [5],
        {},
        {"exchange": "", "routing_key": "slow"},
        0,
    )


def test_under_task_always_eager_a_published_job_is_recorded_and_run_under_its_lease(
    app: Celery,
) -> None:
    app.conf.task_always_eager = True

    result = task(app, "tests.count_to").delay(2)

    assert result.get() == 2
    job = get_job(app, result.id)
    assert job is not None and (job.state, job.checkpoint, job.attempts) == ("done", 2, 1)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_with_leased_task_as_the_apps_task_class_every_task_is_leased_but_those_left_plain(
    database_url: str, table_name: str, published: list[str]
) -> None:
    # Given the one line of docs/tutorial.md that makes every task of an app leased
    app = Celery("adopted", set_as_current=False, task_cls="celery_leases:LeasedTask")
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        leases_database_url=database_url,
        leases_table=table_name,
    )

    @app.task(shared=False, name="tests.adopted")
    def adopted(page: int) -> int:  # neither bind nor a checkpoint: resumed from its start
        return page + 1

    @app.task(base=Task, shared=False, name="tests.left_plain")
    def left_plain() -> str:
        return "plain"

    # When one of each is sent, and the leased one runs
    adopted.apply_async((1,), task_id="job-adopted")
    left_plain.apply_async(task_id="job-plain")
    ran = adopted.apply((1,), task_id="job-adopted").get()

    # Then both were published; only the first is a job, run under its lease
    assert published == ["job-adopted", "job-plain"]
    job = get_job(app, "job-adopted")
    assert job is not None and (job.state, job.attempts, job.args, ran) == ("done", 1, [1], 2)
    assert get_job(app, "job-plain") is None
    store_for(settings_for(app)).engine.dispose()
    app.close()


# -- schema -------------------------------------------------------------------------------------


@pytest.fixture
def legacy_app(database_url: str, fresh_table_name: str) -> Iterator[Celery]:
    """An app whose table does not exist yet: the test makes it as an older release did."""
    app = Celery("eager_legacy", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        leases_database_url=database_url,
        leases_table=fresh_table_name,
    )
    define_tasks(app)
    yield app
    store_for(settings_for(app)).engine.dispose()
    app.close()


def make_legacy_table(app: Celery, *, schema: int, job_id: str | None = None) -> None:
    """The table a celery-leases older than the migrations made at first use (no version
    table): schema 3, or schema 2 (every column but ``session``), with one queued job."""
    store = store_for(settings_for(app))
    table = app.conf.leases_table
    make_schema_3_table(store.engine, table)
    if job_id is not None:
        # An older release used the table as it found it (its register wrote no lease key).
        with store.engine.begin() as connection:
            connection.execute(
                sa.text(
                    f"INSERT INTO {table} (id, task, generation, message, state, token, "
                    "attempts, stalled_attempts, sends, created_at, schema_version) "
                    "VALUES (:id, 'tests.count_to', 0, :message, 'queued', 0, 0, 0, 0, 1.0, 3)"
                ),
                {"id": job_id, "message": job_message(job_id, "tests.count_to", args=[3]).dumps()},
            )
    if schema == 2:
        with store.engine.begin() as connection:
            connection.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN session"))


def test_a_table_from_an_older_schema_is_refused_naming_its_missing_columns(
    legacy_app: Celery,
) -> None:
    table = legacy_app.conf.leases_table
    engine = sa.create_engine(legacy_app.conf.leases_database_url)
    try:
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    f"CREATE TABLE {table} "
                    "(id VARCHAR(155) PRIMARY KEY, task VARCHAR(255), state VARCHAR(16))"
                )
            )
    finally:
        engine.dispose()

    with pytest.raises(ConfigurationError) as raised:
        celery_leases.migrate(legacy_app)

    message = str(raised.value)
    assert f"table {table!r}" in message
    assert "missing columns: generation, version, message, owner, session, token" in message
    assert "checkpoint" in message and "schema_version" in message
    assert ", id," not in message and ", state," not in message
    # And nothing uses the table until it is dealt with
    with pytest.raises(ConfigurationError, match="has no migration history"):
        get_job(legacy_app, "job-1")


def test_a_table_from_schema_2_gets_the_session_column_and_keeps_its_jobs(
    legacy_app: Celery,
) -> None:
    # Given a table of schema 2 (every column but ``session``) holding a queued job
    table = legacy_app.conf.leases_table
    make_legacy_table(legacy_app, schema=2, job_id="before-upgrade")
    with pytest.raises(ConfigurationError, match="celery -A proj leases upgrade"):
        get_job(legacy_app, "before-upgrade")

    # When the migrations run
    migrated = celery_leases.migrate(legacy_app)

    # Then the column was added in place, the job kept, and jobs run on the upgraded table
    assert (migrated.existed, migrated.before) == (True, None)
    assert migrated.after == celery_leases.db.migrations.head()
    store = store_for(settings_for(legacy_app))
    with store.engine.connect() as connection:
        names = {c["name"] for c in sa.inspect(connection).get_columns(table)}
    assert "session" in names
    kept = get_job(legacy_app, "before-upgrade")
    assert kept is not None and (kept.state, kept.args) == ("queued", [3])
    assert legacy_app.tasks["tests.count_to"].apply(args=(3,), task_id="after-upgrade").get() == 3
    job = get_job(legacy_app, "after-upgrade")
    assert job is not None and (job.state, job.result, job.checkpoint) == ("done", 3, 3)


def test_a_table_from_schema_3_is_brought_under_the_migrations_and_gains_lease_keys(
    legacy_app: Celery,
) -> None:
    make_legacy_table(legacy_app, schema=3, job_id="kept")
    store = store_for(settings_for(legacy_app))
    with store.engine.connect() as connection:
        before = sa.inspect(connection).get_columns(legacy_app.conf.leases_table)

    migrated = celery_leases.migrate(legacy_app)

    head = celery_leases.db.migrations.head()
    assert f"brought under migrations (revision {head}), jobs kept" in migrated.describe()
    with store.engine.connect() as connection:
        after = sa.inspect(connection).get_columns(legacy_app.conf.leases_table)
    names = [c["name"] for c in after]
    assert names[: len(before)] == [c["name"] for c in before]
    assert {"lease_key", "followup", "followup_id"} <= set(names[len(before) :])
    job = get_job(legacy_app, "kept")
    assert job is not None and job.state == "queued"


# -- security -----------------------------------------------------------------------------------


class FileCreator:
    """Unpickling this creates ``path``: a canary for anything that unpickles."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def pickle_text(path: Path) -> str:
    return pickle.dumps(FileCreator(path), protocol=0).decode("ascii")


def test_the_pickle_canary_works(tmp_path: Path) -> None:
    canary = tmp_path / "canary"

    pickle.loads(pickle_text(canary).encode()).close()

    assert canary.exists()


def test_a_pickle_written_into_the_table_is_never_unpickled(
    app: Celery, store: Store, tmp_path: Path
) -> None:
    # Given a job whose JSON columns someone overwrote with a pickle
    marker = tmp_path / "unpickled"
    payload = pickle_text(marker)
    task(app, "tests.count_to").apply_async((1,), task_id="job-1")
    write_raw(store, "job-1", checkpoint=payload, message=payload, result=payload)

    # When it is read and claimed, it is refused as not JSON
    with pytest.raises(CorruptJob, match="not JSON"):
        get_job(app, "job-1")
    result = task(app, "tests.count_to").apply(args=(1,), task_id="job-1")
    assert isinstance(result.result, CorruptJob)
    with store.engine.connect() as connection:
        state = connection.execute(
            sa.select(store.table.c.state).where(store.table.c.id == "job-1")
        ).scalar_one()
    assert state == "failed"  # given up for good, not redelivered forever

    # Then nothing unpickled it, and no module of the library can
    assert not marker.exists()
    package = Path(celery_leases.__file__).parent
    assert [p.name for p in package.glob("*.py") if "pickle" in p.read_text()] == []


def test_ids_and_task_names_containing_sql_are_stored_and_read_back_harmlessly(
    app: Celery, store: Store, table_name: str
) -> None:
    hostile = SQL.format(table=table_name)

    result = task(app, hostile).apply(task_id=hostile)

    assert result.get() == "ok"
    job = get_job(app, hostile)
    assert job is not None
    assert (job.id, job.task, job.state, job.checkpoint) == (hostile, hostile, "done", SQL)
    assert [job.id for job in store.list_jobs(task=hostile)] == [hostile]


@pytest.fixture
def unreachable_app() -> Iterator[Celery]:
    app = Celery("unreachable", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        leases_database_url="postgresql+psycopg://postgres:secret-pw@127.0.0.1:1/test",
        leases_table="leases_unreachable",
        leases_engine_options={"connect_args": {"connect_timeout": 3}},
    )
    define_tasks(app)
    yield app
    store_for(settings_for(app)).engine.dispose()
    app.close()


def assert_hides_the_password(error: BaseException) -> None:
    assert "postgresql+psycopg://postgres:***@127.0.0.1:1/test" in str(error)
    assert "secret-pw" not in "".join(traceback.format_exception(error))


def test_an_unreachable_database_raises_store_unavailable_without_revealing_the_password(
    unreachable_app: Celery,
) -> None:
    with pytest.raises(StoreUnavailable) as raised:
        get_job(unreachable_app, "job-1")
    assert_hides_the_password(raised.value)

    with pytest.raises(StoreUnavailable) as raised:
        task(unreachable_app, "tests.count_to").delay(1)
    assert_hides_the_password(raised.value)


@pytest.mark.parametrize("always_eager", [False, True])
def test_an_in_process_run_with_the_database_down_fails_instead_of_being_delivered_again(
    unreachable_app: Celery, published: list[str], always_eager: bool
) -> None:
    unreachable_app.conf.task_always_eager = always_eager

    result = task(unreachable_app, "tests.count_to").apply(args=(1,), task_id="job-1")

    assert result.state == "FAILURE"
    assert isinstance(result.result, StoreUnavailable)
    assert_hides_the_password(result.result)
    assert published == []
