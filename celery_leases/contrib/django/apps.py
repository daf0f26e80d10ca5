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
    """Celery leases: the jobs table's migrations (one Django operation per schema revision),
    the admin of the jobs, the keys and the groups, checks and ``manage.py leases``."""

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
        post_migrate.connect(report_after_migrate, sender=self)


def release_after_task(sender: Any = None, **_: Any) -> None:
    """A task ended in this process: a leased one gives Django's connection back the
    idle-write bound its joined writes set (MariaDB)."""
    if getattr(sender, "__celery_leases__", False):
        transaction.release(sender.lease_store)


def report_after_migrate(
    using: str = "default", verbosity: int = 1, apps: Any = None, **_: Any
) -> None:
    """After ``manage.py migrate`` of the leases database: where the table is and at which
    revision (the revisions themselves are this app's migrations' operations)."""
    from .migration import report

    report(using, verbosity=verbosity)
