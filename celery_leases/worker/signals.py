"""The worker's signals: hand leases back at shutdown, fail jobs of tasks no worker knows, and
record what Celery decided about a leased job in the worker's main process (revoked,
expired, timed out)."""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Any

from celery import current_app
from celery.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    task_retry,
    task_revoked,
    task_unknown,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from .. import lifecycle, notice, routes
from ..config import settings_for, uses_leases
from ..db import store_for
from ..db.migrations import upgrade
from ..errors import LeaseError
from ..log import job_fields, lease_fields
from ..process import owner_prefix
from ..states import State
from .deaths import deaths
from .keeper import all_keepers
from .limits import execution_ends, execution_starts

logger = logging.getLogger("celery_leases")

#: Set in a worker's main process once it is shutting down: a leased job's message it
#: receives from then on goes back to the queue for another worker (``LeasedRequest``).
SHUTTING_DOWN = threading.Event()


def migrate_on_start(sender: Any = None, **_: Any) -> None:
    """``leases_migrate_on_start``: create or upgrade the leases table before the worker
    consumes (its main process, before the pool starts)."""
    app = getattr(sender, "app", None) or current_app
    if not uses_leases(app):
        return
    try:
        settings = settings_for(app)
        if settings.migrate_on_start:
            for name, store in routes.stores(settings):
                shown = "" if not routes.routed(settings) else f"database {name}: "
                logger.warning("celery-leases: %s%s", shown, upgrade(store).describe())
    except LeaseError as exc:
        logger.error("celery-leases: leases_migrate_on_start failed: %s", exc)


def replace_dead_processes_at_once(sender: Any = None, **_: Any) -> None:
    """A prefork worker's main process: when a pool process that ran a leased job dies
    (``deaths.Deaths`` sees it at once and sends the job again), billiard replaces it now, on
    the worker's event loop, instead of at its own check (every 5 s). Otherwise a job sent
    again to this same worker could wait for it, when the dead process was its only one."""
    hub = getattr(sender, "hub", None)
    app = getattr(sender, "app", None)
    if hub is None or app is None or not uses_leases(app):
        return
    consumer = sender

    def maintain() -> None:  # on the event loop, where an error must not stop the worker
        pool = getattr(getattr(consumer, "pool", None), "_pool", None)  # the AsynPool now
        maintain_pool = getattr(pool, "maintain_pool", None)
        if maintain_pool is None:
            return
        logger.info("celery-leases: a pool process died; the pool replaces it now")
        try:
            maintain_pool()
        except Exception:  # billiard's own check, every 5 s, tries again
            logger.exception("celery-leases: replacing a dead pool process failed")

    deaths().after_death = lambda: hub.call_soon(maintain)


def release_on_process_shutdown(**_: Any) -> None:
    """A pool process is exiting with leases held: release them so they are reaped at once."""
    for keeper in all_keepers():
        keeper.stop()
        for lease in keeper.held():
            if lease.released or lease.lost:
                continue
            try:
                lifecycle.let_go(keeper.store, lease.job_id, lease.token)
                lease.released = True
                logger.warning(
                    "celery-leases: job %s released at process shutdown",
                    lease.job_id,
                    extra=lease_fields(lease),
                )
            except LeaseError as exc:
                logger.warning(
                    "celery-leases: could not release job %s: %s",
                    lease.job_id,
                    exc,
                    extra=lease_fields(lease),
                )
        keeper.retire()


def preempt_on_shutdown(sender: Any = None, **_: Any) -> None:
    """Warm shutdown: ask this worker's running attempts to stop at their next checkpoint."""
    app = current_app
    # Every `celery` command imports this package (its CLI plugin): act only for leased apps.
    if not uses_leases(app):
        return
    SHUTTING_DOWN.set()
    try:
        settings = settings_for(app)
        if not settings.preempt_on_shutdown:
            return
    except LeaseError as exc:
        logger.warning("celery-leases: could not preempt running jobs: %s", exc)
        return
    count = 0
    for name, store in routes.stores(settings):
        try:
            count += lifecycle.preempt(store, owner_prefix(sender))
        except LeaseError as exc:  # that database is down: its jobs move when their leases end
            logger.warning(
                "celery-leases: could not preempt running jobs in database %s: %s", name, exc
            )
    if count:
        logger.warning(
            "celery-leases: %d running job(s) will hand back at their next checkpoint", count
        )


def wait_for_a_worker_that_knows(
    sender: Any = None, name: str = "", id: str = "", **_: Any
) -> None:
    """A message for a task this worker does not know (an older worker of a rolling deploy):
    Celery discards it. A leased job waits for a worker that knows the task: the reaper sends
    it again after ``leases_reap_grace``, then with doubling waits (up to 64 times it),
    never failing it for a worker that lacks its code. A running job is left alone (its
    message was a copy)."""
    app = getattr(sender, "app", None) or current_app
    if not uses_leases(app) or not id:
        return
    hostname = getattr(sender, "hostname", None) or "this worker"
    reason = f"waiting for a worker that knows task {name!r} ({hostname} does not)"
    try:
        settings = settings_for(app)
        found = routes.locate(settings, id) if routes.routed(settings) else routes.DEFAULT
        waits = found is not None and lifecycle.wait_for_worker(
            store_for(routes.on(settings, found)), id, wait=settings.reap_grace, error=reason
        )
    except LeaseError as exc:
        logger.warning(
            "celery-leases: job %s of unknown task %r: %s", id, name, exc, extra=job_fields(id)
        )
        return
    if waits:
        logger.warning(
            "celery-leases: job %s: %s; it is sent again in %.0f s",
            id,
            reason,
            settings.reap_grace,
            extra=job_fields(id),
        )


def record_revoke(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    """Celery revoked a leased job in this worker's main process (discarded its message as
    revoked or expired, or terminated it): the job ends ``revoked`` for good, so no reaper,
    redelivery or restarted worker (whose revoked list was in memory) runs it again. Celery
    has stored REVOKED in the result backend."""
    job_id = getattr(request, "id", None)
    if not _is_leased(sender) or not job_id:
        return
    how = "expired" if expired else "terminated" if terminated else "revoked"
    error = f"{how} in Celery ({getattr(request, 'hostname', None)})"
    # An expired copy of the message of a job an attempt runs under a live lease (the reaper
    # sent it again meanwhile) leaves that attempt alone, as Celery does a running task.
    with routes.using(_route_of(sender, job_id)):
        end_job(sender, job_id, State.REVOKED, error, unheld_only=expired)
        notice.keep_revoked(sender, job_id)


def keep_revoked_after_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A leased job's retry stored RETRY: if a worker revoked the job meanwhile (discarded the
    retry's message as expired, say), REVOKED again (``notice.keep_revoked``)."""
    job_id = getattr(request, "id", None)
    if _is_leased(sender) and job_id:
        with routes.using(_route_of(sender, job_id)):
            notice.keep_revoked(sender, job_id)


def record_failure_in_main_process(
    sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any
) -> None:
    """A leased job's FAILURE decided in the worker's main process (a hard time limit, a
    rejected message, a lost pool process past max_retries): the job ends ``failed`` as the
    result backend says. Failures inside the task are recorded by its attempt."""
    if not _is_leased(sender) or not task_id or _in_pool_process():
        return
    text = "".join(traceback.format_exception_only(type(exception), exception)).strip()
    end_job(sender, task_id, State.FAILED, f"failed in the worker's main process: {text}")


def end_job(task: Any, job_id: str, state: State, error: str, *, unheld_only: bool = False) -> None:
    """End a live job of ``task`` as Celery decided it (``lifecycle.end_in_celery``;
    ``unheld_only``: unless an attempt holds it under a live lease), its end handed on."""
    with routes.using(routes.active() or _route_of(task, job_id)):
        lifecycle.end_in_celery(
            task.app, store_for(task.lease_settings), job_id, state, error, unheld_only=unheld_only
        )


def _route_of(task: Any, job_id: str) -> str | None:
    """The database of job ``job_id`` of ``task`` when the main process has no message of it
    to read (None: the task's own; without routes, the only one). Asks each database: these
    are rare events (a revoke, a hard time limit). A database that is down and may hold the
    job raises its error, as the only database would."""
    settings = task._lease_cache().settings
    if not routes.routed(settings):
        return None
    return routes.locate(settings, job_id)


def _is_leased(task: Any) -> bool:
    return bool(getattr(task, "__celery_leases__", False))


def _in_pool_process() -> bool:
    try:
        from billiard.process import current_process
    except ImportError:
        return False
    return bool(current_process().name != "MainProcess")


#: Each signal and the receiver ``worker.connect`` connects to it.
RECEIVERS = (
    (worker_init, migrate_on_start),
    (worker_ready, replace_dead_processes_at_once),
    (worker_process_shutdown, release_on_process_shutdown),
    # A threads, solo or gevent pool runs its tasks (and its keeper) in the main process,
    # which has no worker_process_shutdown: its holder row and mark go at the worker's end.
    (worker_shutdown, release_on_process_shutdown),
    (worker_shutting_down, preempt_on_shutdown),
    (task_unknown, wait_for_a_worker_that_knows),
    (task_revoked, record_revoke),
    (task_retry, keep_revoked_after_retry),
    (task_failure, record_failure_in_main_process),
    # A leased execution gets its soft time limit once (billiard resends it at shutdown).
    (task_prerun, execution_starts),
    (task_postrun, execution_ends),
)
