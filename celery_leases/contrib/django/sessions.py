"""What celery-leases holds on a Django database, let go when Django lets that database go.

A process keeps connections to the leases database besides Django's own: the store's pool and
its direct connections (a ``.delay()``, the admin, ``manage.py migrate``), and a keeper's
session (an attempt run in this process, ``task.apply()``). Django's test runner drops its test
database at the end (``destroy_test_db``), and copies it for ``--parallel`` (PostgreSQL's
``CREATE DATABASE ... TEMPLATE``): both refuse while another session is connected, and both
close Django's connection first. So whenever a Django connection closes (``close()``, which
``close_old_connections`` calls at the end of a request when ``CONN_MAX_AGE`` has run out, and
which the test runner calls before it drops or copies the database), the connections of
celery-leases to that same database close too: the pool's and the direct ones idle now, and
the session of a keeper that holds no lease (a lease held means an attempt is running: its
session stays, or the reaper would take its job for abandoned).

Not while a Celery task runs in the thread that closes (``celery.current_task``): Celery's
Django fixup closes Django's connections around every task a worker runs, and the worker's
keeper, session and pool are the worker's, kept for its life (released at its shutdown);
closing them per task would cost a connection and a holder row each time. The same holds for
a task body that calls ``close_old_connections()`` itself.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import sqlalchemy as sa
from celery import current_task

from ...errors import LeaseError
from . import database

logger = logging.getLogger("celery_leases")

_installed = threading.Lock()
#: Marks the close() wrapper installed on Django's connection class.
_MARK = "__celery_leases_release__"


def install() -> None:
    """Release celery-leases' connections when a Django connection closes (the app's
    ``ready()``): once per process, for every database backend."""
    from django.db.backends.base.base import BaseDatabaseWrapper

    with _installed:
        close = BaseDatabaseWrapper.close
        if getattr(close, _MARK, False):
            return

        @functools.wraps(close)
        def close_and_release(self: Any) -> None:
            try:
                if not current_task:  # a worker's task: see above
                    release(self.alias)
            finally:
                close(self)

        setattr(close_and_release, _MARK, True)
        BaseDatabaseWrapper.close = close_and_release


def release(alias: str) -> int:
    """Close this process's connections of celery-leases to the database of Django's
    ``alias``: idle pool and direct connections, and the sessions of keepers holding no
    lease. How many stores and keepers let go."""
    from ...db.store import _stores  # the process's stores, one per database and settings
    from ...worker.keeper import _keepers, _keepers_lock, all_keepers

    try:
        url = sa.engine.make_url(database.url_for(alias))
    except Exception:  # an in-memory SQLite database, an engine celery-leases cannot use
        return 0
    released = 0
    for keeper in all_keepers():
        if keeper.held() or not database.same_database(keeper.store.db.url, url):
            continue
        try:
            keeper.retire()
        except LeaseError as exc:  # the reaper deletes the holder row once its session is gone
            logger.warning("celery-leases: could not retire this process's keeper: %s", exc)
        with _keepers_lock:
            for key, found in list(_keepers.items()):
                if found is keeper:
                    del _keepers[key]
        released += 1
    for store in list(_stores.values()):
        if database.same_database(store.db.url, url):
            store.db.close()
            released += 1
    return released


__all__ = ["install", "release"]
