"""Every ``leases_*`` setting, its default and its validation, in one place.

Durations are in seconds (``float``), sizes in bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigurationError

DEFAULTS: dict[str, Any] = {
    # Where the jobs table lives (any SQLAlchemy URL).
    "database_url": "sqlite:///celery_leases.sqlite3",
    # Name of the jobs table.
    "table": "celery_leases_jobs",
    # Extra keyword arguments for sqlalchemy.create_engine().
    "engine_options": {},
    # Seconds a lease lasts without a renewal.
    "duration": 30.0,
    # Seconds between renewals; None means a third of the duration.
    "renew_interval": None,
    # Largest checkpoint, in bytes of its JSON form.
    "max_checkpoint_bytes": 1024 * 1024,
    # Largest delay, in seconds, between re-deliveries while the database is down.
    "db_retry_max_delay": 60.0,
    # Jobs handled per batch by one reaper pass.
    "reap_batch": 500,
    # Seconds a re-published job is left alone before it is re-published again.
    "reap_grace": None,
    # Seconds a queued job may wait for a worker before its message counts as lost; None is off.
    "queued_timeout": None,
    # Consecutive attempts that ended without a checkpoint before the job is failed.
    "max_attempts_without_progress": 3,
    # Hard cap on attempts (claims); None is no cap.
    "max_attempts": None,
    # Seconds a finished job is kept before the reaper deletes it.
    "retention": 7 * 24 * 3600.0,
    # Seconds without a checkpoint after which a running attempt counts as stalled; None is off.
    "stall_timeout": None,
    # Terminate a prefork pool process whose task stalled, freeing its slot.
    "kill_stalled": False,
    # On warm shutdown, running leased tasks hand back at their next checkpoint.
    "preempt_on_shutdown": True,
}

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,47}$")


@dataclass(frozen=True)
class Settings:
    """Validated settings; read them with :func:`settings_for`, not by hand."""

    database_url: str
    table: str
    engine_options: dict[str, Any]
    duration: float
    renew_interval: float
    max_checkpoint_bytes: int
    db_retry_max_delay: float
    reap_batch: int
    reap_grace: float
    queued_timeout: float | None
    max_attempts_without_progress: int | None
    max_attempts: int | None
    retention: float
    stall_timeout: float | None
    kill_stalled: bool
    preempt_on_shutdown: bool

    def with_task_options(self, task: Any) -> Settings:
        """These settings with the task's own ``lease_*`` options applied and re-validated."""
        overrides = {}
        for name in (
            "duration",
            "renew_interval",
            "max_checkpoint_bytes",
            "stall_timeout",
            "kill_stalled",
        ):
            value = getattr(task, f"lease_{name}", None)
            if value is not None:
                overrides[name] = value
        if not overrides:
            return self
        if "duration" in overrides and "renew_interval" not in overrides:
            overrides["renew_interval"] = None
        raw = {f.name: getattr(self, f.name) for f in fields(self)} | overrides
        return validate(raw, where=f"task {getattr(task, 'name', task)!r}: ")


def _number(raw: dict[str, Any], name: str, where: str, *, optional: bool = False) -> float | None:
    value = raw[name]
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{where}leases_{name} must be a number of seconds, not {value!r}")
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigurationError(f"{where}leases_{name} must be a positive number, not {value!r}")
    return float(value)


def _count(raw: dict[str, Any], name: str, where: str, *, optional: bool = False) -> int | None:
    value = raw[name]
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{where}leases_{name} must be a positive integer, not {value!r}")
    return value


def _parses_as_url(url: str) -> bool:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        return False
    return True


def _hide_password(url: Any) -> Any:
    """``url`` with any ``user:password@`` password replaced by ``***`` (for messages)."""
    return re.sub(r"(://[^:@/]*:)[^@]*@", r"\1***@", url) if isinstance(url, str) else url


def validate(raw: dict[str, Any], *, where: str = "") -> Settings:
    """Check raw setting values (names without the ``leases_`` prefix) and build Settings."""
    url = raw["database_url"]
    if not isinstance(url, str) or "://" not in url or not _parses_as_url(url):
        raise ConfigurationError(
            f"{where}leases_database_url must be an SQLAlchemy URL such as "
            f"'postgresql+psycopg://host/db', not {_hide_password(url)!r}"
        )
    table = raw["table"]
    if not isinstance(table, str) or not _IDENTIFIER.match(table):
        raise ConfigurationError(
            f"{where}leases_table must be a plain SQL identifier (letters, digits, _), "
            f"not {table!r}"
        )
    if not isinstance(raw["engine_options"], dict):
        raise ConfigurationError(f"{where}leases_engine_options must be a dict")
    duration = _number(raw, "duration", where)
    assert duration is not None
    renew = _number(raw, "renew_interval", where, optional=True)
    if renew is None:
        renew = duration / 3
    if renew >= duration:
        raise ConfigurationError(
            f"{where}leases_renew_interval ({renew:g} s) must be shorter than "
            f"leases_duration ({duration:g} s), or every lease expires before it is renewed"
        )
    for flag in ("kill_stalled", "preempt_on_shutdown"):
        if not isinstance(raw[flag], bool):
            raise ConfigurationError(
                f"{where}leases_{flag} must be True or False, not {raw[flag]!r}"
            )
    grace = _number(raw, "reap_grace", where, optional=True)
    stall = _number(raw, "stall_timeout", where, optional=True)
    return Settings(
        database_url=url,
        table=table,
        engine_options=dict(raw["engine_options"]),
        duration=duration,
        renew_interval=renew,
        max_checkpoint_bytes=_count(raw, "max_checkpoint_bytes", where) or 0,
        db_retry_max_delay=_number(raw, "db_retry_max_delay", where) or 0.0,
        reap_batch=_count(raw, "reap_batch", where) or 0,
        reap_grace=grace if grace is not None else max(duration, 5.0),
        queued_timeout=_number(raw, "queued_timeout", where, optional=True),
        max_attempts_without_progress=_count(
            raw, "max_attempts_without_progress", where, optional=True
        ),
        max_attempts=_count(raw, "max_attempts", where, optional=True),
        retention=_number(raw, "retention", where) or 0.0,
        stall_timeout=stall,
        kill_stalled=raw["kill_stalled"],
        preempt_on_shutdown=raw["preempt_on_shutdown"],
    )


def settings_for(app: Any) -> Settings:
    """The validated ``leases_*`` settings of a Celery app."""
    conf = app.conf
    raw = {name: conf.get(f"leases_{name}", default) for name, default in DEFAULTS.items()}
    return validate(raw)


__all__ = ["DEFAULTS", "Settings", "settings_for", "validate"]
