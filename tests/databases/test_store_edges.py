"""Store edges against real databases (SQLite, PostgreSQL, MariaDB): a finish or a fail retried
after a commit whose reply was lost, and job ids the table cannot hold whole."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, Task

from celery_leases import ArgumentsError, LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.dbapi import KEPT_ROWS, KEPT_TEXT
from celery_leases.db.rows import Claimed
from celery_leases.db.schema import MAX_ID_LENGTH
from celery_leases.db.store import Store, store_for
from celery_leases.settings import DEFAULTS, validate
from tests.support.message import job_message
from tests.support.scenario import close_app

OWNER = "worker-a/1"
TOO_LONG = "L" * (MAX_ID_LENGTH + 1)
LONGEST = "K" * MAX_ID_LENGTH


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


def claimed(store: Store, job_id: str) -> int:
    """Register and claim ``job_id``; the token of the claim."""
    sent = job_message(job_id)
    assert store.register(sent).outcome == "new"
    outcome = store.claim(sent, owner=OWNER, duration=30.0)
    assert isinstance(outcome, Claimed), outcome
    return outcome.token


# -- 9. an ambiguous commit -----------------------------------------------------------------------


def test_a_finish_retried_with_its_token_after_a_lost_reply_is_true_and_the_job_stays_done(
    store: Store,
) -> None:
    # Given a running job whose finish committed, and whose reply was lost
    token = claimed(store, "j1")
    assert store.finish("j1", token, result='{"n": 1}') is True

    # When the attempt retries the finish with the same token
    again = store.finish("j1", token, result='{"n": 1}')

    # Then the retry reports success, and the job is done with its result
    assert again is True
    job = store.get("j1")
    assert job is not None
    assert (job.state, job.result, job.token, job.owner) == ("done", {"n": 1}, token, None)


def test_a_finish_with_another_token_than_the_one_that_ended_the_job_is_refused(
    store: Store,
) -> None:
    # Given a job done under token 1
    token = claimed(store, "j1")
    assert store.finish("j1", token, result='{"n": 1}') is True

    # When finishes carrying other tokens come (a stale attempt, a newer one)
    stale, newer = (
        store.finish("j1", token - 1, result='{"n": 0}'),
        store.finish("j1", token + 1, result='{"n": 2}'),
    )

    # Then both are refused and the result stands
    assert (stale, newer) == (False, False)
    job = store.get("j1")
    assert job is not None
    assert (job.state, job.result) == ("done", {"n": 1})


def test_a_fail_retried_with_its_token_after_a_lost_reply_is_true_and_the_job_stays_failed(
    store: Store,
) -> None:
    # Given a running job whose fail committed, and whose reply was lost
    token = claimed(store, "j1")
    assert store.fail("j1", token, error="RuntimeError: boom") is True

    # When the attempt retries the fail with the same token
    again = store.fail("j1", token, error="RuntimeError: boom")

    # Then the retry reports success, and the job is failed with its error
    assert again is True
    job = store.get("j1")
    assert job is not None
    assert (job.state, job.error, job.owner) == ("failed", "RuntimeError: boom", None)


def test_a_fail_with_another_token_than_the_one_that_ended_the_job_is_refused(
    store: Store,
) -> None:
    # Given a job failed under token 1
    token = claimed(store, "j1")
    assert store.fail("j1", token, error="RuntimeError: boom") is True

    # When fails carrying other tokens come
    stale, newer = (
        store.fail("j1", token - 1, error="RuntimeError: stale"),
        store.fail("j1", token + 1, error="RuntimeError: newer"),
    )

    # Then both are refused and the error stands
    assert (stale, newer) == (False, False)
    job = store.get("j1")
    assert job is not None
    assert (job.state, job.error) == ("failed", "RuntimeError: boom")


def test_a_retried_finish_or_fail_never_turns_an_ended_job_into_the_other_outcome(
    store: Store,
) -> None:
    # Given one job done and one job failed, each under its token
    done_token, failed_token = claimed(store, "done"), claimed(store, "failed")
    assert store.finish("done", done_token, result="1") is True
    assert store.fail("failed", failed_token, error="RuntimeError: boom") is True

    # When the opposite outcome comes with the same token
    flipped = (
        store.fail("done", done_token, error="RuntimeError: late"),
        store.finish("failed", failed_token, result="2"),
    )

    # Then it is refused: an ended job keeps the outcome it was ended with
    assert flipped == (False, False)
    done, failed = store.get("done"), store.get("failed")
    assert done is not None and (done.state, done.result) == ("done", 1)
    assert failed is not None and (failed.state, failed.result) == ("failed", None)


# -- 10. ids the table cannot hold whole ------------------------------------------------------


def test_an_id_one_character_too_long_is_refused_at_register_and_claim_naming_the_limit(
    store: Store,
) -> None:
    # Given an id of 156 characters, one more than the table holds
    assert len(TOO_LONG) == 156

    # When a client registers it, and a worker claims a message sent by name with it
    with pytest.raises(ArgumentsError) as at_register:
        store.register(job_message(TOO_LONG))
    with pytest.raises(ArgumentsError) as at_claim:
        store.claim(job_message(TOO_LONG, recorded=False), owner=OWNER, duration=30.0)

    # Then both are refused naming the limit, and no row (whole or truncated) was written
    for raised in (at_register, at_claim):
        assert "1 to 155 characters" in str(raised.value), raised.value
    assert store.get(TOO_LONG) is None
    assert store.ids_starting_with("LLLL", limit=5) == []


def test_an_id_of_155_characters_is_registered_claimed_and_ended_whole(store: Store) -> None:
    # Given ids of 155 characters: one recorded by a client, one sent by name
    sent_by_name = "N" * MAX_ID_LENGTH

    # When each is claimed and finished
    token = claimed(store, LONGEST)
    assert store.finish(LONGEST, token, result="1") is True
    outcome = store.claim(job_message(sent_by_name, recorded=False), owner=OWNER, duration=30.0)
    assert isinstance(outcome, Claimed) and outcome.created, outcome
    assert store.finish(sent_by_name, outcome.token, result="2") is True

    # Then each row holds its whole id
    for job_id in (LONGEST, sent_by_name):
        job = store.get(job_id)
        assert job is not None and (len(job.id), job.state) == (155, "done"), job
        assert store.ids_starting_with(job_id[:4], limit=5) == [job_id]


def test_apply_async_with_an_id_too_long_publishes_nothing_and_records_nothing(
    database_url: str, table_name: str, filesystem_broker: dict[str, Any], queue_name: str
) -> None:
    # Given a client of a leased task on the embedded broker, and an empty queue
    app = Celery("edges", set_as_current=False)
    app.conf.update(
        filesystem_broker,
        task_default_queue=queue_name,
        leases_database_url=database_url,
        leases_table=table_name,
    )

    @app.task(base=LeasedTask, bind=True, shared=False, name="edges.job")
    def edges_job(self: Task) -> None:
        return None

    store = store_for(settings_for(app))
    try:
        # When it sends the task with an id of 156 characters
        with pytest.raises(ArgumentsError) as raised:
            edges_job.apply_async(task_id=TOO_LONG)

        # Then apply_async refuses it naming the limit, before anything is published or recorded
        assert "1 to 155 characters" in str(raised.value), raised.value
        assert queued(app, queue_name) == 0
        assert store.get(TOO_LONG) is None
        assert store.ids_starting_with("LLLL", limit=5) == []

        # and an id of 155 characters is recorded whole and published once
        assert edges_job.apply_async(task_id=LONGEST).id == LONGEST
        assert queued(app, queue_name) == 1
        job = store.get(LONGEST)
        assert job is not None and (job.id, job.state) == (LONGEST, "queued"), job
    finally:
        close_app(app)
        store.engine.dispose()


def queued(app: Celery, queue: str) -> int:
    """Messages waiting in ``queue`` of the embedded broker."""
    with app.connection_for_write() as connection:
        return int(connection.default_channel._size(queue))


# -- 10. the direct connection's cursor ----------------------------------------------------------


class CountedCursors:
    """A DBAPI connection that counts the cursors made of it."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.made = 0

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        self.made += 1
        return self.connection.cursor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connection, name)


def test_the_direct_connections_cursor_serves_the_next_statement_unless_it_failed_or_held_much(
    store: Store,
) -> None:
    # Given the store's direct connection after a claim, cursors of it counted
    token = claimed(store, "j1")
    (direct,) = store.db.direct._idle
    counted = direct._dbapi_connection = CountedCursors(direct._dbapi_connection)

    # When checkpoints and reads follow, they all run on one cursor
    for n in range(3):
        assert store.checkpoint("j1", token, f'{{"n": {n}}}') == (True, None)
        job = store.get("j1")
        assert job is not None and job.checkpoint == {"n": n}
    assert counted.made == 1

    # Then a statement the database refuses drops it; the next statement runs on a new one
    with pytest.raises(sa.exc.DBAPIError):
        direct.query("SELECT no_such_column FROM no_such_table")
    assert direct._kept is None
    assert store.checkpoint("j1", token, '{"n": 3}') == (True, None)
    assert counted.made == 2 and direct._kept is not None

    # and so does a statement that leaves more than KEPT_ROWS rows, or more than KEPT_TEXT of
    # text, on it (a kept cursor holds them until the next statement)
    for n in range(KEPT_ROWS - 1):
        assert store.register(job_message(f"many-{n}")).outcome == "new"
    ids = sa.select(store.table.c.id)
    assert len(direct.execute(ids).rows) == KEPT_ROWS
    assert direct._kept is not None and counted.made == 2
    assert store.register(job_message("many-last")).outcome == "new"
    assert len(direct.execute(ids).rows) == KEPT_ROWS + 1
    assert direct._kept is None and counted.made == 2
    big = '{"text": "%s"}' % ("x" * KEPT_TEXT)
    assert store.checkpoint("j1", token, big) == (True, None)
    assert direct._kept is None and counted.made == 3
    assert store.checkpoint("j1", token, '{"n": 4}') == (True, None)
    assert direct._kept is not None and counted.made == 4
    job = store.get("j1")
    assert job is not None and job.checkpoint == {"n": 4}
