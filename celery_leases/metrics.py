"""Prometheus metrics, when ``prometheus_client`` is installed (``celery-leases[prometheus]``).

With the prefork pool set ``PROMETHEUS_MULTIPROCESS_DIR`` before the worker starts so every
pool process writes its samples there; see the README for exposing them.
"""

from __future__ import annotations

from typing import Any

COUNTERS = {
    "claims": "Leases claimed (first runs and resumes)",
    "resumes": "Claims that resumed a job after an earlier attempt",
    "duplicates_dropped": "Deliveries dropped because the job was finished or leased",
    "leases_lost": "Attempts that found another attempt holds their job",
    "reaped": "Expired jobs re-published by the reaper",
    "gave_up": "Jobs failed by the reaper after attempts without progress",
}

_counters: dict[str, Any] = {}
_checkpoint: Any = None

try:
    from prometheus_client import Counter, Histogram
except ImportError:  # the extra is not installed: metrics are no-ops
    pass
else:
    for _name, _doc in COUNTERS.items():
        _counters[_name] = Counter(f"celery_leases_{_name}", _doc)
    _checkpoint = Histogram(
        "celery_leases_checkpoint_seconds",
        "Time to save a checkpoint, in seconds",
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
    )


def count(name: str, amount: int = 1) -> None:
    """Add ``amount`` to the counter ``name`` (a key of COUNTERS)."""
    counter = _counters.get(name)
    if counter is not None and amount:
        counter.inc(amount)


def checkpoint_seconds(seconds: float) -> None:
    """Record the latency of one checkpoint."""
    if _checkpoint is not None:
        _checkpoint.observe(seconds)
