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

from typing import Any

from ...db.joined import Joined
from . import database

#: Attribute of a Django connection wrapper holding what the store keeps per connection.
_INFO = "_celery_leases_info"


def ambient(store: Any) -> Joined | None:
    """Django's transaction this thread is in on the leases' database, when the leases live in
    a Django database; None otherwise."""
    from django.db import connections

    if not database.in_django_database(store.settings.database_url):
        return None
    connection = connections[database.alias()]
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
        connection = connections[database.alias()]
    except Exception:  # Django not set up, or no such database any more
        return
    info = connection.__dict__.get(_INFO)
    if not info or connection.connection is None or connection.in_atomic_block:
        return
    try:
        store.unguard_idle_writes(store.foreign(connection.connection, info))
    except Exception:  # a broken connection: Django replaces it, and the setting with it
        info.clear()
