"""Every ``leases_*`` setting, declared once: its default, its check and its meaning.

:class:`Settings` is the single declaration. ``DEFAULTS``, the validation, the per-task options
(``@app.task(lease_duration=...)``) and the docs' configuration table all derive from its
fields. Durations are in seconds (``float``), sizes in bytes. Reading them from a Celery app is
``config.py``'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .errors import ConfigurationError

#: A setting's check: ``check(key, value)`` returns the value to keep or raises
#: ``ConfigurationError`` naming ``key``, the setting as the user wrote it (``leases_duration``,
#: ``CELERY_LEASES_DURATION``).
Check = Callable[[str, Any], Any]
#: How a setting is named in messages, from its name without the prefix (``duration``).
Spelling = Callable[[str], str]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,47}$")


def _fail(name: str, what: str, value: Any) -> ConfigurationError:
    return ConfigurationError(f"{name} must be {what}, not {value!r}")


def seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(name, "a number of seconds", value)
    if not value > 0 or math.isinf(value):
        raise _fail(name, "a positive number", value)
    return float(value)


def count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(name, "a positive integer", value)
    return value


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "True or False", value)
    return value


def optional(check: Check) -> Check:
    return lambda name, value: None if value is None else check(name, value)


def database_url(name: str, value: Any) -> str:
    try:
        if isinstance(value, str) and "://" in value:
            make_url(value)
            return value
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        pass
    raise ConfigurationError(
        f"{name} must be an SQLAlchemy URL such as 'postgresql+psycopg://host/db', "
        f"not {redact(value)!r}"
    )


def identifier(name: str, value: Any) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise _fail(name, "a plain SQL identifier (letters, digits, _)", value)
    return value


def mapping(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(name, "a dict", value)
    return dict(value)


def database_names(name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _fail(name, "a dict of database names to SQLAlchemy URLs", value)
    found = {}
    for alias, url in value.items():
        if not isinstance(alias, str) or not _IDENTIFIER.match(alias) or alias == "default":
            raise _fail(
                name,
                "a dict whose names are plain identifiers other than 'default' "
                "(leases_database_url is 'default')",
                alias,
            )
        found[alias] = database_url(f"{name}[{alias!r}]", url)
    return found


def route_rules(name: str, value: Any) -> Any:
    if callable(value):
        return value
    if not isinstance(value, dict) or not set(value) <= {"queues", "tasks"}:
        raise _fail(
            name,
            "{'queues': {queue: database}, 'tasks': {task name or glob: database}} or a "
            "callable (task_name, queue) -> database name or None",
            value,
        )
    rules = {}
    for kind, found in value.items():
        if not isinstance(found, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in found.items()
        ):
            raise _fail(f"{name}[{kind!r}]", "a dict of names to database names", found)
        rules[kind] = dict(found)
    return rules


def setting(default: Any, check: Check, doc: str, *, per_task: bool = False) -> Any:
    """Declare a setting: ``leases_<name>`` in ``app.conf``; with ``per_task`` also the task
    option ``lease_<name>``. ``doc`` is its one-line meaning (the docs' configuration table)."""
    return field(default=default, metadata={"check": check, "doc": doc, "per_task": per_task})


@dataclass(frozen=True)
class Settings:
    """Validated settings; read them with ``config.settings_for(app)``, not by hand."""

    database_url: str = setting(
        "sqlite:///celery_leases.sqlite3",
        database_url,
        "SQLAlchemy URL of the leases database (PostgreSQL, MariaDB/MySQL, SQLite)",
    )
    table: str = setting("celery_leases_jobs", identifier, "table name (letters, digits, `_`)")
    engine_options: dict[str, Any] = setting(
        None, optional(mapping), "extra `create_engine()` keyword arguments (None: none)"
    )
    databases: dict[str, str] = setting(
        None,
        optional(database_names),
        "more leases databases by name (`{'billing': url}`); `leases_routes` says which jobs "
        "live in each (None: only `leases_database_url`, named `'default'`)",
    )
    routes: Any = setting(
        None,
        optional(route_rules),
        "which database of `leases_databases` holds a job: `{'queues': {queue: name}, "
        "'tasks': {task name or glob: name}}` (tasks first), or a callable `(task_name, "
        "queue)` returning a name or None; a job no rule names is `'default'`'s",
    )
    duration: float = setting(
        30.0,
        seconds,
        "seconds a lease lasts without renewal: how long the job of a frozen or cut-off "
        "worker waits before it moves (a dead holder's job moves at the next reaper pass)",
        per_task=True,
    )
    renew_interval: float = setting(
        None,
        optional(seconds),
        "seconds between renewals (None: a third of the duration); shorter than the duration",
        per_task=True,
    )
    max_checkpoint_bytes: int = setting(
        1024 * 1024, count, "largest checkpoint, in bytes of its JSON", per_task=True
    )
    progress_events: bool | None = setting(
        None,
        optional(flag),
        "send a `task-progress` Celery event at each checkpoint with progress, for Flower "
        "(None: when the worker sends task events, `-E` / `worker_send_task_events`)",
    )
    db_retry_max_delay: float = setting(
        60.0, seconds, "longest delay between re-deliveries while the database is down"
    )
    reap_batch: int = setting(500, count, "jobs per reaper batch")
    reap_grace: float = setting(
        None,
        optional(seconds),
        "seconds a re-published job is left alone before it is re-published again "
        "(None: max(duration, 5))",
    )
    queued_timeout: float | None = setting(
        None,
        optional(seconds),
        "seconds a queued job may wait for a worker before its message counts as lost and "
        "is re-published (None: off, but a job of a lease key waits leases_reap_grace)",
    )
    max_attempts_without_progress: int | None = setting(
        3,
        optional(count),
        "consecutive attempts that die without a checkpoint before the reaper fails the job",
    )
    max_attempts: int | None = setting(
        None, optional(count), "hard cap on attempts (claims, Celery retries included)"
    )
    retention: float = setting(
        7 * 24 * 3600.0,
        seconds,
        "seconds finished jobs are kept before the reaper deletes them (7 days)",
    )
    stall_timeout: float | None = setting(
        None,
        optional(seconds),
        "seconds without a checkpoint after which a running attempt stops renewing, so the "
        "job moves (None: off)",
        per_task=True,
    )
    kill_stalled: bool = setting(
        True,
        flag,
        "with a stall timeout, also end the stalled prefork pool process, so the worker "
        "replaces it and no message waits behind it (off: the process stays hung)",
        per_task=True,
    )
    bind_session: bool = setting(
        True,
        flag,
        "bind each lease to its holder's database session: a job whose holder died resumes "
        "at the next reaper pass, not at its lease's expiry (behind a pooler such as "
        "PgBouncer nothing is bound: PostgreSQL's is detected)",
    )
    preempt_on_shutdown: bool = setting(
        True, flag, "on warm shutdown, running jobs hand back at their next checkpoint"
    )
    record_sync_commit: bool = setting(
        False,
        flag,
        "a plain job's record (no lease key, no group) waits for its commit to reach the disk "
        "before its message is published (PostgreSQL); off: its commit is asynchronous, the "
        "message being the job's second copy (docs/guarantees.md)",
    )
    migrate_on_start: bool = setting(
        False,
        flag,
        "a starting worker creates or upgrades the table (one host, development); off: "
        "run `celery -A proj leases upgrade` when you deploy",
    )

    def with_task_options(self, task: Any) -> Settings:
        """These settings with the task's own ``lease_*`` options applied and re-validated."""
        overrides = {
            f.name: getattr(task, f"lease_{f.name}")
            for f in fields(self)
            if f.metadata["per_task"] and getattr(task, f"lease_{f.name}", None) is not None
        }
        if not overrides:
            return self
        if "duration" in overrides and "renew_interval" not in overrides:
            overrides["renew_interval"] = None
        raw = {f.name: getattr(self, f.name) for f in fields(self)} | overrides
        return validate(raw, where=f"task {getattr(task, 'name', task)!r}: ")


#: Every setting's default, by name without the ``leases_`` prefix.
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Settings)}

#: Names of the settings a task may override with ``lease_<name>``.
TASK_OPTIONS = tuple(f.name for f in fields(Settings) if f.metadata["per_task"])


def celery_key(name: str) -> str:
    """The setting ``name`` as a Celery app's configuration spells it: ``leases_<name>``."""
    return f"leases_{name}"


def validate(raw: dict[str, Any], *, where: str = "", spell: Spelling = celery_key) -> Settings:
    """Check raw values (names without the ``leases_`` prefix) and build Settings; an error
    names the setting as ``spell`` writes it (default ``leases_<name>``)."""
    values: dict[str, Any] = {}
    for f in fields(Settings):
        try:
            values[f.name] = f.metadata["check"](spell(f.name), raw.get(f.name, f.default))
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where}{exc}") from None
    values["engine_options"] = values["engine_options"] or {}
    values["databases"] = values["databases"] or {}
    rules = values["routes"]
    if isinstance(rules, dict):
        known = {"default", *values["databases"]}
        for kind, found in rules.items():
            for pattern, target in found.items():
                if target not in known:
                    raise ConfigurationError(
                        f"{where}{spell('routes')} sends {kind[:-1]} {pattern!r} to database "
                        f"{target!r}, which is not one of {sorted(known)} (name it in "
                        f"{spell('databases')})"
                    )
    duration = values["duration"]
    renew = values["renew_interval"] or duration / 3
    if renew >= duration:
        raise ConfigurationError(
            f"{where}{spell('renew_interval')} ({renew:g} s) must be shorter than "
            f"{spell('duration')} ({duration:g} s), or every lease expires before it is renewed"
        )
    values["renew_interval"] = renew
    if values["reap_grace"] is None:
        values["reap_grace"] = max(duration, 5.0)
    return Settings(**values)


def problems(raw: dict[str, Any], *, spell: Spelling = celery_key) -> list[str]:
    """Every reason :func:`validate` would refuse ``raw``, one per impossible setting (then
    the ones between settings), each naming its setting as ``spell`` writes it; empty when
    it accepts them."""
    found = []
    for f in fields(Settings):
        try:
            f.metadata["check"](spell(f.name), raw.get(f.name, f.default))
        except ConfigurationError as exc:
            found.append(str(exc))
    if not found:
        try:
            validate(raw, spell=spell)
        except ConfigurationError as exc:
            found.append(str(exc))
    return found


def redact(url: Any) -> str:
    """``url`` with its password replaced by ``***``, for messages and logs.

    Everything between the user name and the last ``@`` before the host is hidden, so a
    password holding ``@`` or ``:`` shows nothing of itself.
    """
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep or rest.startswith("/"):
        return text
    head, mark, query = rest.partition("?")
    userinfo, at, host = head.rpartition("@")
    if not at or ":" not in userinfo:
        return text
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}{mark}{query}"


def markdown_table() -> str:
    """The settings as a Markdown table: the docs' configuration page renders it at build time."""
    lines = ["| setting | task option | default | meaning |", "|---|---|---|---|"]
    for f in fields(Settings):
        option = f"`lease_{f.name}`" if f.metadata["per_task"] else ""
        lines.append(f"| `leases_{f.name}` | {option} | `{f.default!r}` | {f.metadata['doc']} |")
    return "\n".join(lines)


__all__ = [
    "DEFAULTS",
    "TASK_OPTIONS",
    "Settings",
    "celery_key",
    "markdown_table",
    "problems",
    "redact",
    "validate",
]
