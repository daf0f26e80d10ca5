"""Telling Celery how a job ended when no attempt did: given up, cancelled while queued, expired,
or, for the triggers of a lease key, served by a run of the key.

A job that ends inside an attempt gets its Celery state from Celery's own trace. One that ends
outside any (the reaper gives up on it, an operator cancels it while it waits, its message
expired) is marked in its row (``notify``), and :func:`announce` then stores the state Celery
would have stored, through the same result-backend calls Celery's worker makes: FAILURE fires
the errbacks, fails the rest of a chain and counts the chord part; REVOKED counts the chord
part. :meth:`Store.take_notices` hands each such job to one caller only.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from celery.app.task import Context
from celery.backends.base import DisabledBackend
from celery.exceptions import TaskRevokedError

from .db import store_for
from .db.rows import Job
from .db.schema import REVOKED_ENDS
from .errors import GaveUp
from .log import job_fields
from .message import EMBED

logger = logging.getLogger("celery_leases")


def request_of(job: Job) -> Context:
    """The request context a worker would build from the job's message."""
    message = job.message
    found: dict[str, Any] = dict(message.headers)
    found.update({k: message.embed.get(k) for k in EMBED})
    found.update(
        args=message.args,
        kwargs=message.kwargs,
        reply_to=message.properties.get("reply_to"),
        correlation_id=message.properties.get("correlation_id") or job.id,
        delivery_info={
            "exchange": message.exchange,
            "routing_key": message.routing_key,
            "priority": message.properties.get("priority"),
        },
    )
    return Context(found)


def announce(app: Any, job: Job) -> bool:
    """Store the Celery state ``job.notify`` for ``job`` in ``app``'s result backend; False
    when the backend refused (logged)."""
    if job.notify not in (states.REVOKED, states.FAILURE, states.SUCCESS):
        raise ValueError(f"job {job.id}: no Celery state to announce ({job.notify!r})")
    request = request_of(job)
    backend = app.backend
    store_result = not request.ignore_result
    try:
        if job.notify == states.SUCCESS:
            # The triggers a run of their key served: its result is theirs.
            if store_result:
                backend.mark_as_done(job.id, job.result, request=request)
        elif job.notify == states.REVOKED:
            backend.mark_as_revoked(
                job.id, job.error or "revoked", request=request, store_result=store_result
            )
        else:
            backend.mark_as_failure(
                job.id,
                GaveUp(f"job {job.id}: {job.error}"),
                request=request,
                store_result=store_result,
                call_errbacks=True,
            )
    except Exception as exc:  # a backend that is down or disabled: the row is the truth
        logger.error(
            "celery-leases: could not store %s of job %s: %r",
            job.notify,
            job.id,
            exc,
            extra=job_fields(job.id),
        )
        return False
    logger.info(
        "celery-leases: job %s (%s) stored as %s: %s",
        job.id,
        job.task,
        job.notify,
        job.error,
        extra=job_fields(job.id),
    )
    return True


def announce_pending(app: Any, store: Any, *, batch: int, max_batches: int = 10) -> list[str]:
    """Announce the jobs whose end the result backend has not been told; the ids told. One
    the backend refused keeps its mark for the next reaper pass."""
    told: list[str] = []
    for _ in range(max_batches):
        jobs = store.take_notices(batch=batch)
        for job in jobs:
            if announce(app, job):
                told.append(job.id)
            else:
                store.notify_again(job.id, job.notify)
        if len(jobs) < batch:
            break
    return told


def keep_revoked(task: Any, job_id: str) -> bool:
    """Store REVOKED again for ``job_id`` if its row ended as a revoke (``REVOKED_ENDS``:
    revoked, cancelled, superseded) and the result backend says RETRY or STARTED: an
    attempt's trace wrote over that REVOKED.

    Celery's retry sends the retry's message before it stores RETRY, so the retry can end
    in between (a worker discards its message as revoked or expired; a newer trigger of its
    key supersedes it) and REVOKED be stored before the retrying trace stores RETRY, and a
    client in ``AsyncResult.get()`` would wait forever. Run after each of the two writes
    (the revoke's, in the main process; the retry's), it sees the second one. The state
    only: the chord part was counted, and REVOKED fires no errback. True when stored."""
    backend = task.backend
    if isinstance(backend, DisabledBackend) or not backend.persistent or task.ignore_result:
        return False  # (the RPC backend's states are messages to the client, read once)
    try:
        if backend.get_state(job_id) not in (states.RETRY, states.STARTED):
            return False
        job = store_for(task.lease_settings).get(job_id)
        if job is None or job.state not in REVOKED_ENDS:
            return False
        backend.store_result(job_id, TaskRevokedError(job.error or job.state), states.REVOKED)
    except Exception as exc:  # the backend or the database is down: the row is the truth
        logger.info(
            "celery-leases: job %s: could not check its state in the result backend: %r",
            job_id,
            exc,
            extra=job_fields(job_id),
        )
        return False
    logger.warning(
        "celery-leases: job %s is %s, but a retry stored RETRY in the result backend after "
        "it; REVOKED stored again",
        job_id,
        job.state,
        extra=job_fields(job_id),
    )
    return True
