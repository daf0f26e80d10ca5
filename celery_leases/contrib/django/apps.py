"""The Django app: ``INSTALLED_APPS = [..., "celery_leases.contrib.django"]``."""

from __future__ import annotations

from typing import Any

from celery.signals import task_postrun
from django.apps import AppConfig
from django.db.models.signals import post_migrate

from ...config import register_default_url
from ...db.joined import register_ambient, register_unwrap
from . import checks, transaction
from .database import default_url


class LeasesConfig(AppConfig):
    """Celery leases: the jobs table's migrations and a read-only admin of the jobs."""

    name = "celery_leases.contrib.django"
    label = "celery_leases"
    verbose_name = "Celery leases"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        # Without leases_database_url, the leases live in the project's own database, and
        # the fenced writes of a task join its transaction.atomic() blocks there.
        register_default_url(default_url)
        checks.register()
        register_ambient(transaction.ambient)
        register_unwrap(transaction.unwrap)
        task_postrun.connect(release_after_task, weak=False)
        post_migrate.connect(upgrade_after_migrate, sender=self)


def release_after_task(sender: Any = None, **_: Any) -> None:
    """A task ended in this process: a leased one gives Django's connection back the
    idle-write bound its joined writes set (MariaDB)."""
    if getattr(sender, "__celery_leases__", False):
        transaction.release(sender.lease_store)


def upgrade_after_migrate(
    using: str = "default", verbosity: int = 1, apps: Any = None, **_: Any
) -> None:
    """Every ``manage.py migrate`` of the leases database also applies the celery-leases
    revisions a newer release brought (one schema history: the package's Alembic revisions),
    unless it just unapplied this app (``migrate celery_leases zero``)."""
    from .migration import migrate_database

    if apps is not None and not _applied(apps):
        return
    migrate_database(using, verbosity=verbosity)


def _applied(apps: Any) -> bool:
    try:
        apps.get_model("celery_leases", "Job")
    except LookupError:
        return False
    return True
