"""A checkpoint inside ``transaction.atomic()`` joins Django's transaction.

The fenced checkpoint statement runs on Django's own DBAPI connection, in the transaction the
ORM writes went into: one statement, as with ``checkpoint(..., connection=conn)`` (on
PostgreSQL it carries the same idle-in-transaction bound; on MariaDB the connection gets the
same idle-write bound, given back when the task ends). So the ORM writes and the checkpoint
commit together, and a stale attempt's checkpoint raises ``LeaseLost`` inside the block, which
rolls its ORM writes back.
"""

from __future__ import annotations

from typing import Any

from ...db.dbapi import Foreign
from . import database

#: Attribute of a Django connection wrapper holding what the store keeps per connection.
_INFO = "_celery_leases_info"


def joined(task: Any) -> Foreign | None:
    """Django's connection, when ``task``'s leases live in the Django database and that
    connection is inside ``transaction.atomic()``; None otherwise (the checkpoint then runs
    on its own, as outside Django)."""
    from django.db import connections

    store = task.lease_store
    if not database.in_django_database(store.settings.database_url):
        return None
    connection = connections[database.alias()]
    if not connection.in_atomic_block:
        return None
    connection.ensure_connection()
    info = connection.__dict__.setdefault(_INFO, {})
    return store.foreign(connection.connection, info)


def release(task: Any) -> None:
    """The task ended: give Django's connection the idle-write bound it had (MariaDB), if a
    joined checkpoint set one."""
    from django.db import connections

    try:
        connection = connections[database.alias()]
    except Exception:  # Django not set up, or no such database any more
        return
    info = connection.__dict__.get(_INFO)
    if not info or connection.connection is None or connection.in_atomic_block:
        return
    foreign = task.lease_store.foreign(connection.connection, info)
    try:
        task.lease_store.unguard_idle_writes(foreign)
    except Exception:  # a broken connection: Django replaces it, and the setting with it
        info.clear()
