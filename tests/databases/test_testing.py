"""celery_leases.testing catches a task that does not resume and passes one that does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_leases import LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.store import store_for
from celery_leases.testing import assert_resumable, run_with_crashes

stored: list[int] = []


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("testing_helper", broker="memory://", set_as_current=False)
    app.conf.leases_database_url = database_url
    app.conf.leases_table = table_name
    stored.clear()
    yield app
    store_for(settings_for(app)).engine.dispose()


def resumable(app: Celery) -> LeasedTask:
    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.resumable")
    def sync(self: LeasedTask, pages: int) -> int:
        page = (self.lease.checkpoint or {}).get("page", 0)
        while page < pages:
            stored.append(page)
            page += 1
            self.checkpoint({"page": page}, progress=(page, pages))
        return len(stored)

    return sync


def starts_over(app: Celery) -> LeasedTask:
    """Deliberately broken: checkpoints, but ignores the checkpoint when it runs again."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.starts_over")
    def sync(self: LeasedTask, pages: int) -> int:
        for page in range(pages):
            stored.append(page)
            self.checkpoint({"page": page + 1})
        return pages

    return sync


def test_a_task_that_resumes_from_its_checkpoint_passes(app: Celery) -> None:
    run = assert_resumable(resumable(app), [6], crash_after=[2, 1], reset=stored.clear)

    assert run.attempts == 3
    assert run.resumed_from == [None, {"page": 2}, {"page": 3}]
    assert stored == [0, 1, 2, 3, 4, 5]  # the crashed run stored every page once
    assert run.job is not None and (run.job.state, run.job.attempts) == ("done", 3)


def test_a_task_that_starts_over_after_a_crash_is_caught(app: Celery) -> None:
    with pytest.raises(AssertionError, match="does not resume from its checkpoint"):
        assert_resumable(starts_over(app), [6], crash_after=[3], reset=stored.clear)


def test_run_with_crashes_kills_each_attempt_after_the_planned_checkpoint(app: Celery) -> None:
    run = run_with_crashes(resumable(app), [5], crash_after=[1, 1, 1])

    assert run.attempts == 4
    assert run.checkpoints == [{"page": p} for p in range(1, 6)]
    assert run.result == 5


def keyed(app: Celery, broken: str | None = None) -> LeasedTask:
    """A sync of ``pages`` pages of one account from the key's cursor, checkpointing and
    saving the cursor after each page. Broken on purpose: ``"cursor"`` saves as its cursor the
    pages this attempt fetched, not where the sync got to; ``"end"`` counts its pages from the
    cursor each attempt starts from, so a resumed attempt, which finds the cursor moved, goes
    too far."""

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.keyed", lease_key="acct:{0}")
    def sync(self: LeasedTask, account: str, pages: int) -> int:
        state = self.lease.checkpoint or {}
        page = state.get("page", self.lease.cursor or 0)
        end = state.get("end", page + pages)
        if broken == "end":
            end = (self.lease.cursor or 0) + pages
        fetched = 0
        while page < end:
            stored.append(page)
            page += 1
            fetched += 1
            # The cursor first: a crash between the two writes must not lose it (or in one
            # transaction, with connection=)
            self.save_cursor(fetched if broken == "cursor" else page)
            self.checkpoint({"page": page, "end": end})
        return page

    return sync


def test_a_keyed_task_runs_both_times_from_the_keys_cursor_as_it_was(app: Celery) -> None:
    task = keyed(app)
    first = assert_resumable(task, ["a1", 4], crash_after=[1], reset=stored.clear)
    assert (first.result, task.lease_store.cursor("acct:a1")) == (4, 4)
    assert stored == [0, 1, 2, 3]

    # The next sync of the account starts where the last one ended, both runs alike
    second = assert_resumable(task, ["a1", 3], crash_after=[2, 1], reset=stored.clear)

    assert second.resumed_from == [None, {"page": 6, "end": 7}, {"page": 7, "end": 7}]
    assert (second.result, task.lease_store.cursor("acct:a1")) == (7, 7)
    assert stored == [4, 5, 6]


def test_a_keyed_task_that_leaves_another_cursor_after_a_crash_is_caught(app: Celery) -> None:
    task = keyed(app, broken="cursor")
    with pytest.raises(AssertionError, match="left the cursor of 'acct:a1' at 2 after crashes, 4"):
        assert_resumable(task, ["a1", 4], crash_after=[2], reset=stored.clear)


def test_a_keyed_task_that_counts_from_the_moved_cursor_after_a_crash_is_caught(
    app: Celery,
) -> None:
    task = keyed(app, broken="end")
    with pytest.raises(AssertionError, match="does not resume from its checkpoint"):
        assert_resumable(task, ["a1", 4], crash_after=[2], reset=stored.clear)


def test_a_reset_that_clears_the_keys_cursor_starts_both_runs_afresh(app: Celery) -> None:
    task = keyed(app)
    assert_resumable(task, ["a1", 4], crash_after=[1], reset=stored.clear)  # cursor now 4

    def reset() -> None:
        stored.clear()
        assert task.lease_store.set_cursor("acct:a1", None)

    run = assert_resumable(task, ["a1", 3], crash_after=[1], reset=reset)

    assert run.resumed_from == [None, {"page": 1, "end": 3}]
    assert (run.result, task.lease_store.cursor("acct:a1")) == (3, 3)
