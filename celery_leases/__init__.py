"""celery-leases: Celery tasks that hold a database lease, checkpoint, and resume after a crash."""

from __future__ import annotations

from . import startup as _startup  # noqa: F401  (connects the worker and beat start checks)
from . import worker as _worker  # noqa: F401  (connects the worker signals)
from .config import DEFAULTS, Settings, reread_settings
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
)
from .lease import Lease
from .metrics import JobsCollector
from .migrations import Migrated, migrate
from .reaper import ReapReport, reap, reap_task, register_reaper, schedule_reaper
from .rows import Job
from .schema import jobs_table, metadata
from .store import get_job
from .task import LeasedTask

__all__ = [  # noqa: RUF022  (grouped by what a user does with each name)
    # Writing a leased task
    "LeasedTask",
    "Lease",
    # What a running attempt may be told: stop now
    "Stop",
    "Cancelled",
    "Preempted",
    "LeaseLost",
    # Running the reaper
    "schedule_reaper",
    "register_reaper",
    "reap",
    "reap_task",
    "ReapReport",
    # Reading jobs and watching them
    "get_job",
    "Job",
    "JobsCollector",
    # Configuration and schema
    "DEFAULTS",
    "Settings",
    "migrate",
    "Migrated",
    "reread_settings",
    "jobs_table",
    "metadata",
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
]

__version__ = "0.1.0"
