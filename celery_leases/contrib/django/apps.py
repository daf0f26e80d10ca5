"""The Django app: ``INSTALLED_APPS = [..., "celery_leases.contrib.django"]``."""

from __future__ import annotations

from typing import Any

from celery.signals import task_postrun, task_prerun
from django.apps import AppConfig
from django.db.models.signals import post_migrate

from ...config import register_default_url
from ...db import migrations
from ...db.joined import register_ambient, register_refusal, register_unwrap
from . import checks, sessions, transaction
from .database import default_url

#: How a project with this app creates and upgrades the leases table, as errors name it.
MIGRATE = "python manage.py migrate (outside Django: celery -A proj leases upgrade)"


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
        # Errors about the table name Django's command first (it is what creates the table
        # and upgrades it in a project with this app).
        migrations.INIT_COMMAND = MIGRATE
        migrations.UPGRADE_COMMAND = MIGRATE
        checks.register()
        register_ambient(transaction.ambient)
        register_unwrap(transaction.unwrap)
        # A checkpoint inside atomic() on a database the leases are not in is refused.
        register_refusal(transaction.refuse_unjoined)
        task_prerun.connect(transaction.note_start, weak=False)
        task_postrun.connect(release_after_task, weak=False)
        # What celery-leases holds on a database closes with Django's connection to it (so
        # the test runner can drop or copy its test database).
        sessions.install()
        post_migrate.connect(report_after_migrate, sender=self)


def release_after_task(sender: Any = None, **kwargs: Any) -> None:
    """A task ended in this process: a leased one gives Django's connection back the
    idle-write bound its joined writes set (MariaDB)."""
    transaction.forget_start(**kwargs)
    if getattr(sender, "__celery_leases__", False):
        transaction.release(sender.lease_store)


def report_after_migrate(
    using: str = "default", verbosity: int = 1, apps: Any = None, **kwargs: Any
) -> None:
    """After ``manage.py migrate`` of the leases database: a routed database added since its
    migrations were applied brought to their revision, then where the table is and at which
    revision (the revisions themselves are this app's migrations' operations). Django's
    ``flush`` sends this signal too (after every ``TransactionTestCase`` test), without a
    ``plan``: then nothing is done."""
    from .migration import report, settle_routed

    if "plan" not in kwargs:  # flush, not migrate
        return
    settle_routed(using, verbosity=verbosity, out=kwargs.get("stdout"))
    report(using, verbosity=verbosity)
