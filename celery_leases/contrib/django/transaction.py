"""Django's transactions, as the store joins them (``db.joined``).

Inside ``transaction.atomic()`` on the database the leases live in (at any depth), every fenced
write of an attempt (a checkpoint, a key's cursor) runs on Django's own DBAPI connection, in
the transaction the ORM writes went into: the ORM writes and the write commit together, and a
stale attempt's write raises ``LeaseLost`` inside the block, which rolls the ORM writes back. On
PostgreSQL the write bounds the transaction's idle time by the lease; on MariaDB the connection
gets that bound, given back when the task ends. A task run inside a transaction it did not open
(``task.apply()`` in a ``TestCase``, or eagerly inside ``ATOMIC_REQUESTS``) joins it with every
write, its claim and end included (``attempt.Attempt.outer_transaction``).

Django's connection wrapper passed as ``connection=`` is joined the same way.
"""

from __future__ import annotations

import threading
from typing import Any

from ...db.joined import Joined
from ...errors import ConfigurationError
from . import database

#: Attribute of a Django connection wrapper holding what the store keeps per connection.
_INFO = "_celery_leases_info"


def ambient(store: Any) -> Joined | None:
    """Django's transaction this thread is in on the leases' database, when the leases live in
    a Django database (``database.joinable_alias``); None otherwise."""
    from django.db import connections

    if not any(c.in_atomic_block for c in connections.all(initialized_only=True)):
        return None  # the usual case, and the cheapest to tell
    name = database.joinable_alias(store.settings.database_url)
    if name is None:
        return None
    connection = connections[name]
    if not connection.in_atomic_block:
        return None
    return _joined(store, connection)


def unwrap(connection: Any) -> Any:
    """The DBAPI connection behind Django's connection wrapper ``connection``, or None."""
    from django.db.backends.base.base import BaseDatabaseWrapper

    if not isinstance(connection, BaseDatabaseWrapper):
        return None
    connection.ensure_connection()
    return connection.connection


def _joined(store: Any, connection: Any) -> Joined:
    connection.ensure_connection()
    info = connection.__dict__.setdefault(_INFO, {})
    return Joined(store.foreign(connection.connection, info), info)


def release(store: Any) -> None:
    """A task ended: give Django's connection the idle-write bound it had (MariaDB), if a
    joined write set one."""
    from django.db import connections

    try:
        name = database.joinable_alias(store.settings.database_url)
        if name is None:
            return
        connection = connections[name]
    except Exception:  # Django not set up, or no such database any more
        return
    info = connection.__dict__.get(_INFO)
    if not info or connection.connection is None or connection.in_atomic_block:
        return
    try:
        store.unguard_idle_writes(store.foreign(connection.connection, info))
    except Exception:  # a broken connection: Django replaces it, and the setting with it
        info.clear()


# -- a checkpoint that cannot join the block it is in ---------------------------------------

#: task id -> {alias: atomic() depth} when its attempt started, in this thread: the blocks it
#: started inside (a ``TestCase``'s, a request's) are not the task's own.
_started: threading.local = threading.local()


def note_start(task_id: Any = None, **_: Any) -> None:
    """``task_prerun``: remember how deep in ``atomic()`` each Django connection is as the
    task starts."""
    from django.db import connections

    depths = _started.__dict__.setdefault("depths", {})
    depths[task_id] = {
        c.alias: len(c.atomic_blocks) for c in connections.all(initialized_only=True)
    }


def forget_start(task_id: Any = None, **_: Any) -> None:
    """``task_postrun``: the task ended."""
    _started.__dict__.get("depths", {}).pop(task_id, None)


def refuse_unjoined(store: Any, lease: Any) -> None:
    """A write of ``lease``'s attempt (a checkpoint, a key's cursor) that joins no transaction:
    refuse it when the task is inside an ``atomic()`` block of its own that the write cannot
    join (the block is on another database than the leases'). The write would commit on its
    own, before the block: a crash between the two would record the block's work as done
    while it rolled back, a unit lost for good."""
    from django.db import connections

    started = _started.__dict__.get("depths", {}).get(lease.job_id, {})
    for connection in connections.all(initialized_only=True):
        if len(connection.atomic_blocks) > started.get(connection.alias, 0):
            raise ConfigurationError(_unjoinable(store, connection.alias))


def _unjoinable(store: Any, name: str) -> str:
    url = store.settings.database_url
    leases = database.alias_of(url)
    routed = next((n for n, each in store.settings.databases.items() if each == url), None)
    if routed is not None:  # a job of a database of CELERY_LEASES_DATABASES (its route's)
        joinable = database.joinable_alias(url)
        if joinable is not None:
            how = f"open the block with transaction.atomic(using={joinable!r})"
        elif leases is not None:
            how = (
                f"its URL there names DATABASES[{leases!r}] through another driver than "
                f"Django's: give it Django's driver, and open the block with "
                f"transaction.atomic(using={leases!r})"
            )
        else:
            how = "add that database to DATABASES and open the block on its alias"
        lives = (
            f"this job lives in leases database {routed!r} of CELERY_LEASES_DATABASES "
            f"({store.safe_url})"
        )
        advice = f"A checkpoint joins a block on the database its job lives in: {how}; or"
    else:
        where = (
            f"DATABASES[{leases!r}] through another driver ({store.safe_url})"
            if leases is not None
            else f"another database ({store.safe_url})"
        )
        lives = f"the leases live in {where}"
        advice = (
            f"Keep the leases in that database (leave CELERY_LEASES_DATABASE_URL unset and set "
            f"CELERY_LEASES_DATABASE_ALIAS = {name!r}), or"
        )
    return (
        f"a checkpoint inside transaction.atomic() on database {name!r} cannot commit with the "
        f"block: {lives}, so it would commit on its own, before the block, and a crash between "
        f"the two would lose the block's work for good. {advice} call self.checkpoint() after "
        f"the block (a crash then redoes the block's work: make it idempotent)"
    )
