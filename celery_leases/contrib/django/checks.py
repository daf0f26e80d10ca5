"""Django system checks (``manage.py check``; ``runserver`` and ``migrate`` run them too): a
celery-leases setting that would fail only at the first ``.delay()`` or worker start is
reported when the project starts, by the library's own rules (``config.unread_keys``,
``settings.problems``, ``Store.check_schema``). Errors ``celery_leases.E001``-``E006`` stop
``migrate`` and ``runserver``; warnings ``W001``-``W004`` do not. The docs' Django page has
the table of ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from django.core import checks

from ... import routes
from ...config import unread_keys, uses_leases
from ...db.dialects import dialect_for
from ...errors import ConfigurationError, LeaseError
from ...reaper import REAP_TASK, reaper_scheduled
from ...settings import DEFAULTS, problems
from . import database, project

TAG = "celery_leases"
_DOCS = "see the Configuration page of celery-leases' docs"
#: The name Django's test runner gives an in-memory SQLite test database.
_TEST_MEMORY_DB = "file:memorydb_"


def register() -> None:
    """Register the checks (the app's ``ready()``)."""
    checks.register(check_settings, TAG)
    checks.register(check_database, TAG)
    checks.register(check_reaper, TAG)
    checks.register(check_leases_table, TAG, checks.Tags.database)


def check_settings(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """E001: ``CELERY_LEASES_*`` settings Celery would refuse; E002: impossible values."""
    from django.conf import settings

    found: list[checks.CheckMessage] = [
        checks.Error(
            problem,
            hint=f"a setting leases_<name> is CELERY_LEASES_<NAME> in Django's settings; {_DOCS}",
            id="celery_leases.E001",
        )
        for problem in unread_keys([k for k in dir(settings) if k.isupper()], prefix="CELERY_")
    ]
    raw = database.raw_settings()
    # Where the leases live is E003-E005's: a URL that is fine stands in for the alias's.
    raw["database_url"] = (
        getattr(settings, database.django_key("database_url"), None) or (DEFAULTS["database_url"])
    )
    found += [
        checks.Error(
            problem, hint=f"{_DOCS} for each setting's meaning and unit", id="celery_leases.E002"
        )
        for problem in problems(raw, spell=database.django_key)
    ]
    return found


def check_database(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """E003: the leases' database alias is not in ``DATABASES``; E004: it is in-memory SQLite;
    E005: its engine is not supported; W002: the test runner made it in-memory SQLite."""
    from django.conf import settings

    try:
        alias = database.alias()
    except ConfigurationError as exc:
        return [
            checks.Error(
                str(exc),
                hint=f"name one of DATABASES in {database.ALIAS_SETTING} (default 'default')",
                id="celery_leases.E003",
            )
        ]
    url = getattr(settings, database.django_key("database_url"), None)
    if url:
        return _leases_url(str(url))  # the leases live at that URL
    config = settings.DATABASES[alias]
    if database.in_memory(config):
        return [_in_memory(alias, config)]
    try:
        database.url_for(alias)
    except ConfigurationError as exc:
        return [
            checks.Error(
                str(exc),
                hint="keep the leases in PostgreSQL, MariaDB/MySQL or SQLite",
                id="celery_leases.E005",
            )
        ]
    return []


def _leases_url(url: str) -> list[checks.CheckMessage]:
    """E005: ``CELERY_LEASES_DATABASE_URL`` names a database celery-leases cannot use; W004:
    it names no Django database (reached with Django's driver), so a checkpoint inside an
    ``atomic()`` block cannot commit with the block, and is refused."""
    name = database.django_key("database_url")
    try:
        dialect_for(sa.engine.make_url(url).get_backend_name())
    except (ValueError, sa.exc.ArgumentError) as exc:
        return [
            checks.Error(
                f"{name}: {exc}",
                hint="keep the leases in PostgreSQL, MariaDB/MySQL or SQLite",
                id="celery_leases.E005",
            )
        ]
    if database.joinable_alias(url) is not None:
        return []  # a Django database: checkpoints join its atomic() blocks
    same = database.alias_of(url)
    where = (
        f"names DATABASES[{same!r}] through another driver than Django's"
        if same is not None
        else "names no database of DATABASES"
    )
    return [
        checks.Warning(
            f"{name} {where}: a checkpoint (or save_cursor) inside transaction.atomic() "
            f"cannot commit with the block, so celery-leases refuses it (ConfigurationError) "
            f"rather than commit it apart, where a crash before the block's commit would lose "
            f"the block's work for good",
            hint=(
                "keep the leases in a DATABASES entry: unset it and set "
                f"{database.ALIAS_SETTING} (with a URL of its own, call self.checkpoint() "
                "after each atomic() block, and make the block's work idempotent: a crash "
                "then redoes it); silence this with SILENCED_SYSTEM_CHECKS = "
                "['celery_leases.W004'] if no task checkpoints inside atomic()"
            ),
            id="celery_leases.W004",
        )
    ]


def _in_memory(alias: str, config: dict[str, Any]) -> checks.CheckMessage:
    what = (
        f"the leases database {alias!r} is an in-memory SQLite database, which no second "
        f"connection sees: workers and web processes would not share the leases"
    )
    if str(config["NAME"]).startswith(_TEST_MEMORY_DB):
        return checks.Warning(
            f"{what} (the test runner's), so a leased task refuses to run in these tests",
            hint=f"give the test database a file: DATABASES[{alias!r}]['TEST']['NAME']",
            id="celery_leases.W002",
        )
    return checks.Error(
        what,
        hint=f"give DATABASES[{alias!r}] a file ('NAME': BASE_DIR / 'db.sqlite3'), or use "
        f"PostgreSQL or MariaDB",
        id="celery_leases.E004",
    )


def check_reaper(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """E006: ``CELERY_LEASES_APP`` is no Celery app; W001: the project's Celery app has leased
    tasks but its beat schedule does not run the reaper."""
    from django.conf import settings

    try:
        app = project.celery_app()
    except ConfigurationError as exc:
        return [
            checks.Error(
                str(exc),
                hint="give the dotted path of your Celery app, such as 'proj.celery.app'",
                id="celery_leases.E006",
            )
        ]
    if app is None:
        return []
    project.load_tasks(app)  # else the URL checks' imports decide what this one sees
    if not uses_leases(app) or reaper_scheduled(app):
        return []
    hint = (
        f"call celery_leases.schedule_reaper(app, every=10.0) in your celery module, and run "
        f"celery -A proj beat: without {REAP_TASK}, the job of a crashed worker waits for a "
        f"redelivery that may never come, and finished jobs are never deleted"
    )
    if "django_celery_beat" in settings.INSTALLED_APPS:
        hint += (
            f". With django-celery-beat's DatabaseScheduler the schedule is in the database, "
            f"which this check does not read: if a periodic task there runs {REAP_TASK}, "
            f"silence this with SILENCED_SYSTEM_CHECKS = ['celery_leases.W001']"
        )
    return [
        checks.Warning(
            f"Celery app {app.main or app!r} has leased tasks, but its beat schedule does not "
            f"run the reaper ({REAP_TASK})",
            hint=hint,
            id="celery_leases.W001",
        )
    ]


def check_leases_table(
    app_configs: Any = None, databases: Sequence[str] | None = None, **_: Any
) -> list[checks.CheckMessage]:
    """W003 (a database check: ``check --database``, ``migrate``): the leases table is
    missing, or not at the revision this celery-leases needs."""
    try:
        alias = database.alias()
        if not databases or alias not in databases or not _migrated(alias):
            return []
        store = database.store()
        store.dialect  # noqa: B018  (a URL celery-leases cannot use is E005's, not W003's)
    except ConfigurationError:
        return []  # a setting E001-E006 report
    where = "" if alias == "default" else f" --database {alias}"
    try:
        store.check_schema()
    except ConfigurationError as exc:
        return [
            checks.Warning(
                str(exc),
                hint=(
                    "Django records every celery-leases migration as applied: the table was "
                    "restored or downgraded behind that record; run manage.py leases upgrade"
                    if _all_applied(alias)
                    else f"run manage.py migrate{where}: it applies celery-leases' revisions"
                ),
                id="celery_leases.W003",
            )
        ]
    except LeaseError as exc:
        return [_unreadable(store, exc)]
    found = []
    for name, other in routes.stores(store.settings)[1:]:
        try:
            other.check_schema()
        except ConfigurationError as exc:
            found.append(
                checks.Warning(
                    f"leases database {name!r} (CELERY_LEASES_DATABASES): {exc}",
                    hint=(
                        f"run manage.py migrate{where}: it brings every database of "
                        f"CELERY_LEASES_DATABASES to the leases table's revision (one added "
                        f"after the migrations were applied too)"
                    ),
                    id="celery_leases.W003",
                )
            )
        except LeaseError as exc:
            found.append(_unreadable(other, exc, name))
    return found


def _unreadable(store: Any, exc: Exception, name: str | None = None) -> checks.CheckMessage:
    which = "" if name is None else f" (leases database {name!r})"
    return checks.Warning(
        f"cannot read the leases table's revision in {store.safe_url}{which}: {exc}",
        hint="check that the database is reachable",
        id="celery_leases.W003",
    )


def _migrated(alias: str) -> bool:
    """Whether ``migrate`` ran this app's migration on ``alias`` (before, Django's own
    "unapplied migrations" says it, and ``migrate`` creates the table)."""
    from django.db import connections
    from django.db.migrations.recorder import MigrationRecorder

    recorder = MigrationRecorder(connections[alias])
    if not recorder.has_table():
        return False
    return recorder.migration_qs.filter(app=TAG).exists()


def _all_applied(alias: str) -> bool:
    """Whether Django records every migration of this app as applied on ``alias``."""
    from django.db import connections
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(connections[alias], ignore_no_migrations=True)
    ours = {node for node in loader.graph.nodes if node[0] == TAG}
    return ours <= set(loader.applied_migrations)


__all__ = ["register"]
