"""celery-leases: Celery tasks that hold a database lease, checkpoint, and resume after a crash.

Users import from here only. The package's wings: ``db/`` (storage: the only part that speaks
SQL), ``worker/`` (what runs in a worker's processes besides the task body), ``cli/`` (the
``celery leases`` commands), ``contrib/django``; the core modules beside them (``task``,
``attempt``, ``checkpoint``, ``publish``, ``keys``, ``reaper``, ...) hold one concept each.
"""

from __future__ import annotations

from .config import reread_settings
from .control import get_job, migrate
from .db.migrations import Migrated
from .db.rows import Job
from .errors import (
    ArgumentsError,
    Cancelled,
    CheckpointError,
    ConfigurationError,
    CorruptJob,
    GaveUp,
    InvalidJobState,
    JobNotFound,
    LeaseError,
    LeaseLost,
    Preempted,
    Stop,
    StoreUnavailable,
    Superseded,
    WriteConflict,
)
from .lease import Lease
from .metrics import JobsCollector
from .reaper import ReapReport, reap, schedule_reaper
from .task import LeasedTask

__all__ = [  # noqa: RUF022  (grouped by what a user does with each name)
    # Writing a leased task
    "LeasedTask",
    "Lease",
    # What a running attempt may be told: stop now
    "Stop",
    "Cancelled",
    "Preempted",
    "Superseded",
    "LeaseLost",
    # Running the reaper
    "schedule_reaper",
    "reap",
    "ReapReport",
    # Reading jobs and watching them
    "get_job",
    "Job",
    "JobsCollector",
    # The table and the settings
    "migrate",
    "Migrated",
    "reread_settings",
    # Errors
    "LeaseError",
    "ArgumentsError",
    "CheckpointError",
    "ConfigurationError",
    "CorruptJob",
    "GaveUp",
    "InvalidJobState",
    "JobNotFound",
    "StoreUnavailable",
    "WriteConflict",
]

__version__ = "0.1.0"
