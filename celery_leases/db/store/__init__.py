"""The lease store: the operations celery-leases performs on its jobs table.

Each operation binds values, runs one named statement (``db/statements``) on the database
(``engine.py``, ``dbapi.py``) and maps the rows (``rows.py``); where databases differ it asks
the dialect (``db/dialects``). The operations are grouped by who calls them: clients
(``client.py``), a worker's attempts (``worker.py``), operators (``operator.py``) and the
reaper (``reaper.py``). Every worker operation (claim, renew tick, checkpoint, finish, fail,
hand back) is one conditional statement whose returned rows (or row count) tell the outcome.
"""

from __future__ import annotations

import dataclasses
import json
import threading

from ...settings import TASK_OPTIONS, Settings
from .client import Registered
from .groups import Admitted, GroupOps, GroupRow
from .heartbeat import BeatOps
from .operator import OperatorOps, like_prefix
from .reaper import ReaperOps
from .worker import IDLE_WRITE_GUARD, AttemptOps


class Store(AttemptOps, OperatorOps, ReaperOps, GroupOps, BeatOps):
    """Operations on the jobs table of one database. Safe to share between threads."""


_stores: dict[tuple[str, ...], Store] = {}
_stores_lock = threading.Lock()


def store_for(settings: Settings) -> Store:
    """The shared Store of these settings (one engine per process and database)."""
    # Every app-wide setting is in the key (the store reads some: bind_session,
    # max_attempts), so settings changed at run time get a store of their own; a task's own
    # options (its lease duration) are not, so they share the store of their database.
    key = tuple(
        json.dumps(getattr(settings, f.name), sort_keys=True, default=repr)
        for f in dataclasses.fields(settings)
        if f.name not in TASK_OPTIONS
    )
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = Store(settings)
        return store


__all__ = [
    "IDLE_WRITE_GUARD",
    "Admitted",
    "GroupRow",
    "Registered",
    "Store",
    "like_prefix",
    "store_for",
]
