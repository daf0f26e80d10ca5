"""A mistyped or unread ``leases_*`` key is refused, never left to fall back to its default."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from celery_leases import ConfigurationError, LeasedTask
from celery_leases.config import settings_for, unread_keys, unread_settings


def app_with(**settings: object) -> Celery:
    app = Celery("spelling", broker="memory://", set_as_current=False)
    app.conf.update(settings)
    return app


class DjangoSettings:
    """What ``config_from_object('django.conf:settings', namespace='CELERY')`` reads."""

    CELERY_BROKER_URL = "memory://"
    CELERY_LEASES_TABLE = "django_jobs"
    CELERY_LEASES_DATABSE_URL = "postgresql+psycopg://db/app"
    LEASES_DURATION = 12


def django_app() -> Celery:
    app = Celery("django_spelling", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    return app


def test_a_mistyped_setting_is_refused_naming_the_setting_it_resembles() -> None:
    app = app_with(leases_databse_url="postgresql+psycopg://db/app")

    with pytest.raises(ConfigurationError) as raised:
        settings_for(app)

    assert str(raised.value) == (
        "unknown setting leases_databse_url (did you mean leases_database_url?): "
        "celery-leases has no such setting"
    )


def test_a_mistyped_setting_never_creates_the_default_sqlite_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    app = app_with(leases_databse_url=f"sqlite:///{tmp_path}/meant.sqlite3")

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.spelled")
    def spelled(self: LeasedTask) -> None:
        return None

    with pytest.raises(ConfigurationError, match="leases_databse_url"):
        spelled.apply_async()

    assert list(tmp_path.iterdir()) == []


def test_an_unknown_setting_without_a_close_match_is_refused_too() -> None:
    problems = unread_settings(app_with(leases_frobnicate=1))

    assert problems == ["unknown setting leases_frobnicate: celery-leases has no such setting"]


def test_an_uppercase_setting_without_a_namespace_is_refused_as_never_read() -> None:
    app = app_with(LEASES_DATABASE_URL="postgresql+psycopg://db/app")

    with pytest.raises(ConfigurationError) as raised:
        settings_for(app)

    assert str(raised.value) == (
        "setting LEASES_DATABASE_URL is never read (without a namespace Celery reads "
        "leases_database_url)"
    )


def test_django_style_settings_are_read_under_the_celery_namespace_and_typos_refused() -> None:
    app = django_app()

    problems = unread_settings(app)

    assert problems == [
        "unknown setting CELERY_LEASES_DATABSE_URL (did you mean "
        "CELERY_LEASES_DATABASE_URL?): celery-leases has no such setting",
        "setting LEASES_DURATION is never read (with the namespace CELERY, Celery reads "
        "CELERY_LEASES_DURATION or leases_duration)",
    ]


def test_correct_django_style_settings_are_accepted_and_read() -> None:
    class Correct:
        CELERY_LEASES_TABLE = "django_jobs"
        CELERY_LEASES_DURATION = 12

    app = Celery("django_ok", set_as_current=False)
    app.config_from_object(Correct, namespace="CELERY")

    read = settings_for(app)

    assert (read.table, read.duration) == ("django_jobs", 12.0)


def test_settings_of_other_libraries_that_contain_leases_are_left_alone() -> None:
    assert unread_settings(app_with(myapp_leases_limit=3, leases_table="jobs")) == []


def test_a_mistyped_task_option_is_refused_when_the_task_is_made() -> None:
    app = app_with()

    with pytest.raises(ConfigurationError) as raised:

        @app.task(base=LeasedTask, bind=True, shared=False, name="tests.typo", lease_duraton=5)
        def typo(self: LeasedTask) -> None:
            return None

        app.finalize()

    assert str(raised.value).startswith(
        "task 'tests.typo': unknown task option lease_duraton (did you mean lease_duration?)"
    )


def test_keys_of_any_configuration_are_checked_as_celery_would_read_them() -> None:
    # Django's settings, as the system checks read them (no Celery app made)
    keys = ["CELERY_LEASES_DURATON", "CELERY_LEASES_TABLE", "LEASES_RETENTION", "DEBUG"]

    found = unread_keys(keys, prefix="CELERY_")

    assert found == [
        "unknown setting CELERY_LEASES_DURATON (did you mean CELERY_LEASES_DURATION?): "
        "celery-leases has no such setting",
        "setting LEASES_RETENTION is never read (with the namespace CELERY, Celery reads "
        "CELERY_LEASES_RETENTION or leases_retention)",
    ]
    assert (
        unread_keys(["CELERY_LEASES_DATABASE_ALIAS", "CELERY_LEASES_APP"], prefix="CELERY_") == []
    )
