"""The reaper: re-publishes jobs whose lease expired, gives up on poison jobs, purges old ones.

Schedule ``celery_leases.reap`` with celery beat (:func:`schedule_reaper`), or run one pass
with ``celery -A proj leases reap``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from celery import Task, current_app
from celery.local import Proxy

from . import heartbeat, lifecycle, routes, worker
from .config import mark_uses_leases, settings_for
from .db import store_for
from .errors import LeaseError, StoreUnavailable
from .lifecycle.outside import MAX_BATCHES
from .log import QuietPasses, quiet
from .notice import announce_pending

logger = logging.getLogger("celery_leases.reaper")

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
    #: Jobs of groups whose lease expired: they wait for their admission again (their group
    #: admits them, counted under its limit and rate).
    returned: list[str] = field(default_factory=list)
    #: Jobs whose end (failed, cancelled, expired) was stored in the result backend.
    notified: list[str] = field(default_factory=list)
    #: Lease keys whose waiting triggers were settled (served, or run for), and follow-ups
    #: older releases kept on ended jobs, started.
    followups: list[str] = field(default_factory=list)
    #: Jobs of groups admitted and published (their group had room, and nothing admitted
    #: them: the worker that ended a job of the group died first, or it ended outside any).
    admitted: list[str] = field(default_factory=list)
    purged: int = 0
    #: Databases of ``leases_routes`` that did not answer (their jobs wait for them).
    unreachable: list[str] = field(default_factory=list)

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
            "returned": self.returned,
            "notified": self.notified,
            "followups": self.followups,
            "admitted": self.admitted,
            "purged": self.purged,
            **({"unreachable": self.unreachable} if self.unreachable else {}),
        }


def reap(app: Any) -> ReapReport:
    """Run one reaper pass for ``app``'s leases databases and return what it did: what every
    end and hand-back left undone, done (``lifecycle``): expired leases re-published or given
    up, the triggers of free keys settled, the groups with room admitted round-robin, the
    result backend told, then the retention purge.

    With ``leases_routes``, one pass goes over every database in turn; a database that does
    not answer is logged and named in the report (``unreachable``), and the others are
    reaped all the same (its jobs wait for it, and move at the first pass after it is back).
    """
    settings = settings_for(app)
    report = ReapReport()
    if not routes.routed(settings):
        _reap_one(app, settings, store_for(settings), report)
        return report
    for name, store in routes.stores(settings):
        try:
            with routes.using(name):
                _reap_one(app, store.settings, store, report)
        except LeaseError as exc:
            report.unreachable.append(name)
            logger.error("celery-leases: reaper: database %s skipped: %s", name, exc)
            store.db.release_pool()
    if len(report.unreachable) == len(settings.databases) + 1:
        raise StoreUnavailable(f"no leases database answered: {', '.join(report.unreachable)}")
    return report


def _reap_one(app: Any, settings: Any, store: Any, report: ReapReport) -> None:
    """One pass over one database's jobs, its findings added to ``report``."""
    expired = lifecycle.expire(app, store, settings)
    report.orphaned += expired.orphaned
    report.republished += expired.republished
    report.gave_up += expired.gave_up
    report.publish_failed += expired.publish_failed
    report.expired += expired.expired
    report.returned += expired.returned
    report.followups += lifecycle.settle_pending(app, store, batch=settings.reap_batch)
    report.admitted += lifecycle.admit_round_robin(app, store, batch=settings.reap_batch)
    if _orphan_scan_due(store):
        report.admitted += lifecycle.repair_orphans(app, store, batch=settings.reap_batch)
    report.notified += announce_pending(app, store, batch=settings.reap_batch)
    report.purged += store.purge_all(
        older_than=settings.retention, batch=settings.reap_batch, max_batches=MAX_BATCHES
    )
    store.prune_holders(idle=HOLDER_IDLE)
    heartbeat.record(store)
    store.db.release_pool()  # a pass every few seconds: no idle connection kept between them


#: A process's reaper passes look for groups whose waiting jobs have no row (left by an
#: earlier release) at its first pass, then every this many: a scan of the waiting jobs, so
#: not at every pass.
ORPHAN_SCAN_EVERY = 6
_passes: dict[int, int] = {}


def _orphan_scan_due(store: Any) -> bool:
    """Whether this pass looks for groups without a row (every ``ORPHAN_SCAN_EVERY``-th pass
    of this process on ``store``, the first included)."""
    done = _passes.get(id(store), 0)
    _passes[id(store)] = done + 1
    return done % ORPHAN_SCAN_EVERY == 0


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
    (``ReaperTask``).
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
    django-celery-beat's alike (``ReaperTask``). ``queue``: send the passes to a queue of
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
