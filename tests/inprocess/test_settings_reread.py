"""Settings are read again when the app's configuration changes, and only then."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_leases import LeasedTask, migrate
from celery_leases.config import reread_settings
from celery_leases.db import store


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("reread", broker="memory://", set_as_current=False)
    app.conf.leases_database_url = f"sqlite:///{tmp_path}/first.sqlite3"
    migrate(app)
    yield app
    for made in list(store._stores.values()):
        if str(tmp_path) in made.safe_url:
            made.engine.dispose()


def leased(app: Celery) -> LeasedTask:
    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.reread")
    def job(self: LeasedTask) -> str:
        self.checkpoint({"at": 1})
        return "ok"

    return job


def test_a_changed_database_url_is_used_by_the_next_run(app: Celery, tmp_path: Path) -> None:
    job = leased(app)
    job.apply(task_id="before")
    assert job.lease_store.get("before") is not None

    app.conf.leases_database_url = f"sqlite:///{tmp_path}/second.sqlite3"
    migrate(app)
    job.apply(task_id="after")

    assert job.lease_settings.database_url.endswith("second.sqlite3")
    assert job.lease_store.get("after") is not None
    assert job.lease_store.get("before") is None  # that job lives in the first file


def test_an_update_of_the_conf_is_seen_by_the_next_read(app: Celery) -> None:
    job = leased(app)
    assert job.lease_settings.duration == 30.0

    app.conf.update(leases_duration=6)

    assert (job.lease_settings.duration, job.lease_settings.renew_interval) == (6.0, 2.0)


def test_settings_are_not_validated_again_while_the_conf_is_unchanged(app: Celery) -> None:
    job = leased(app)
    first = job.lease_settings

    assert job.lease_settings is first
    assert job.lease_store is job.lease_store


def test_reread_settings_makes_a_change_inside_a_config_object_seen(app: Celery) -> None:
    class Config:
        leases_duration = 9

    app.config_from_object(Config)
    job = leased(app)
    assert job.lease_settings.duration == 9.0

    Config.leases_duration = 4  # as Django's override_settings does: not through app.conf
    assert job.lease_settings.duration == 9.0
    reread_settings(app)

    assert job.lease_settings.duration == 4.0


def test_a_setting_set_to_none_at_run_time_over_a_config_objects_value_is_seen(
    app: Celery,
) -> None:
    class Config:
        leases_max_attempts = 5

    app.config_from_object(Config)
    job = leased(app)
    assert job.lease_settings.max_attempts == 5

    app.conf.leases_max_attempts = None

    assert job.lease_settings.max_attempts is None
