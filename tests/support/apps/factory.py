"""The one factory of the Celery apps that test workers run (``celery -A <module>``).

Each app module builds its app with :func:`make_app` and adds its tasks. The settings come from
the environment the spawner passes, in one of two forms, named by ``make_app``'s ``variables``:

``"app_env"`` (the leased apps: ``leased_app`` and those built on it, ``chaos/app.py``), variables
built with :func:`app_env`; the reaper is scheduled when ``E2E_REAPER_EVERY`` is set, and
kombu's ``filesystem://`` writer is made atomic:

=============================  ================================================================
``E2E_BROKER_URL``             broker URL (``redis://``, ``amqp://``, ``filesystem://``)
``E2E_RESULT_BACKEND``         result backend URL (unset: none)
``E2E_DATABASE_URL``           ``leases_database_url``; the unit log lives in the same database
``E2E_TABLE``                  ``leases_table``; the unit log table is ``<table>_units``
``E2E_LEASE_SECONDS``          ``leases_duration``
``E2E_RENEW_SECONDS``          ``leases_renew_interval`` (unset: a third of the lease)
``E2E_ACKS_LATE``              ``task_acks_late`` (``1``/``0``)
``E2E_REJECT_ON_WORKER_LOST``  ``task_reject_on_worker_lost`` (``1``/``0``)
``E2E_VISIBILITY_TIMEOUT``     Redis ``visibility_timeout`` in seconds
``E2E_RESTORE_INTERVAL``       Redis ``unacked_restore_interval`` (and a throttle of 1), seconds
``E2E_QUEUE``                  ``task_default_queue`` (and a private remote-control exchange)
``E2E_REAPER_EVERY``           seconds between reaper passes, via ``schedule_reaper`` (unset: none)
``E2E_MAX_NO_PROGRESS``        ``leases_max_attempts_without_progress``
``TEST_CELERY_CONFIG``         JSON of any other Celery settings (``service.celery_env``)
=============================  ================================================================

``"celery_env"`` (``plain_app``, ``cli_app``, ``progress_app``): the settings a test passed
with ``service.celery_env`` (``TEST_CELERY_CONFIG``, and the broker URL in ``TEST_BROKER_URL``),
as they are.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

from celery import Celery

import celery_leases
from celery_leases.settings import DEFAULTS

#: How each ``app_env`` keyword maps to its variable.
ENV_NAMES = {
    "broker_url": "E2E_BROKER_URL",
    "result_backend": "E2E_RESULT_BACKEND",
    "database_url": "E2E_DATABASE_URL",
    "table": "E2E_TABLE",
    "lease_seconds": "E2E_LEASE_SECONDS",
    "renew_seconds": "E2E_RENEW_SECONDS",
    "acks_late": "E2E_ACKS_LATE",
    "reject_on_worker_lost": "E2E_REJECT_ON_WORKER_LOST",
    "visibility_timeout": "E2E_VISIBILITY_TIMEOUT",
    "restore_interval": "E2E_RESTORE_INTERVAL",
    "queue": "E2E_QUEUE",
    "reaper_every": "E2E_REAPER_EVERY",
    "max_no_progress": "E2E_MAX_NO_PROGRESS",
}

T = TypeVar("T")


def make_app(
    name: str,
    environ: Mapping[str, str] | None = None,
    *,
    variables: Literal["app_env", "celery_env"] = "app_env",
    defaults: Mapping[str, Any] | None = None,
    reaper: bool = True,
    current: bool = False,
) -> Celery:
    """A Celery app named ``name``, configured from ``environ`` (default: os.environ) as
    ``variables`` says (see the module's docstring), over ``defaults``. ``reaper=False`` leaves
    the reaper unscheduled whatever ``E2E_REAPER_EVERY`` says; ``current``: set as Celery's
    current app."""
    environ = os.environ if environ is None else environ
    reaper_every = None
    if variables == "celery_env":
        found = config_from_env(environ)
    else:
        found, reaper_every = settings_from_env(environ)
        if str(found.get("broker_url", "")).startswith("filesystem://"):
            _atomic_filesystem_put()
    app = Celery(name, set_as_current=current)
    app.conf.update({**(defaults or {}), **found})
    if reaper and reaper_every is not None:
        celery_leases.schedule_reaper(app, reaper_every)
    return app


def app_env(*, extra: Mapping[str, Any] | None = None, **values: Any) -> dict[str, str]:
    """Environment variables for an ``app_env`` app: keywords named as in ``ENV_NAMES``, None
    skipped; ``extra`` holds any other Celery settings (sent as ``TEST_CELERY_CONFIG`` JSON)."""
    env: dict[str, str] = {}
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = int(value)
        env[ENV_NAMES[key]] = str(value)
    if extra:
        env["TEST_CELERY_CONFIG"] = json.dumps(dict(extra))
    return env


def settings_from_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], float | None]:
    """The Celery settings and the reaper interval (seconds, or None) the ``app_env`` variables
    describe."""
    raw = {key: environ.get(name) for key, name in ENV_NAMES.items()}
    settings: dict[str, Any] = json.loads(environ.get("TEST_CELERY_CONFIG") or "{}")
    settings.setdefault("worker_prefetch_multiplier", 1)
    settings.setdefault("broker_connection_retry_on_startup", True)
    if raw["broker_url"]:
        settings["broker_url"] = raw["broker_url"]
    if raw["result_backend"]:
        settings["result_backend"] = raw["result_backend"]
        if raw["result_backend"].startswith("db+sqlite"):
            # Wait for a writer frozen by a test (SIGSTOP) instead of failing after 5 s.
            settings.setdefault("database_engine_options", {"connect_args": {"timeout": 120}})
    if raw["database_url"]:
        settings["leases_database_url"] = raw["database_url"]
    if raw["table"]:
        settings["leases_table"] = raw["table"]
    if raw["lease_seconds"]:
        settings["leases_duration"] = float(raw["lease_seconds"])
    if raw["renew_seconds"]:
        settings["leases_renew_interval"] = float(raw["renew_seconds"])
    if raw["max_no_progress"]:
        settings["leases_max_attempts_without_progress"] = int(raw["max_no_progress"])
    if raw["acks_late"] is not None:
        settings["task_acks_late"] = raw["acks_late"] == "1"
    if raw["reject_on_worker_lost"] is not None:
        settings["task_reject_on_worker_lost"] = raw["reject_on_worker_lost"] == "1"
    transport = dict(settings.get("broker_transport_options") or {})
    if raw["visibility_timeout"]:
        transport["visibility_timeout"] = float(raw["visibility_timeout"])
    if raw["restore_interval"]:
        transport["unacked_restore_interval"] = float(raw["restore_interval"])
        transport["unacked_restore_throttle"] = 1
    if transport:
        settings["broker_transport_options"] = transport
    if raw["queue"]:
        settings["task_default_queue"] = raw["queue"]
        settings.setdefault("control_exchange", f"{raw['queue']}_control")
    every = float(raw["reaper_every"]) if raw["reaper_every"] else None
    return settings, every


def config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The Celery settings a test passed with ``service.celery_env``, read from ``environ``
    (default: os.environ)."""
    environ = os.environ if environ is None else environ
    settings: dict[str, Any] = json.loads(environ.get("TEST_CELERY_CONFIG", "{}"))
    if "TEST_BROKER_URL" in environ:
        settings["broker_url"] = environ["TEST_BROKER_URL"]
    return settings


def table_of(app: Celery, kind: Callable[[str, str], T], suffix: str) -> T:
    """The table ``<leases_table>_<suffix>`` in ``app``'s leases database, as
    ``kind(url, name)`` (a ``unit_log.ProcessTable``): made at first use, then the same object
    for that app, kind and suffix."""
    tables: dict[tuple[Any, str], Any] = app.__dict__.setdefault("_test_tables", {})
    found: T | None = tables.get((kind, suffix))
    if found is None:
        conf = app.conf
        found = tables[(kind, suffix)] = kind(
            conf.get("leases_database_url", DEFAULTS["database_url"]),
            f"{conf.get('leases_table', DEFAULTS['table'])}_{suffix}",
        )
    return found


def _atomic_filesystem_put() -> None:
    """Make kombu's ``filesystem://`` writer atomic: write under a name no reader takes, then
    rename into place. kombu creates the message file, then locks and writes it, and a reader
    that moves it in between reads an empty file and the whole worker dies
    (``JSONDecodeError``; see ../shared/CELERY-FACTS.md)."""
    from kombu.transport import filesystem
    from kombu.utils.encoding import str_to_bytes
    from kombu.utils.json import dumps

    channel = filesystem.Channel
    if getattr(channel._put, "atomic", False):
        return

    def _put(self: Any, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f"partial-{uuid.uuid4().hex}")
        try:
            with open(partial, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise filesystem.ChannelError(f"Cannot add file {final!r} to directory") from exc

    _put.atomic = True  # type: ignore[attr-defined]
    channel._put = _put
