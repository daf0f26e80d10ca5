"""Reading jobs from an application."""

from __future__ import annotations

from typing import Any

from .config import settings_for
from .store import Job, store_for


def get_job(app: Any, job_id: str) -> Job | None:
    """The job recorded under ``job_id`` in ``app``'s leases table, or None.

    The :class:`Job` has its state, checkpoint, attempts, token, owner and ``expires_in``
    (seconds left on the lease by the database clock).
    """
    return store_for(settings_for(app)).get(job_id)
