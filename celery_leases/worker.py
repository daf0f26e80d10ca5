"""The worker's signals: hand leases back at shutdown, fail jobs of tasks no worker knows."""

from __future__ import annotations

import logging
from typing import Any

from celery import current_app
from celery.signals import task_unknown, worker_process_shutdown, worker_shutting_down

from .config import settings_for
from .errors import LeaseError
from .keeper import all_keepers
from .store import store_for

logger = logging.getLogger("celery_leases")


@worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def release_on_process_shutdown(**_: Any) -> None:
    """A pool process is exiting with leases held: release them so they are reaped at once."""
    for keeper in all_keepers():
        keeper.stop()
        for lease in keeper.held():
            if lease.released or lease.lost:
                continue
            try:
                keeper.store.hand_back(lease.job_id, lease.token, reap_in=0.0)
                lease.released = True
                logger.warning("celery-leases: job %s released at process shutdown", lease.job_id)
            except LeaseError as exc:
                logger.warning("celery-leases: could not release job %s: %s", lease.job_id, exc)


@worker_shutting_down.connect(weak=False)  # type: ignore[untyped-decorator]
def preempt_on_shutdown(sender: Any = None, **_: Any) -> None:
    """Warm shutdown: ask this worker's running attempts to stop at their next checkpoint."""
    app = current_app
    # Every `celery` command imports this package (its CLI plugin): act only for leased apps.
    if not _uses_leases(app):
        return
    try:
        settings = settings_for(app)
        if not settings.preempt_on_shutdown:
            return
        count = store_for(settings).request_stop_owned_by(f"{sender}/", "preempt")
    except LeaseError as exc:
        logger.warning("celery-leases: could not preempt running jobs: %s", exc)
        return
    if count:
        logger.warning(
            "celery-leases: %d running job(s) will hand back at their next checkpoint", count
        )


@task_unknown.connect(weak=False)  # type: ignore[untyped-decorator]
def fail_unknown_task(sender: Any = None, name: str = "", id: str = "", **_: Any) -> None:
    """A message for a task this worker does not know: Celery discards it, so fail the job
    with the reason instead of leaving the reaper to re-publish it forever."""
    app = getattr(sender, "app", None) or current_app
    if not _uses_leases(app) or not id:
        return
    hostname = getattr(sender, "hostname", None) or "this worker"
    try:
        store = store_for(settings_for(app))
        failed = store.give_up(
            id, error=f"{hostname} does not know task {name!r} (not registered); message discarded"
        )
    except LeaseError as exc:
        logger.warning("celery-leases: could not fail job %s of unknown task %r: %s", id, name, exc)
        return
    if failed:
        logger.error("celery-leases: job %s failed: task %r is not registered here", id, name)


def _uses_leases(app: Any) -> bool:
    from .task import LeasedTask

    return any(isinstance(task, LeasedTask) for task in app.tasks.values())
