"""Errors raised by celery-leases. Every one derives from :class:`LeaseError`."""

from __future__ import annotations


class LeaseError(Exception):
    """A celery-leases operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (type(self).__doc__ or "").strip())


class ConfigurationError(LeaseError):
    """A ``leases_*`` setting has a wrong type or a value that cannot work."""


class CheckpointError(LeaseError):
    """The checkpoint state cannot be stored; the previous checkpoint is kept."""


class ArgumentsError(LeaseError):
    """The task's arguments are not JSON-serializable, so the job cannot be recorded."""


class LeaseLost(LeaseError):
    """This attempt no longer holds the job's lease; another attempt owns it, so stop."""


class StoreUnavailable(LeaseError):
    """The leases database cannot be reached."""


class CorruptJob(LeaseError):
    """A stored job holds a value that is not JSON; celery-leases reads JSON only."""


class JobNotFound(LeaseError):
    """No job with this id is recorded in the leases table."""


class InvalidJobState(LeaseError):
    """The job is not in a state that allows this operation."""


class Cancelled(LeaseError):
    """An operator cancelled this job; the attempt stopped at its checkpoint."""


class Preempted(LeaseError):
    """The worker is shutting down; the job was handed back at its checkpoint."""
