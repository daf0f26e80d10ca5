"""Reading the ``leases_*`` settings of a Celery app, and refusing the ones Celery would never
read: a ``leases_*`` key that is no setting (a typo), a setting spelled in a case or with a
prefix Celery does not look up, an unknown ``lease_*`` task option. Each one is a
``ConfigurationError`` instead of a setting left at its default in silence.

The settings themselves are declared in ``settings.py``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from typing import Any

from .errors import ConfigurationError
from .settings import DEFAULTS, TASK_OPTIONS, Settings, validate


def settings_for(app: Any) -> Settings:
    """The validated ``leases_*`` settings of a Celery app.

    Without ``leases_database_url``, a Django project with ``celery_leases.contrib.django``
    installed keeps its leases in its own database (``CELERY_LEASES_DATABASE_ALIAS``).

    Raises :class:`ConfigurationError` for a ``leases_*`` key that is no setting (a typo would
    otherwise leave its setting at the default: the default SQLite file, say), or one spelled
    so that Celery never reads it (:func:`unread_settings`).
    """
    problems = unread_settings(app)
    conf = app.conf
    if problems:
        raise ConfigurationError("; ".join(problems))
    raw = {name: conf.get(f"leases_{name}", default) for name, default in DEFAULTS.items()}
    if conf.get("leases_database_url") is None:
        raw["database_url"] = _default_url() or raw["database_url"]
    return validate(raw)


#: Where an integration keeps the leases when an app names no database (``leases_database_url``
#: unset): a function giving the URL, or None when it has nothing to say (not configured).
DefaultURL = Callable[[], "str | None"]
_default_urls: list[DefaultURL] = []


def register_default_url(find: DefaultURL) -> None:
    """Register ``find`` as a place the leases live when an app names no database: the
    Django integration's app registers its project's database (``CELERY_LEASES_DATABASE_ALIAS``)
    when Django loads it."""
    if find not in _default_urls:
        _default_urls.append(find)


def _default_url() -> str | None:
    for find in _default_urls:
        url = find()
        if url is not None:
            return url
    return None


def conf_version(app: Any) -> tuple[Any, ...]:
    """A cheap key that changes when ``app``'s ``leases_*`` settings may have changed: the
    configuration object and its maps (``config_from_object`` replaces them) and the values
    set at run time in ``app.conf`` (``app.conf.leases_x = ...``, ``app.conf.update()``).

    A value changed inside a configuration object after Celery loaded it (Django's
    ``override_settings``) is not seen here: call :func:`reread_settings` then.
    """
    conf = loaded_conf(app)
    changes = conf.changes
    keys = _CHANGE_KEYS.get(conf.prefix)
    if keys is None:
        keys = _CHANGE_KEYS[conf.prefix] = tuple(
            key for name in DEFAULTS for key in readable(conf.prefix or "", name)
        )
    # changes.get, not a sentinel default: an absent key and None look alike, and len()
    # tells them apart (setting or deleting a key changes it).
    return (
        id(conf),
        id(changes),
        len(changes),
        *map(id, conf.maps),
        app.__dict__.get(_GENERATION, 0),
        *map(changes.get, keys),
    )


def loaded_conf(app: Any) -> Any:
    """``app.conf``, loaded: until its first read, Celery's lazy configuration has neither its
    maps nor its namespace."""
    conf = app.conf
    if not app.configured:
        conf.get("leases_database_url")
    return conf


def reread_settings(app: Any) -> None:
    """Make every task of ``app`` read its ``leases_*`` settings again at its next use."""
    app.__dict__[_GENERATION] = app.__dict__.get(_GENERATION, 0) + 1


def mark_uses_leases(app: Any) -> None:
    """Note that ``app`` uses celery-leases (a LeasedTask or the reaper is bound to it)."""
    app.__dict__[_USES_LEASES] = True


def uses_leases(app: Any) -> bool:
    """Whether ``app`` has a LeasedTask or the reaper: the worker's signals act for such apps
    only (every ``celery`` command imports this package for its CLI plugin)."""
    app.tasks  # noqa: B018  (finalizes the app: its tasks are bound, which marks it)
    return bool(app.__dict__.get(_USES_LEASES))


_USES_LEASES = "_celery_leases_used"
_GENERATION = "_celery_leases_settings_generation"
_CHANGE_KEYS: dict[str | None, tuple[str, ...]] = {}


_LEASES_KEY = re.compile(r"^(?P<prefix>[a-z0-9_]*?_)?leases_(?P<name>\w+)$", re.IGNORECASE)
#: ``leases_*`` settings read by an integration rather than ``Settings``: the Django database
#: alias (``CELERY_LEASES_DATABASE_ALIAS``) and the project's Celery app (``CELERY_LEASES_APP``)
#: of ``celery_leases.contrib.django``.
READ_ELSEWHERE = ("database_alias", "app")


def unread_settings(app: Any) -> list[str]:
    """What is wrong with the ``leases_*`` keys of a Celery app's configuration: a
    name that is no setting, or a setting spelled in a case or with a prefix Celery does not
    read (``LEASES_TABLE`` without a namespace, ``CELERY_LEASES_TABLE`` without the namespace
    ``CELERY``). Empty when every such key is read. Keys with any other prefix
    (``myapp_leases_x``) are not celery-leases' and are left alone."""
    conf = loaded_conf(app)
    return unread_keys({str(k) for k in conf}, prefix=conf.prefix or "")


def unread_keys(keys: Iterable[str], *, prefix: str = "") -> list[str]:
    """What :func:`unread_settings` finds wrong in ``keys``, the keys of a configuration that
    Celery reads with the namespace ``prefix`` (``"CELERY_"`` for
    ``config_from_object("django.conf:settings", namespace="CELERY")``; ``""``: none)."""
    ours = {"", "celery_", prefix.lower()}
    problems = []
    for key in sorted(set(keys)):
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


__all__ = [
    "check_task_options",
    "conf_version",
    "loaded_conf",
    "mark_uses_leases",
    "readable",
    "register_default_url",
    "reread_settings",
    "settings_for",
    "unread_keys",
    "unread_settings",
    "uses_leases",
]
