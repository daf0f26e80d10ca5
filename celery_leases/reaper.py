"""The reaper: re-publishes jobs whose lease expired, gives up on poison jobs, purges old ones.

Schedule ``celery_leases.reap`` with celery beat (:func:`schedule_reaper`), or run one pass
with ``celery -A proj leases reap``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from celery import Task, current_app, states
from celery.local import Proxy

from . import groups, keys, metrics, worker
from .config import mark_uses_leases, settings_for
from .db import store_for
from .db.schema import REVOKED
from .errors import LeaseError, StoreUnavailable
from .log import QuietPasses, job_fields, quiet
from .notice import announce_pending

logger = logging.getLogger("celery_leases.reaper")

#: Largest number of batches one pass handles, so a pass always ends.
MAX_BATCHES = 100

#: Seconds a holder row may go unrenewed before the reaper deletes it (if it holds no running
#: job): a day; a keeper holding nothing renews its row hourly (``keeper.IDLE_RENEWAL``).
HOLDER_IDLE = 86400.0

#: Key in an app's ``__dict__``: seconds a reaper pass's message lives (``schedule_reaper``).
_REAP_EXPIRES = "_celery_leases_reap_expires"

#: The name of the reaper task, registered in each app that uses celery-leases.
REAP_TASK = "celery_leases.reap"


@dataclass
class ReapReport:
    """What one reaper pass did."""

    #: Running jobs whose holder's database session was gone: their lease ended at once.
    orphaned: list[str] = field(default_factory=list)
    republished: list[str] = field(default_factory=list)
    gave_up: list[str] = field(default_factory=list)
    publish_failed: list[str] = field(default_factory=list)
    #: Jobs whose message expired while they waited to be re-published: now ``revoked``.
    expired: list[str] = field(default_factory=list)
    #: Jobs whose end (failed, cancelled, expired) was stored in the result backend.
    notified: list[str] = field(default_factory=list)
    #: Lease keys whose waiting triggers were settled (served, or run for), and follow-ups
    #: older releases kept on ended jobs, started.
    followups: list[str] = field(default_factory=list)
    #: Jobs of groups admitted and published (their group had room, and nothing admitted
    #: them: the worker that ended a job of the group died first, or it ended outside any).
    admitted: list[str] = field(default_factory=list)
    purged: int = 0

    def acted(self) -> bool:
        """Whether the pass did anything."""
        return any(self.as_dict().values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "orphaned": self.orphaned,
            "republished": self.republished,
            "gave_up": self.gave_up,
            "publish_failed": self.publish_failed,
            "expired": self.expired,
            "notified": self.notified,
            "followups": self.followups,
            "admitted": self.admitted,
            "purged": self.purged,
        }


def reap(app: Any) -> ReapReport:
    """Run one reaper pass for ``app``'s leases database and return what it did."""
    settings = settings_for(app)
    store = store_for(settings)
    report = ReapReport()
    try:
        orphaned = store.expire_orphaned(batch=settings.reap_batch)
    except StoreUnavailable:
        raise  # nothing below can work: one error, not one a step
    except LeaseError as exc:  # never in the way of the paths below (MySQL: no GLOBAL_STATUS)
        logger.error("cannot look for jobs whose holder is gone: %s", exc)
        orphaned = []
    try:
        store.release_stale()
    except StoreUnavailable:
        raise
    except LeaseError as exc:  # the expiry path below still runs
        logger.error("cannot let go the jobs of holders that stopped renewing: %s", exc)
    for job_id, owner in orphaned:
        report.orphaned.append(job_id)
        logger.info(
            "job %s: its holder's database session is gone (owner %s)",
            job_id,
            owner,
            extra=job_fields(job_id, owner=owner),
        )
    for _ in range(MAX_BATCHES):
        batch = store.collect_expired(
            batch=settings.reap_batch,
            grace=settings.reap_grace,
            max_stalled=settings.max_attempts_without_progress,
            max_attempts=settings.max_attempts,
        )
        for job in batch.gave_up:
            report.gave_up.append(job.id)
            metrics.count("gave_up", task=job.task)
            logger.error(
                "job %s (%s): %s",
                job.id,
                job.task,
                job.error,
                extra=job_fields(job.id, token=job.token, attempt=job.attempts),
            )
        for job in batch.republish:
            left = job.message.expires_in()
            if left is not None and left <= 0:
                # A worker would discard it as expired: end it as Celery would have.
                if store.end_live(
                    job.id,
                    state=REVOKED,
                    error="expired (its message's expires passed)",
                    notify=states.REVOKED,
                ):
                    report.expired.append(job.id)
                continue
            try:
                job.message.send(app)
            except Exception as exc:  # the row keeps its pushed expiry: a later pass retries
                report.publish_failed.append(job.id)
                logger.error(
                    "job %s: re-publish failed, next pass retries: %r",
                    job.id,
                    exc,
                    extra=job_fields(job.id, token=job.token, attempt=job.attempts),
                )
                continue
            report.republished.append(job.id)
            metrics.count("reaped", task=job.task)
            where = "no checkpoint" if job.checkpoint is None else "its checkpoint"
            logger.info(
                "job %s (%s): lease expired (owner %s, attempt %d), re-published to resume from %s",
                job.id,
                job.task,
                batch.previous_owners.get(job.id) or "none",
                job.attempts,
                where,
                extra=job_fields(job.id, token=job.token, attempt=job.attempts),
            )
        if len(batch.republish) + len(batch.gave_up) < settings.reap_batch:
            break
    report.followups = start_followups(app, store, batch=settings.reap_batch)
    report.admitted = groups.admit_waiting(app, store, batch=settings.reap_batch)
    report.notified = announce_pending(app, store, batch=settings.reap_batch)
    report.purged = store.purge_all(
        older_than=settings.retention, batch=settings.reap_batch, max_batches=MAX_BATCHES
    )
    store.prune_holders(idle=HOLDER_IDLE)
    store.db.release_pool()  # a pass every few seconds: no idle connection kept between them
    return report


def start_followups(app: Any, store: Any, *, batch: int) -> list[str]:
    """Settle the triggers waiting on lease keys whose job ended without settling them (its
    attempt died first, or it ended outside any: revoked, expired, cancelled, given up, never
    published), and start the follow-ups older releases kept on ended jobs; the keys settled
    and the jobs started. A run recorded but not sent is re-published once its wait passed."""
    done = [key for key in store.pending_keys(batch=batch) if keys.settle(app, store, key)]
    for job_id in store.followups_pending(batch=batch):
        started = keys.start_followup(app, store, job_id)
        if started is not None:
            done.append(started)
    return done


#: Celery's lines about reaper passes that did nothing go to DEBUG (``log.QuietPasses``).
QUIET_PASSES = QuietPasses(REAP_TASK)


def _reap_pass(self: Any) -> dict[str, Any]:
    """One reaper pass, as a task for celery beat."""
    report = reap(self.app)
    if not report.acted():
        QUIET_PASSES.idle_pass(str(self.request.id))
    return report.as_dict()


class ReaperTask(Task):  # type: ignore[misc]
    """The reaper's task class: a plain ``celery.Task`` (a pass holds no lease, whatever the
    app's default task class), whose messages expire as :func:`schedule_reaper` set them
    (``expires``, a default of every publish), whichever scheduler sends them: Celery's own
    passes its entry's options, django-celery-beat's DatabaseScheduler drops ``expires`` from
    them (it keeps ``expire_seconds`` only)."""

    @property
    def expires(self) -> float | None:  # type: ignore[override]
        return self.app.__dict__.get(_REAP_EXPIRES)  # type: ignore[no-any-return]


def register_reaper(app: Any) -> None:
    """Register ``celery_leases.reap`` in ``app`` (once; at its finalization if it has not
    finalized yet).

    Called when a :class:`LeasedTask` is bound to ``app`` and by :func:`schedule_reaper`, so the
    task exists only in apps that use celery-leases, never in every app of the process
    (:class:`ReaperTask`).
    """
    mark_uses_leases(app)
    worker.connect()
    quiet(QUIET_PASSES)
    if REAP_TASK in app._tasks or app.__dict__.get("_celery_leases_reaper"):
        return
    app.__dict__["_celery_leases_reaper"] = True
    app.task(name=REAP_TASK, base=ReaperTask, bind=True, ignore_result=True, shared=False)(
        _reap_pass
    )


def _current_reap_task() -> Any:
    register_reaper(current_app)
    return current_app.tasks[REAP_TASK]


#: The current app's ``celery_leases.reap`` task (``reap_task.delay()``), registered in that
#: app on first use.
reap_task: Any = Proxy(_current_reap_task)


def reaper_scheduled(app: Any) -> bool:
    """Whether ``app``'s beat schedule (``beat_schedule``, where :func:`schedule_reaper` adds
    it) runs ``celery_leases.reap``. Entries a scheduler keeps elsewhere (django-celery-beat's
    database) are not seen."""
    schedule = app.conf.beat_schedule or {}
    return any(
        isinstance(entry, dict) and entry.get("task") == REAP_TASK for entry in schedule.values()
    )


def schedule_reaper(app: Any, every: float = 10.0, *, queue: str | None = None) -> None:
    """Add ``celery_leases.reap`` to ``app``'s beat schedule every ``every`` seconds.

    Each pass's message expires after ``max(2 * every, 10)`` seconds, so passes that waited
    behind busy workers are dropped rather than run back to back, with Celery's scheduler and
    django-celery-beat's alike (:class:`ReaperTask`). ``queue``: send the passes to a queue of
    their own (serve it with a small worker, ``-Q <queue> -c 1``), where no long job can delay
    them. It keeps the user's own entries; call it after assigning ``beat_schedule`` yourself.
    """
    expires = max(2 * every, 10.0)
    app.__dict__[_REAP_EXPIRES] = expires
    register_reaper(app)
    options: dict[str, Any] = {"expires": expires}
    if queue is not None:
        options["queue"] = queue
    app.add_periodic_task(every, app.signature(REAP_TASK, options=options), name=REAP_TASK)
