"""Prometheus metrics, when ``prometheus_client`` is installed (``celery-leases[prometheus]``).

Counters and the checkpoint histogram are labelled by ``task`` (the task name) and move in the
process that does the work: no database work, nothing sent. With the prefork pool set
``PROMETHEUS_MULTIPROC_DIR`` before the worker starts so every pool process writes its
samples there. :class:`JobsCollector` adds gauges of the jobs in the table by state, read with
one ``GROUP BY`` at each scrape, and of the busiest job groups (never on a worker's hot path);
the docs' operating page shows how to expose both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from . import routes
from .config import settings_for
from .db.schema import STATES
from .db.store.heartbeat import last_pass
from .errors import LeaseError

logger = logging.getLogger("celery_leases")

COUNTERS = {
    "claims": "Leases claimed (first runs and resumes)",
    "resumes": "Claims that resumed a job after an earlier attempt",
    "duplicates_dropped": "Deliveries dropped because the job was finished or leased",
    "leases_lost": "Attempts whose fenced write was refused: their lease was lost",
    "lost_commits": "Refused writes that found the database behind the attempt (a failover)",
    "reaped": "Expired jobs re-published by the reaper",
    "gave_up": "Jobs failed by the reaper after attempts without progress",
    "admitted": "Jobs of groups (lease_group) admitted and published",
}

#: The label every counter and the histogram carry: the task's name.
LABELS = ("task",)

_counters: dict[str, Any] = {}
_checkpoint: Any = None

try:
    from prometheus_client import Counter, Histogram
except ImportError:  # the extra is not installed: metrics are no-ops
    pass
else:
    for _name, _doc in COUNTERS.items():
        _counters[_name] = Counter(f"celery_leases_{_name}", _doc, LABELS)
    _checkpoint = Histogram(
        "celery_leases_checkpoint_seconds",
        "Time to save a checkpoint, in seconds",
        LABELS,
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
    )


def count(name: str, *, task: str, amount: int = 1) -> None:
    """Add ``amount`` to the counter ``name`` (a key of COUNTERS) of ``task``."""
    counter = _counters.get(name)
    if counter is not None and amount:
        counter.labels(task).inc(amount)


#: The checkpoint histogram's child of each task (``labels()`` looks it up under a lock and
#: validates the label at every call: a dictionary read on the hot path instead). The same
#: object ``labels()`` returns; in multiprocess mode it follows a fork itself. (Code that
#: calls the histogram's ``remove()`` or ``clear()`` clears this too.)
_checkpoint_of: dict[str, Any] = {}


def checkpoint_seconds(seconds: float, *, task: str) -> None:
    """Record the latency of one checkpoint of ``task``."""
    if _checkpoint is None:
        return
    child = _checkpoint_of.get(task)
    if child is None:
        child = _checkpoint_of[task] = _checkpoint.labels(task)
    child.observe(seconds)


#: The groups :class:`JobsCollector` exports by default: one series per group and gauge, so a
#: bound on the labels Prometheus keeps however many groups (tenants) there are.
MAX_GROUPS = 100


class JobsCollector:
    """A Prometheus collector of the jobs in ``app``'s leases table, by state, and of its job
    groups.

    With ``leases_routes``, every gauge has a ``database`` label (each database's jobs).

    ``celery_leases_jobs{state="running"}`` for every state (0 when none), and
    ``celery_leases_database_up`` (1, or 0 when the table could not be read: the other gauges
    are then left out rather than reported as 0). Each scrape runs one ``GROUP BY state``
    (``Store.count_by_state``) in the process serving the metrics. Register it with
    ``prometheus_client.REGISTRY.register(JobsCollector(app))`` (or your own registry).

    Job groups (``lease_group``): ``celery_leases_groups`` (how many there are), and for the
    ``max_groups`` groups with the most jobs waiting, then admitted (default
    ``MAX_GROUPS``, 100; 0: none), ``celery_leases_group_admitted{group="..."}`` (jobs
    admitted and live: in the broker or running), ``celery_leases_group_waiting`` (jobs
    waiting for their admission) and ``celery_leases_group_limit`` (groups with a limit).

    The reaper: ``celery_leases_reaper_last_pass_age_seconds``, seconds since the last reaper
    pass ended (database clock; absent while none is recorded): alert when it passes a few
    reaper intervals (beat down, or never started).
    """

    def __init__(self, app: Any, *, max_groups: int = MAX_GROUPS) -> None:
        self.app = app
        self.max_groups = max_groups

    def describe(self) -> list[Any]:
        # Given, so that registering it runs no query (the registry would collect() to learn
        # the metric names).
        return list(self._families())

    def collect(self) -> Iterator[Any]:
        try:
            settings = settings_for(self.app)
        except LeaseError as exc:
            logger.warning("celery-leases: metrics could not count the jobs: %s", exc)
            _, up, *_ = self._families()
            up.add_metric([], 0)
            yield up
            return
        routed = routes.routed(settings)
        families = self._families(routed=routed)
        jobs, up, total, admitted, waiting, limit, reaper = families
        answered = False
        for name, store in routes.stores(settings):
            where = [name] if routed else []
            try:
                counts = store.count_by_state()
                last = last_pass(store)
                groups = store.busiest_groups(self.max_groups) if self.max_groups > 0 else []
                total.add_metric(where, store.count_groups())
            except LeaseError as exc:
                shown = f" of database {name}" if routed else ""
                logger.warning("celery-leases: metrics could not count the jobs%s: %s", shown, exc)
                up.add_metric(where, 0)
                continue
            for state in STATES:
                jobs.add_metric([state, *where], counts.get(state, 0))
            for group in groups:
                admitted.add_metric([group.name, *where], group.admitted)
                waiting.add_metric([group.name, *where], group.waiting)
                if group.limit is not None:
                    limit.add_metric([group.name, *where], group.limit)
            if last is not None:
                reaper.add_metric(where, last.age)
            up.add_metric(where, 1)
            answered = True
        # A database that did not answer has its up at 0 and no other gauge (not zeros).
        yield from families if answered else (up,)

    @staticmethod
    def _families(*, routed: bool = False) -> tuple[Any, ...]:
        from prometheus_client.core import GaugeMetricFamily

        where = ["database"] if routed else []

        def gauge(name: str, documentation: str, labels: list[str] | None = None) -> Any:
            return GaugeMetricFamily(name, documentation, labels=[*(labels or []), *where])

        def per_group(name: str, documentation: str) -> Any:
            return gauge(f"celery_leases_group_{name}", documentation, ["group"])

        return (
            gauge("celery_leases_jobs", "Jobs in the leases table, by state", ["state"]),
            gauge("celery_leases_database_up", "1 when the leases table could be read, else 0"),
            gauge("celery_leases_groups", "Job groups (lease_group)"),
            per_group("admitted", "Jobs of the group admitted and live (in the broker or running)"),
            per_group("waiting", "Jobs of the group waiting for their admission"),
            per_group("limit", "The group's limit of jobs admitted at once"),
            gauge(
                "celery_leases_reaper_last_pass_age_seconds",
                "Seconds since the last reaper pass ended (database clock)",
            ),
        )


__all__ = ["COUNTERS", "LABELS", "MAX_GROUPS", "JobsCollector", "checkpoint_seconds", "count"]
