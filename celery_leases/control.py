"""What a user or an operator does to an app's leases: migrate the table, read a job, and act on
one (retry, cancel, release). The ``celery leases`` commands and the Django admin call these;
each action goes through the store's conditional operations (never a raw edit of the row) and
returns one line saying what happened, or raises :class:`LeaseError`
(:class:`InvalidJobState` when the job is not in a state that allows it).
"""

from __future__ import annotations

import json
from typing import Any

from . import lifecycle, routes
from .config import settings_for
from .db import Store, store_for
from .db.migrations import Migrated, upgrade
from .db.rows import Job, dumps
from .errors import ArgumentsError, InvalidJobState


def migrate(app: Any, *, revision: str = "head") -> Migrated:
    """Create or upgrade the leases table of the Celery ``app`` (its ``leases_*`` settings) up
    to ``revision``: what ``celery -A proj leases upgrade`` runs. Safe to run again, and from
    several processes at once. With ``leases_databases``, every database's table is; the
    default database's outcome is returned."""
    done = [upgrade(store, revision=revision) for _, store in routes.stores(settings_for(app))]
    return done[0]


def get_job(app: Any, job_id: str) -> Job | None:
    """The job recorded under ``job_id`` in ``app``'s leases table, or None.

    The :class:`Job` has its state, checkpoint, attempts, token, owner and ``expires_in``
    (seconds left on the lease by the database clock). With ``leases_databases``, each
    database is asked in turn.
    """
    settings = settings_for(app)
    found = routes.locate(settings, job_id) if routes.routed(settings) else routes.DEFAULT
    return None if found is None else store_for(routes.on(settings, found)).get(job_id)


def retry(app: Any, store: Store, job_id: str) -> str:
    """Queue a ``failed`` or ``cancelled`` job again and publish its message: it resumes from
    its checkpoint. A publish that fails leaves the job cancelled, to be retried again. A job
    of a group waits for its admission again, as a new call of its group would."""
    return lifecycle.requeue(app, store, job_id, queued_timeout=settings_for(app).queued_timeout)


def cancel(app: Any, store: Store, job_id: str) -> str:
    """Cancel a job: a waiting or queued one will not run (the result backend is told
    REVOKED; an admitted one of a group hands its room to the group's next waiting job), a
    running one stops at its next checkpoint and ends ``cancelled`` (its worker then admits
    the next)."""
    return lifecycle.cancel(app, store, job_id)


def set_cursor(store: Store, key: str, text: str | None) -> str:
    """Set the cursor of lease key ``key`` to ``text`` (the store's JSON text; None clears
    it: the key's next run starts afresh). Only while no job holds the key (none queued or
    running, no follow-up waiting to start): else :class:`InvalidJobState`, nothing written."""
    if not store.set_cursor(key, text):
        raise InvalidJobState(
            f"lease key {key!r} is held by a job (queued, running, or with a follow-up to "
            f"start); its cursor is left as it is: cancel the job or let it end, then try again"
        )
    return f"cursor of {key!r} {'cleared' if text is None else 'set to ' + text}"


def cursor_text(value: str) -> str:
    """``value`` (JSON an operator typed) as the store's JSON text; :class:`ArgumentsError`
    saying why when it is not JSON (NaN and Infinity included)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    try:
        return dumps(json.loads(value, parse_constant=refuse))
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ArgumentsError(f"not JSON ({why})") from None


def release(store: Store, job_id: str) -> str:
    """Expire a running job's lease now (its host is dead): the next reaper pass publishes
    the job again, to resume elsewhere."""
    return lifecycle.release(store, job_id)
