"""The start check's findings, without a worker: where the leases live and what is shared."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_leases import migrate
from celery_leases.config import settings_for
from celery_leases.db.store import store_for
from celery_leases.worker.startup import check, where
from tests.support.message import job_message


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("startup", broker="memory://", set_as_current=False)
    app.conf.leases_database_url = f"sqlite:///{tmp_path}/shared.sqlite3"
    yield app
    store_for(settings_for(app)).engine.dispose()


def test_running_jobs_held_on_other_hosts_make_the_sqlite_file_a_warning(app: Celery) -> None:
    migrate(app)
    store = store_for(settings_for(app))
    here = socket.gethostname()
    for n, owner in enumerate([f"w1@{here}/10", "w2@build-7.example.org/11", "ci-3/12"]):
        store.claim(job_message(f"job-{n}", "tests.x", recorded=False), owner=owner, duration=60)

    warnings = check(app, who="worker w0")

    assert len(warnings) == 1
    assert "used by workers on other hosts too (build-7, ci-3)" in warnings[0]


def test_an_sqlite_file_of_this_host_only_gives_no_warning(app: Celery) -> None:
    migrate(app)
    store = store_for(settings_for(app))
    owner = f"w1@{socket.gethostname()}/10"
    store.claim(job_message("job-here", "tests.x", recorded=False), owner=owner, duration=60)

    assert check(app, who="worker w0") == []


def test_a_relative_sqlite_path_is_shown_as_the_absolute_file_it_opens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    app = Celery("relative", set_as_current=False)

    assert where(settings_for(app)) == (
        f"the SQLite file {os.path.join(tmp_path, 'celery_leases.sqlite3')}, "
        f"table celery_leases_jobs"
    )


def test_a_server_url_is_shown_without_its_password() -> None:
    app = Celery("server", set_as_current=False)
    app.conf.leases_database_url = "postgresql+psycopg://app:s3cret@db.internal/app"

    assert where(settings_for(app)) == (
        "postgresql+psycopg://app:***@db.internal/app, table celery_leases_jobs"
    )


def test_a_missing_table_is_said_at_start_with_the_command_that_makes_it(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="celery_leases"):
        warnings = check(app, who="worker w0")

    assert "leases live in" in caplog.text  # the database answers: where is said first
    assert len(warnings) == 1 and "no leases table" in warnings[0]
    assert "celery -A proj leases init-db" in warnings[0]
    migrate(app)
    assert check(app, who="worker w0") == []
