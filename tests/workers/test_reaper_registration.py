"""``celery_leases.reap`` exists only in apps that use celery-leases."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery, Task, current_app

from celery_leases import LeasedTask, migrate, schedule_reaper
from celery_leases.config import settings_for
from celery_leases.db.store import store_for
from celery_leases.reaper import REAP_TASK, reap_task


@pytest.fixture
def database(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path}/leases.sqlite3"
    yield url
    app = Celery("dispose", set_as_current=False)
    app.conf.leases_database_url = url
    store_for(settings_for(app)).engine.dispose()


def new_app(name: str, **options: object) -> Celery:
    return Celery(name, broker="memory://", set_as_current=False, **options)


def in_fresh_process(code: str) -> str:
    """Run ``code`` in a new interpreter: Celery's shared tasks (``@app.task`` defaults to
    shared=True) registered by other tests of this process would reach every new app."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout.strip()


def test_an_app_that_does_not_use_celery_leases_has_no_reaper_task() -> None:
    printed = in_fresh_process(
        """
        import celery_leases  # as every `celery` command does (its CLI plugin)
        from celery import Celery

        plain = Celery("plain", broker="memory://", set_as_current=False)

        @plain.task(name="plain.noop")
        def noop():
            return None

        print("celery_leases.reap" in plain.tasks)
        """
    )

    assert printed == "False"


def test_binding_a_leased_task_registers_the_reaper_in_that_app_only() -> None:
    printed = in_fresh_process(
        """
        from celery import Celery
        from celery_leases import LeasedTask

        leased = Celery("leased", broker="memory://", set_as_current=False)
        other = Celery("other", broker="memory://", set_as_current=False)

        @leased.task(base=LeasedTask, name="leased.noop", shared=False)
        def noop():
            return None

        print("celery_leases.reap" in leased.tasks, "celery_leases.reap" in other.tasks)
        """
    )

    assert printed == "True False"


def test_schedule_reaper_registers_the_task_and_adds_the_beat_entry() -> None:
    app = new_app("beat_only")

    schedule_reaper(app, every=5.0, queue="reaper")

    assert REAP_TASK in app.tasks
    entry = app.conf.beat_schedule[REAP_TASK]
    assert (entry["schedule"], entry["task"]) == (5.0, REAP_TASK)
    assert entry["options"] == {"expires": 10.0, "queue": "reaper"}


def test_the_reaper_is_a_plain_task_even_when_leased_task_is_the_apps_task_class() -> None:
    app = new_app("leased_default", task_cls=LeasedTask)

    @app.task(bind=True, shared=False, name="tests.default_leased")
    def job(self: Task) -> None:
        return None

    reaper = app.tasks[REAP_TASK]
    assert isinstance(app.tasks["tests.default_leased"], LeasedTask)
    assert not isinstance(reaper, LeasedTask)


def test_the_registered_reaper_runs_one_pass(database: str) -> None:
    app = new_app("runs")
    app.conf.leases_database_url = database
    migrate(app)
    schedule_reaper(app)

    report = app.tasks[REAP_TASK].apply().get()

    assert report == {
        "orphaned": [],
        "republished": [],
        "gave_up": [],
        "publish_failed": [],
        "expired": [],
        "returned": [],
        "notified": [],
        "followups": [],
        "admitted": [],
        "purged": 0,
    }


def test_reap_task_is_the_current_apps_reaper(database: str) -> None:
    app = new_app("current")
    app.conf.leases_database_url = database
    before = current_app._get_current_object()
    app.set_current()
    try:
        assert reap_task.name == REAP_TASK
        assert reap_task.app is app
    finally:
        before.set_current()
