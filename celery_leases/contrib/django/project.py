"""The project's Celery app, as the system checks and ``manage.py leases`` find it.

``CELERY_LEASES_APP`` (a dotted path: ``"proj.celery.app"`` or ``"proj.celery:app"``) names it;
without it, the app is Celery's current app once the project's ``celery`` module is imported:
the ``celery.py`` next to the settings module (``proj/celery.py`` for ``proj.settings``), which
``proj/__init__.py`` imports already in a project set up as Celery's "First steps with Django"
says.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from ...errors import ConfigurationError

#: The Django setting naming the project's Celery app.
APP_SETTING = "CELERY_LEASES_APP"


def celery_app() -> Any | None:
    """The project's Celery app (``CELERY_LEASES_APP``, else Celery's current app after
    importing ``<settings package>.celery``; None when no app was made). Raises
    :class:`ConfigurationError` when ``CELERY_LEASES_APP`` names nothing importable or not a
    Celery app."""
    from celery import Celery, _state, current_app
    from django.conf import settings

    path = getattr(settings, APP_SETTING, None)
    if path is not None:
        app = _imported(str(path))
        if not isinstance(app, Celery):
            raise ConfigurationError(
                f"{APP_SETTING} is {path!r}, which is {type(app).__name__}, not a Celery app"
            )
        return app
    module = _celery_module()
    if module is not None:
        importlib.import_module(module)
    if _state._tls.current_app is None and _state.default_app is None:
        return None  # no app was made: current_app would be an empty one made now
    return current_app._get_current_object()


def load_tasks(app: Any) -> None:
    """Import the task modules a worker of ``app`` would: the ``tasks`` module of each
    installed Django app (``app.autodiscover_tasks()`` is lazy: only a worker's start imports
    them) and ``imports``/``include``. Without the worker's signal, whose Django fixup would
    run the system checks again from inside a check."""
    app.autodiscover_tasks(force=True)
    for module in app.loader.default_modules:
        app.loader.import_task_module(module)


def _imported(path: str) -> Any:
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigurationError(
            f"{APP_SETTING} is {path!r}, which cannot be imported ({exc}): give the dotted "
            f"path of your Celery app, such as 'proj.celery.app'"
        ) from exc


def _celery_module() -> str | None:
    """``<package>.celery`` for the settings module ``<package>.settings``, when it exists."""
    package = os.environ.get("DJANGO_SETTINGS_MODULE", "").rpartition(".")[0]
    if not package:
        return None
    name = f"{package}.celery"
    try:
        return name if importlib.util.find_spec(name) is not None else None
    except ImportError:
        return None


def missing_app_hint() -> str:
    """What to do when :func:`celery_app` finds no app."""
    package = os.environ.get("DJANGO_SETTINGS_MODULE", "proj.settings").rpartition(".")[0]
    return (
        f"set {APP_SETTING} = 'proj.celery.app' in Django's settings (no Celery app was "
        f"made by Django's start or by importing {package or 'proj'}.celery)"
    )


__all__ = ["APP_SETTING", "celery_app", "missing_app_hint"]
