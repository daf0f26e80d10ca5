"""celery-leases in a Django project (``pip install celery-leases[django]``).

Add ``"celery_leases.contrib.django"`` to ``INSTALLED_APPS``: ``manage.py migrate`` creates and
upgrades the jobs table in Django's database (by running celery-leases' own migrations, so
there is one schema history), the admin lists the jobs with retry / cancel / release actions,
and :class:`DjangoLeasedTask` is the task base class whose checkpoints join
``transaction.atomic()``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DjangoLeasedTask"]


def __getattr__(name: str) -> Any:
    # Imported on use: INSTALLED_APPS imports this package before Django's apps are ready.
    if name == "DjangoLeasedTask":
        from .task import DjangoLeasedTask

        return DjangoLeasedTask
    raise AttributeError(name)
