"""Routes: which leases database holds a job, when an app has more than one.

``leases_databases`` names databases beside ``leases_database_url`` (named ``'default'``);
``leases_routes`` says which jobs live in each: by queue, by task name, or with a callable (as
Django's database routers do). The client records a job in its route's database and writes
the route's name in the message (``ROUTE_HEADER``), so every later step (the claim, the
renewals, the reaper's re-publish, an operator's command) finds the job where it lives, even
after the routes change. A message without the header (one sent by name) is routed at its
claim, by its task name and the queue it came from.

Code that acts on one job runs inside :func:`using`: ``LeasedTask.lease_settings`` and
``lease_store`` then give that database's. Code that acts on every job (the reaper, the CLI,
a starting worker, the metrics) goes over :func:`stores`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from fnmatch import fnmatchcase
from typing import Any

from .db import Store, store_for
from .errors import ConfigurationError, LeaseError, StoreUnavailable
from .message import ROUTE_HEADER
from .settings import Settings

#: The name of ``leases_database_url`` among the databases.
DEFAULT = "default"

_active: ContextVar[str | None] = ContextVar("celery_leases_route", default=None)
_on: dict[tuple[int, str], tuple[Settings, Settings]] = {}
_on_lock = threading.Lock()


def routed(settings: Settings) -> bool:
    """Whether ``settings`` name more than one database or route jobs at all."""
    return bool(settings.databases) or settings.routes is not None


def names(settings: Settings) -> list[str]:
    """The names of every leases database: ``'default'`` first."""
    return [DEFAULT, *settings.databases]


def on(settings: Settings, name: str) -> Settings:
    """``settings`` with database ``name``'s URL as their ``database_url``."""
    if name == DEFAULT:
        return settings
    key = (id(settings), name)
    found = _on.get(key)
    if found is not None and found[0] is settings:
        return found[1]
    url = settings.databases.get(name)
    if url is None:
        # Unreachable from here, not wrong: a worker of a rolling deploy that does not know
        # the database yet delivers the job again later, for one that does.
        raise StoreUnavailable(
            f"the job lives in leases database {name!r}, which this process's "
            f"leases_databases does not name (it names {names(settings)}): give every "
            f"worker, beat and client the new database before routing jobs to it, and keep "
            f"one until `celery -A proj leases list --database {name}` shows no job in it"
        )
    with _on_lock:
        result = dataclasses.replace(settings, database_url=url)
        _on[key] = (settings, result)
    return result


def route(settings: Settings, task_name: str, queue: str | None) -> str:
    """The database a new job of ``task_name`` sent to ``queue`` lives in (``leases_routes``:
    task names first, then queues; ``'default'`` when no rule names it)."""
    rules = settings.routes
    if rules is None:
        return DEFAULT
    if callable(rules):
        found = rules(task_name, queue)
        if found is None:
            return DEFAULT
        if found != DEFAULT and found not in settings.databases:
            raise ConfigurationError(
                f"leases_routes sent task {task_name!r} (queue {queue!r}) to database "
                f"{found!r}, which is not one of {names(settings)}"
            )
        return str(found)
    for pattern, target in rules.get("tasks", {}).items():
        if fnmatchcase(task_name, pattern):
            return str(target)
    if queue is not None:
        return str(rules.get("queues", {}).get(queue, DEFAULT))
    return DEFAULT


def queue_of(app: Any, exchange: str | None, routing_key: str | None) -> str | None:
    """The name of the queue a message sent to ``exchange`` with ``routing_key`` goes to: the
    app's queue bound so, else the routing key (Celery names a queue it creates after it)."""
    if not routing_key:
        return None
    topical = None
    for queue in app.amqp.queues.values():
        bound = queue.exchange.name if queue.exchange is not None else ""
        if exchange and bound != exchange:
            continue
        if queue.routing_key == routing_key:
            return str(queue.name)
        if (
            topical is None
            and exchange
            and getattr(queue.exchange, "type", None) == "topic"
            and _topic_matches(queue.routing_key or "", routing_key)
        ):
            topical = str(queue.name)  # the first queue whose binding pattern matches
    return topical if topical is not None else routing_key


@functools.lru_cache(maxsize=1024)
def _topic_matches(pattern: str, key: str) -> bool:
    """Whether a topic exchange bound with ``pattern`` routes ``key`` to its queue, as AMQP
    has it: ``*`` one word, ``#`` zero or more words."""
    return _words_match(tuple(pattern.split(".")), tuple(key.split(".")))


def _words_match(pattern: tuple[str, ...], key: tuple[str, ...]) -> bool:
    if not pattern:
        return not key
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_words_match(rest, key[i:]) for i in range(len(key) + 1))
    return bool(key) and head in ("*", key[0]) and _words_match(rest, key[1:])


def split_call(task: str, queue: str | None, name: str, home: str) -> ConfigurationError:
    """The refusal of a call of keyed or grouped ``task`` sent to ``queue``, routed to
    database ``name``, not to the task's ``home``."""
    return ConfigurationError(
        f"task {task} sent to queue {queue!r}: its jobs have a lease key or a group, whose "
        f"jobs must all live in one leases database, but the queue's route is database "
        f"{name!r} and the task's own is {home!r}; route the task by its name (leases_routes "
        f"'tasks'), not by queue"
    )


def named(settings: Settings, headers: Any) -> str | None:
    """The database a message's ``leases_database`` header names (where its job was
    recorded: the routes of now are not asked), or None; :class:`StoreUnavailable` for a name
    this app does not know, with what to do."""
    name = (headers or {}).get(ROUTE_HEADER)
    if not name:
        return None
    on(settings, str(name))
    return str(name)


def of_message(settings: Settings, job_id: str, *, routed_to: str, recorded: bool) -> str:
    """The database of the job of a message whose header names none (:func:`named` first):
    for a message built from a recorded one (``recorded``: it carries a version, yet no
    database: recorded before the app had routes, or re-sent by Celery without its custom
    headers), the database that holds the job; else ``routed_to``, its route (a message sent
    by name: its claim records it there)."""
    if recorded:
        found = locate(settings, job_id, first=routed_to)
        if found is not None:
            return found
    return routed_to


def split_keys(app: Any) -> list[str]:
    """Why ``app``'s routes would split a lease key's or a group's jobs over two databases:
    two leased tasks with the same ``lease_key`` (or ``lease_group``) whose own routes differ.
    (A call sent to a queue routed elsewhere than its task is refused when it is sent.)"""
    owners: dict[tuple[str, str], dict[str, list[str]]] = {}
    for task in app.tasks.values():
        if not getattr(task, "__celery_leases__", False):
            continue
        for kind in ("lease_key", "lease_group"):
            shared = getattr(task, kind, None)
            if isinstance(shared, str):
                home = task.lease_home()
                owners.setdefault((kind, shared), {}).setdefault(home, []).append(task.name)
    return [
        f"tasks with {kind} {shared!r} live in different leases databases ("
        + "; ".join(f"{name}: {', '.join(sorted(tasks))}" for name, tasks in sorted(by.items()))
        + "): a key's or a group's jobs must live in one; route these tasks to one database"
        for (kind, shared), by in sorted(owners.items())
        if len(by) > 1
    ]


def active() -> str | None:
    """The database of the job this code acts on (None outside :func:`using`)."""
    return _active.get()


@contextmanager
def using(name: str | None) -> Iterator[None]:
    """Inside: ``lease_settings`` and ``lease_store`` of every task are database ``name``'s
    (None: each task's own route)."""
    token = _active.set(name)
    try:
        yield
    finally:
        _active.reset(token)


def stores(settings: Settings) -> list[tuple[str, Store]]:
    """Every leases database's name and store, ``'default'`` first."""
    return [(name, store_for(on(settings, name))) for name in names(settings)]


def locate(settings: Settings, job_id: str, *, first: str | None = None) -> str | None:
    """The name of the database that holds job ``job_id`` (``first`` is asked first), or None
    when none does. A database that cannot answer is skipped when another one holds the job,
    and its error raised when none does."""
    order = names(settings)
    if first in order:
        order.remove(first)
        order.insert(0, first)
    error: LeaseError | None = None
    for name in order:
        try:
            if store_for(on(settings, name)).get(job_id) is not None:
                return name
        except LeaseError as exc:
            error = exc
    if error is not None:
        raise error
    return None


__all__ = [
    "DEFAULT",
    "ROUTE_HEADER",
    "active",
    "locate",
    "named",
    "names",
    "of_message",
    "on",
    "queue_of",
    "route",
    "routed",
    "split_call",
    "split_keys",
    "stores",
    "using",
]
