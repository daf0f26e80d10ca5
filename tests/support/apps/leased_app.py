"""A celery-leases app for the end-to-end tests and ``bench/recovery.py``, configured from env.

Run it as ``celery -A tests.support.apps.leased_app worker`` (or ``beat``) with these variables set
(build them with :func:`app_env`):

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

Tasks (all write the unit log, see ``tests/support/unit_log.py``):

- ``e2e.units(count, unit_seconds)``: ``count`` units of ``unit_seconds`` each; after each unit
  it checkpoints ``{"next": unit + 1}`` in the transaction that commits the unit's log row, and
  it resumes from ``self.lease.checkpoint``. Returns ``count``.
- ``e2e.keyed_units(account, count, unit_seconds)``: as ``e2e.units``, for lease key
  ``account:<account>``, also saving the key's cursor ``{"units": n}`` (units its runs
  committed) with each checkpoint. Returns the cursor it ended at.
- ``e2e.poison()``: logs unit 0, then SIGKILLs its own process, before any checkpoint.
- ``e2e.bad_checkpoint()``: saves ``{"next": 1}``, then checkpoints a non-JSON object.
- ``e2e.plain_units(count, unit_seconds)``: plain Celery (no lease), always from unit 0, each
  unit committed on its own, for comparison.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Mapping
from typing import Any

from celery import Celery, Task

import celery_leases
from celery_leases import LeasedTask
from celery_leases.settings import DEFAULTS
from tests.support.unit_log import UnitLog

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


def app_env(*, extra: Mapping[str, Any] | None = None, **values: Any) -> dict[str, str]:
    """Environment variables for this app: keywords named as in ``ENV_NAMES``, None skipped;
    ``extra`` holds any other Celery settings (sent as ``TEST_CELERY_CONFIG`` JSON)."""
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
    """The Celery settings and the reaper interval (seconds, or None) the variables describe."""
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


def unit_log_for(app: Celery) -> UnitLog:
    """The unit log of ``app``: table ``<leases_table>_units`` in the leases database."""
    log: UnitLog | None = app.__dict__.get("_e2e_unit_log")
    if log is None:
        conf = app.conf
        log = UnitLog(
            conf.get("leases_database_url", DEFAULTS["database_url"]),
            f"{conf.get('leases_table', DEFAULTS['table'])}_units",
        )
        app.__dict__["_e2e_unit_log"] = log
    return log


def make_app(
    environ: Mapping[str, str] | None = None, *, name: str = "leased_app", current: bool = False
) -> Celery:
    """A Celery app with the e2e tasks, configured from ``environ`` (default: os.environ)."""
    settings, reaper_every = settings_from_env(os.environ if environ is None else environ)
    if str(settings.get("broker_url", "")).startswith("filesystem://"):
        _atomic_filesystem_put()
    app = Celery(name, set_as_current=current)
    app.conf.update(settings)
    if reaper_every is not None:
        celery_leases.schedule_reaper(app, reaper_every)
    log = unit_log_for(app)

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.units")
    def units(
        self: Task,
        count: int,
        unit_seconds: float,
        linger_at: int | None = None,
        linger_file: str | None = None,
        hang_at: int | None = None,
        hang_file: str | None = None,
    ) -> int:
        """``count`` units, each committed with its checkpoint. At unit ``linger_at`` the first
        attempt's transaction lingers after the checkpoint statement: ``linger_file`` is created
        (the row is then locked) and the commit waits 3 s, long enough to freeze the worker.
        At unit ``hang_at`` the first attempt hangs (``hang_file`` created, then an hour's
        sleep), as a task stuck on a dead socket does."""
        lease = self.lease
        run = uuid.uuid4().hex
        first = (lease.checkpoint or {}).get("next", 0)
        for unit in range(first, count):
            row = log.start(
                lease.job_id,
                unit,
                run=run,
                token=lease.token,
                attempt=lease.attempt,
                host=self.request.hostname or "",
            )
            if unit == hang_at:
                hang_once(hang_file)
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
                self.checkpoint({"next": unit + 1}, connection=connection)
                if unit == linger_at and linger_file and not os.path.exists(linger_file):
                    open(linger_file, "x").close()  # once: a resumed attempt commits at once
                    time.sleep(3.0)
            self.stop_point()  # committed: stop here if asked to (cancel, shutdown)
        return count

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="e2e.keyed_units",
        lease_key="account:{account}",
    )
    def keyed_units(self: Task, account: str, count: int, unit_seconds: float) -> int:
        """``count`` units of the job's lease key ``account:<account>``: each committed with
        its checkpoint and the key's cursor ``{"units": <units the key's runs committed>}``
        in one transaction. Returns the cursor it ended at."""
        lease = self.lease
        run = uuid.uuid4().hex
        first = (lease.checkpoint or {}).get("next", 0)
        done = int((lease.cursor or {}).get("units", 0))
        for unit in range(first, count):
            row = log.start(
                lease.job_id,
                unit,
                run=run,
                token=lease.token,
                attempt=lease.attempt,
                host=self.request.hostname or "",
            )
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
                self.save_cursor({"units": done + 1}, connection=connection)
                self.checkpoint({"next": unit + 1}, connection=connection)
            done += 1
            self.stop_point()
        return done

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.poison")
    def poison(self: Task) -> None:
        lease = self.lease
        log.start(
            lease.job_id,
            0,
            run=uuid.uuid4().hex,
            token=lease.token,
            attempt=lease.attempt,
            host=self.request.hostname or "",
        )
        os.kill(os.getpid(), signal.SIGKILL)

    @app.task(base=LeasedTask, bind=True, shared=False, name="e2e.bad_checkpoint")
    def bad_checkpoint(self: Task) -> None:
        self.checkpoint({"next": 1})
        self.checkpoint({"next": 2, "when": object()})

    @app.task(bind=True, shared=False, name="e2e.plain_units")
    def plain_units(
        self: Task,
        count: int,
        unit_seconds: float,
        hang_at: int | None = None,
        hang_file: str | None = None,
    ) -> int:
        run = uuid.uuid4().hex
        for unit in range(count):
            row = log.start(
                self.request.id,
                unit,
                run=run,
                token=None,
                attempt=None,
                host=self.request.hostname or "",
            )
            if unit == hang_at:
                hang_once(hang_file)
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
        return count

    return app


def hang_once(marker: str | None) -> None:
    """Hang for an hour unless ``marker`` exists (created first: only one attempt hangs)."""
    if marker is None or os.path.exists(marker):
        return
    open(marker, "x").close()
    time.sleep(3600)


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


app = make_app(current=True)
