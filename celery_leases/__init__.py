"""celery-leases: Celery tasks that hold a database lease, checkpoint, and resume after a crash."""

from __future__ import annotations

from . import lifecycle as _lifecycle  # noqa: F401  (connects the worker signals)
from .config import DEFAULTS, Settings
from .errors import (
    ArgumentsError,
    Cancelled,
    CheckpointError,
    ConfigurationError,
    CorruptJob,
    InvalidJobState,
    JobNotFound,
    LeaseError,
    LeaseLost,
    Preempted,
    StoreUnavailable,
)
from .jobs import get_job
from .lease import Lease
from .reaper import ReapReport, reap, reap_task, schedule_reaper
from .schema import jobs_table, metadata
from .store import Job
from .task import LeasedTask

__all__ = [
    "DEFAULTS",
    "ArgumentsError",
    "Cancelled",
    "CheckpointError",
    "ConfigurationError",
    "CorruptJob",
    "InvalidJobState",
    "Job",
    "JobNotFound",
    "Lease",
    "LeaseError",
    "LeaseLost",
    "LeasedTask",
    "Preempted",
    "ReapReport",
    "Settings",
    "StoreUnavailable",
    "get_job",
    "jobs_table",
    "metadata",
    "reap",
    "reap_task",
    "schedule_reaper",
]

__version__ = "0.1.0"
