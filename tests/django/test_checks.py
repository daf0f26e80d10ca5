"""Django's system checks of celery-leases (``manage.py check``), run in the example project:
each check fires for its bad setting, naming it as the project wrote it, and none fires for
the project as it is. The database check (``check --database``) runs on SQLite, PostgreSQL and
MariaDB."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from celery_leases.db import migrations
from tests.django.conftest import TABLE, Shop, sqlite_shop

#: The project's settings with SHOP_EXTRA_SETTINGS (JSON) added.
EXTRA_SETTINGS = "tests.django.extra_settings"
_ID = re.compile(r"\((celery_leases\.[EW]\d{3})\) ")


def check(
    shop: Shop, *args: str, settings: dict[str, Any] | None = None, **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, list[str]]]:
    """``manage.py check args`` with the Django ``settings`` added; the run and each
    celery-leases message found, by id (its message and hint lines)."""
    done = shop.try_manage(
        "check",
        *args,
        DJANGO_SETTINGS_MODULE=EXTRA_SETTINGS,
        SHOP_EXTRA_SETTINGS=json.dumps(settings or {}),
        **env,
    )
    found: dict[str, list[str]] = {}
    lines = done.stderr.splitlines()
    for number, line in enumerate(lines):
        if match := _ID.search(line):
            hint = lines[number + 1] if number + 1 < len(lines) else ""
            found.setdefault(match[1], []).append(f"{line}\n{hint}")
    return done, found


def test_the_example_project_passes_every_check(tmp_path: Path) -> None:
    done, found = check(sqlite_shop(tmp_path))

    assert found == {}, done.stderr
    assert (done.returncode, done.stdout.strip()) == (
        0,
        "System check identified no issues (0 silenced).",
    )


def test_the_apps_migrations_match_its_models(tmp_path: Path) -> None:
    # A model change shipped without its migration makes every project's makemigrations
    # --check fail, and makemigrations write one into site-packages (for an unmanaged model,
    # Django compares its options, not its fields)
    done = sqlite_shop(tmp_path).try_manage(
        "makemigrations", "--check", "--dry-run", "celery_leases"
    )

    assert (done.returncode, done.stdout.strip()) == (
        0,
        "No changes detected in app 'celery_leases'",
    )


def test_a_misspelt_setting_fails_check_and_migrate_with_the_setting_it_meant(
    tmp_path: Path,
) -> None:
    # Given CELERY_LEASES_DURATON = 30 (today it surfaces at the first .delay())
    shop = sqlite_shop(tmp_path)
    typo = {"CELERY_LEASES_DURATON": 30}

    # When the project is checked, and migrated
    done, found = check(shop, settings=typo)
    migrate = shop.try_manage(
        "migrate",
        DJANGO_SETTINGS_MODULE=EXTRA_SETTINGS,
        SHOP_EXTRA_SETTINGS=json.dumps(typo),
    )

    # Then both stop, naming the setting and the one it meant
    assert done.returncode == 1
    assert list(found) == ["celery_leases.E001"], done.stderr
    assert (
        "unknown setting CELERY_LEASES_DURATON (did you mean CELERY_LEASES_DURATION?)"
        in found["celery_leases.E001"][0]
    )
    assert migrate.returncode == 1
    assert "(celery_leases.E001) unknown setting CELERY_LEASES_DURATON" in migrate.stderr


def test_a_setting_spelled_without_the_celery_namespace_is_reported(tmp_path: Path) -> None:
    done, found = check(sqlite_shop(tmp_path), settings={"LEASES_TABLE": "jobs"})

    assert list(found) == ["celery_leases.E001"], done.stderr
    assert "setting LEASES_TABLE is never read" in found["celery_leases.E001"][0]
    assert "CELERY_LEASES_TABLE" in found["celery_leases.E001"][0]


def test_impossible_values_are_reported_each_under_the_name_the_project_gave_it(
    tmp_path: Path,
) -> None:
    done, found = check(
        sqlite_shop(tmp_path),
        settings={"CELERY_LEASES_DURATION": -1, "CELERY_LEASES_TABLE": "no-dashes"},
    )

    assert done.returncode == 1
    assert list(found) == ["celery_leases.E002"], done.stderr
    messages = "\n".join(found["celery_leases.E002"])
    assert "CELERY_LEASES_DURATION must be a positive number, not -1" in messages
    assert "CELERY_LEASES_TABLE must be a plain SQL identifier" in messages
    assert "leases_duration" not in messages and "leases_table" not in messages


def test_a_renew_interval_not_shorter_than_the_duration_is_reported(tmp_path: Path) -> None:
    done, found = check(
        sqlite_shop(tmp_path),
        settings={"CELERY_LEASES_DURATION": 30, "CELERY_LEASES_RENEW_INTERVAL": 60},
    )

    assert list(found) == ["celery_leases.E002"], done.stderr
    assert (
        "CELERY_LEASES_RENEW_INTERVAL (60 s) must be shorter than CELERY_LEASES_DURATION (30 s)"
        in found["celery_leases.E002"][0]
    )


def test_a_database_alias_missing_from_databases_is_reported(tmp_path: Path) -> None:
    done, found = check(sqlite_shop(tmp_path), settings={"CELERY_LEASES_DATABASE_ALIAS": "leases"})

    assert done.returncode == 1
    assert list(found) == ["celery_leases.E003"], done.stderr
    assert (
        "CELERY_LEASES_DATABASE_ALIAS is 'leases', which is not in DATABASES (default)"
        in (found["celery_leases.E003"][0])
    )


def test_an_in_memory_sqlite_database_is_reported(tmp_path: Path) -> None:
    done, found = check(sqlite_shop(tmp_path, SHOP_DB_NAME=":memory:"))

    assert done.returncode == 1
    assert list(found) == ["celery_leases.E004"], done.stderr
    assert "in-memory SQLite database" in found["celery_leases.E004"][0]
    assert "HINT: give DATABASES['default'] a file" in found["celery_leases.E004"][0]


def test_the_test_runner_in_memory_sqlite_database_is_a_warning(tmp_path: Path) -> None:
    # Given the name Django's test runner gives an SQLite test database without TEST NAME
    memory = "file:memorydb_default?mode=memory&cache=shared"

    done, found = check(sqlite_shop(tmp_path, SHOP_DB_NAME=memory))

    assert done.returncode == 0
    assert list(found) == ["celery_leases.W002"], done.stderr
    assert "DATABASES['default']['TEST']['NAME']" in found["celery_leases.W002"][0]


def test_a_database_engine_celery_leases_cannot_use_is_reported(tmp_path: Path) -> None:
    engine = {"ENGINE": "django.db.backends.dummy", "NAME": "x"}

    done, found = check(sqlite_shop(tmp_path), settings={"DATABASES": {"default": engine}})

    assert list(found) == ["celery_leases.E005"], done.stderr
    assert (
        "uses django.db.backends.dummy, which celery-leases does not support"
        in (found["celery_leases.E005"][0])
    )


def test_a_celery_leases_app_setting_that_imports_nothing_is_reported(tmp_path: Path) -> None:
    shop = sqlite_shop(tmp_path)

    done, found = check(shop, settings={"CELERY_LEASES_APP": "shop.celery.nothing"})
    named, named_found = check(shop, settings={"CELERY_LEASES_APP": "shop.celery:app"})

    assert list(found) == ["celery_leases.E006"], done.stderr
    assert (
        "CELERY_LEASES_APP is 'shop.celery.nothing', which cannot be imported"
        in (found["celery_leases.E006"][0])
    )
    assert named_found == {}, named.stderr


def test_leased_tasks_without_the_reaper_in_beat_schedule_are_a_warning(tmp_path: Path) -> None:
    # Given the project's Celery app without schedule_reaper(), whose tasks module only
    # autodiscovery imports (with celery-leases' checks alone, no URL check imports the views)
    done, found = check(sqlite_shop(tmp_path, SHOP_REAPER_EVERY="0"), "--tag", "celery_leases")

    # Then a warning (check passes), whose hint says how, and that a schedule kept by
    # django-celery-beat's DatabaseScheduler is not read
    assert done.returncode == 0
    assert list(found) == ["celery_leases.W001"], done.stderr
    warning = found["celery_leases.W001"][0]
    assert "Celery app 'shop' has leased tasks, but its beat schedule does not run" in warning
    assert "schedule_reaper(app" in warning and "DatabaseScheduler" in warning


def test_a_leases_table_behind_the_migrations_is_a_database_warning_until_migrate(
    shop: Shop,
) -> None:
    # Given the app migrated back to its first migration: the table at the first revision
    first = migrations.revisions()[0]
    shop.manage("migrate", "celery_leases", "0001", "--verbosity", "0")
    try:
        # When the project is checked with and without its database, then migrated
        plain, plain_found = check(shop)
        behind, behind_found = check(shop, "--database", "default")
        shop.manage("migrate", "--verbosity", "0")
        after, after_found = check(shop, "--database", "default")
        # And when the table goes behind what Django records (a restored backup), then
        # the command the hint names runs
        migrations.downgrade(shop.store, revision=first)
        restored, restored_found = check(shop, "--database", "default")
        shop.manage("leases", "upgrade")
        fixed, fixed_found = check(shop, "--database", "default")
    finally:
        migrations.upgrade(shop.store)
        shop.manage("migrate", "--verbosity", "0")

    # Then only the database check sees it, says which revision, and migrate settles it
    assert plain_found == {}, plain.stderr
    assert list(behind_found) == ["celery_leases.W003"], behind.stderr
    assert (
        f"leases table '{TABLE}' in " in behind_found["celery_leases.W003"][0]
        and f"is at revision {first}, older than" in behind.stderr
    )
    assert "HINT: run manage.py migrate" in behind_found["celery_leases.W003"][0]
    assert after_found == {}, after.stderr
    # And a table behind Django's record is told apart: migrate has nothing to apply there
    assert list(restored_found) == ["celery_leases.W003"], restored.stderr
    assert "run manage.py leases upgrade" in restored_found["celery_leases.W003"][0]
    assert fixed_found == {}, fixed.stderr


def test_a_leases_url_of_no_django_database_is_a_warning_that_atomic_checkpoints_are_refused(
    tmp_path: Path,
) -> None:
    shop = sqlite_shop(tmp_path)
    own = shop.env["SHOP_DB_NAME"]

    elsewhere, found = check(
        shop, settings={"CELERY_LEASES_DATABASE_URL": f"sqlite:///{tmp_path}/leases.sqlite3"}
    )
    same, same_found = check(shop, settings={"CELERY_LEASES_DATABASE_URL": f"sqlite:///{own}"})
    heroku, heroku_found = check(
        shop, settings={"CELERY_LEASES_DATABASE_URL": "postgres://u@db.example/app"}
    )

    # Another database: a warning that says what is refused, why, and what to set
    assert list(found) == ["celery_leases.W004"], elsewhere.stderr
    (text,) = found["celery_leases.W004"]
    assert "names no database of DATABASES: a checkpoint (or save_cursor) inside" in text
    assert "CELERY_LEASES_DATABASE_ALIAS" in text and "refuses it" in text
    assert elsewhere.returncode == 0
    # The database of DATABASES['default'] by a URL of its own: checkpoints join, no message
    assert same_found == {}, same.stderr
    # postgres:// is SQLAlchemy's postgresql: an error saying so (not a restored backup)
    assert list(heroku_found) == ["celery_leases.E005"], heroku.stderr
    assert (
        "SQLAlchemy names PostgreSQL postgresql, not postgres"
        in heroku_found["celery_leases.E005"][0]
    )
    assert "restored" not in heroku.stderr
