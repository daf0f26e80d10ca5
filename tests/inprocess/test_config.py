"""Settings validation: every mistake gets a clear ConfigurationError."""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_leases import ConfigurationError, LeasedTask
from celery_leases.config import settings_for
from celery_leases.db.store import Store
from celery_leases.reaper import reaper_scheduled, schedule_reaper
from celery_leases.settings import DEFAULTS, Settings, markdown_table, problems, validate


def settings(**overrides: Any) -> Settings:
    return validate(DEFAULTS | overrides)


def test_the_defaults_are_valid_and_the_renew_interval_is_a_third_of_the_duration() -> None:
    defaults = settings()

    assert (defaults.duration, defaults.renew_interval) == (30.0, 10.0)
    assert defaults.reap_grace == 30.0
    assert defaults.max_attempts is None


def test_a_celery_apps_leases_settings_are_read_without_their_prefix() -> None:
    app = Celery("config_tests", set_as_current=False)
    app.conf.update(leases_duration=12, leases_table="my_jobs", leases_max_attempts=5)

    read = settings_for(app)

    assert (read.duration, read.renew_interval, read.table, read.max_attempts) == (
        12.0,
        4.0,
        "my_jobs",
        5,
    )


@pytest.mark.parametrize(("renew", "duration"), [(30, 30), (45, 30), (10.5, 10)])
def test_a_renew_interval_not_shorter_than_the_duration_is_refused_naming_both(
    renew: float, duration: float
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        settings(duration=duration, renew_interval=renew)

    message = str(raised.value)
    assert f"leases_renew_interval ({renew:g} s)" in message
    assert f"leases_duration ({duration:g} s)" in message


@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, math.nan, math.inf])
@pytest.mark.parametrize("name", ["duration", "renew_interval", "retention", "reap_grace"])
def test_a_duration_that_is_not_a_positive_finite_number_is_refused(
    name: str, value: float
) -> None:
    with pytest.raises(ConfigurationError, match=rf"^leases_{name} must be a positive number"):
        settings(**{name: value})


@pytest.mark.parametrize("value", ["30", b"30", True, False, [30], {"s": 30}])
def test_a_duration_of_the_wrong_type_is_refused(value: Any) -> None:
    with pytest.raises(ConfigurationError) as raised:
        settings(duration=value)

    assert str(raised.value) == f"leases_duration must be a number of seconds, not {value!r}"


@pytest.mark.parametrize("value", [0, -3, 2.5, "10", True, None])
def test_a_count_that_is_not_a_positive_integer_is_refused(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^leases_reap_batch must be a positive integer"):
        settings(reap_batch=value)


def test_optional_counts_accept_none_and_refuse_zero() -> None:
    assert settings(max_attempts=None, max_attempts_without_progress=None).max_attempts is None

    with pytest.raises(ConfigurationError, match="leases_max_attempts must be a positive integer"):
        settings(max_attempts=0)


@pytest.mark.parametrize(
    "table",
    ["jobs; DROP TABLE x", "1abc", "", "jobs-2", 'jobs"', "sch.jobs", "a" * 49, None, 7],
)
def test_a_table_name_that_is_not_a_plain_identifier_is_refused(table: Any) -> None:
    with pytest.raises(ConfigurationError) as raised:
        settings(table=table)

    assert str(raised.value) == (
        f"leases_table must be a plain SQL identifier (letters, digits, _), not {table!r}"
    )


@pytest.mark.parametrize("table", ["jobs", "_jobs", "Jobs_2", "a" * 48])
def test_a_plain_identifier_is_a_valid_table_name(table: str) -> None:
    assert settings(table=table).table == table


@pytest.mark.parametrize(
    "url", ["celery_leases.sqlite3", "", None, 5, "://nothing", "postgresql://h:port/db"]
)
def test_a_database_url_that_is_not_an_sqlalchemy_url_is_refused(url: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^leases_database_url must be an SQLAlchemy URL"):
        settings(database_url=url)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:secret-pw@h:port/db", "postgresql://u:***@h:port/db"),
        ("post gres://u:secret/pw@h/db", "post gres://u:***@h/db"),
    ],
)
def test_a_refused_database_url_is_shown_without_its_password(url: str, shown: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        settings(database_url=url)

    assert str(raised.value).endswith(f"not {shown!r}")
    assert "secret" not in str(raised.value)


def test_a_database_url_of_an_unknown_dialect_is_refused_when_first_used() -> None:
    store = Store(settings(database_url="nosuchdb://host/db"))

    with pytest.raises(ConfigurationError, match=r"cannot use leases database nosuchdb://host/db"):
        store.now()


def test_engine_options_must_be_a_dict_and_preempt_on_shutdown_a_bool() -> None:
    with pytest.raises(ConfigurationError, match="leases_engine_options must be a dict"):
        settings(engine_options=[("pool_size", 1)])
    with pytest.raises(ConfigurationError, match="leases_preempt_on_shutdown must be True or"):
        settings(preempt_on_shutdown="yes")


class LongTask(LeasedTask):
    name = "tests.long"
    lease_duration = 120


class TightTask(LeasedTask):
    name = "tests.tight"
    lease_duration = 10
    lease_renew_interval = 20


class PlainTask(LeasedTask):
    name = "tests.plain"


def test_a_task_with_its_own_lease_duration_gets_a_third_of_it_as_renew_interval() -> None:
    task_settings = settings().with_task_options(LongTask)

    assert (task_settings.duration, task_settings.renew_interval) == (120.0, 40.0)


def test_a_task_without_lease_options_uses_the_app_settings_unchanged() -> None:
    base = settings(duration=12)

    assert base.with_task_options(PlainTask) is base


def test_a_tasks_invalid_lease_options_are_refused_naming_the_task() -> None:
    with pytest.raises(ConfigurationError) as raised:
        settings().with_task_options(TightTask)

    message = str(raised.value)
    assert message.startswith("task 'tests.tight': leases_renew_interval (20 s)")
    assert "leases_duration (10 s)" in message


def test_the_docs_table_lists_every_setting_as_it_is_declared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    page = (docs / "configuration.md").read_text()
    monkeypatch.setattr("sys.path", list(sys.path))  # conf.py adds docs/_ext to it
    conf = runpy.run_path(str(docs / "conf.py"))

    # The page shows the table Sphinx renders from the declaration at each build.
    assert "{{ settings_table }}" in page
    assert conf["myst_substitutions"]["settings_table"] == markdown_table()


def test_problems_lists_every_impossible_setting_under_the_name_the_user_wrote() -> None:
    def django(name: str) -> str:
        return f"CELERY_LEASES_{name.upper()}"

    raw = DEFAULTS | {"duration": -1, "table": "no-dashes"}

    found = problems(raw, spell=django)
    between = problems(DEFAULTS | {"duration": 30, "renew_interval": 60}, spell=django)

    assert found == [
        "CELERY_LEASES_TABLE must be a plain SQL identifier (letters, digits, _), not 'no-dashes'",
        "CELERY_LEASES_DURATION must be a positive number, not -1",
    ]
    assert between == [
        "CELERY_LEASES_RENEW_INTERVAL (60 s) must be shorter than CELERY_LEASES_DURATION "
        "(30 s), or every lease expires before it is renewed"
    ]
    assert problems(DEFAULTS) == []
    with pytest.raises(ConfigurationError, match=r"^CELERY_LEASES_DURATION must be a positive"):
        validate(raw | {"table": "jobs"}, spell=django)


def test_reaper_scheduled_says_whether_beat_schedule_runs_the_reaper() -> None:
    app = Celery("reaper_scheduled", set_as_current=False)
    app.conf.beat_schedule = {"other": {"task": "billing.invoice", "schedule": 60}}
    assert not reaper_scheduled(app)

    schedule_reaper(app, every=10.0)

    assert reaper_scheduled(app)
    assert "other" in app.conf.beat_schedule
