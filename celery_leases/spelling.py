"""Settings Celery would never read: a ``leases_*`` key that is no setting (a typo), a setting
spelled in a case or with a prefix Celery does not look up, and an unknown ``lease_*`` task
option. Each one is refused (``ConfigurationError``) instead of leaving the setting at its
default in silence.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from .config import DEFAULTS, TASK_OPTIONS, loaded_conf
from .errors import ConfigurationError

_LEASES_KEY = re.compile(r"^(?P<prefix>[a-z0-9_]*?_)?leases_(?P<name>\w+)$", re.IGNORECASE)
#: ``leases_*`` settings read by an integration rather than ``Settings``: the Django database
#: alias (``CELERY_LEASES_DATABASE_ALIAS``, ``celery_leases.contrib.django``).
READ_ELSEWHERE = ("database_alias",)


def unread_settings(app: Any) -> list[str]:
    """What is wrong with the ``leases_*`` keys of a Celery app's configuration: a
    name that is no setting, or a setting spelled in a case or with a prefix Celery does not
    read (``LEASES_TABLE`` without a namespace, ``CELERY_LEASES_TABLE`` without the namespace
    ``CELERY``). Empty when every such key is read. Keys with any other prefix
    (``myapp_leases_x``) are not celery-leases' and are left alone."""
    conf = loaded_conf(app)
    prefix = conf.prefix or ""
    ours = {"", "celery_", prefix.lower()}
    problems = []
    for key in sorted({str(k) for k in conf}):
        found = _LEASES_KEY.match(key)
        if found is None or (found["prefix"] or "").lower() not in ours:
            continue
        name = found["name"].lower()
        read = key in readable(prefix, name)
        if read and (name in DEFAULTS or name in READ_ELSEWHERE):
            continue
        if name in DEFAULTS:
            where = f"with the namespace {prefix.rstrip('_')}," if prefix else "without a namespace"
            problems.append(
                f"setting {key} is never read ({where} Celery reads "
                f"{' or '.join(readable(prefix, name))})"
            )
            continue
        close = _close(name)
        if close is None:
            hint = ""
        elif read:
            hint = f" (did you mean {_respelled(key, close)}?)"
        else:
            hint = f" (did you mean {' or '.join(readable(prefix, close))}?)"
        problems.append(f"unknown setting {key}{hint}: celery-leases has no such setting")
    return problems


def readable(prefix: str, name: str) -> tuple[str, ...]:
    """The keys under which Celery finds the setting ``leases_<name>`` (``conf.get``)."""
    plain = f"leases_{name}"
    if not prefix:
        return (plain,)
    spelled = f"{prefix}{plain}"
    return (spelled.upper() if prefix.isupper() else spelled, plain)


def _close(name: str) -> str | None:
    found = difflib.get_close_matches(name, list(DEFAULTS), n=1, cutoff=0.75)
    return found[0] if found else None


def _respelled(key: str, name: str) -> str:
    """``key`` with its setting name replaced by ``name``, in the same case and prefix."""
    found = _LEASES_KEY.match(key)
    assert found is not None
    head = key[: found.start("name")]
    return head + (name.upper() if key.isupper() else name)


def check_task_options(task_type: type, *, base: type) -> None:
    """Refuse a ``lease_*`` (or ``leases_*``) attribute of a task class (``@app.task(...)``
    options) that is no task option: a typo would leave the option at the app's setting."""
    known = {f"lease_{name}" for name in TASK_OPTIONS} | set(vars(base))
    for klass in task_type.__mro__:
        if klass is base:
            return
        for name in vars(klass):
            if name in known or not name.startswith(("lease_", "leases_")):
                continue
            option = name.split("_", 1)[1]
            close = difflib.get_close_matches(option, TASK_OPTIONS, n=1, cutoff=0.75)
            hint = f" (did you mean lease_{close[0]}?)" if close else ""
            raise ConfigurationError(
                f"task {getattr(task_type, 'name', task_type.__name__)!r}: unknown task option "
                f"{name}{hint}; the task options are "
                f"{', '.join(f'lease_{o}' for o in TASK_OPTIONS)}"
            )


__all__ = ["check_task_options", "readable", "unread_settings"]
