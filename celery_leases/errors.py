"""Errors raised by celery-leases.

Two families: :class:`LeaseError` for what went wrong (a bad setting, an unreachable database,
a state that cannot be stored), and :class:`Stop` for what the running attempt is told to do
(stop now: it was cancelled, superseded, handed back, or lost its lease). A stop is not an
error: neither ``except LeaseError:`` nor ``except Exception:`` swallows one.
"""

from __future__ import annotations


class _Described(Exception):
    """Each leaf's docstring is its default message."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (type(self).__doc__ or "").strip())


class LeaseError(_Described):
    """A celery-leases operation failed."""


class ConfigurationError(LeaseError):
    """A ``leases_*`` setting has a wrong type or a value that cannot work."""


class CheckpointError(LeaseError):
    """The checkpoint state cannot be stored; the previous checkpoint is kept."""


class ArgumentsError(LeaseError):
    """The task's message cannot be recorded (not JSON, or an id the table cannot hold)."""


class StoreUnavailable(LeaseError):
    """The leases database cannot be reached."""


class CorruptJob(LeaseError):
    """A stored job holds a value that is not JSON; celery-leases reads JSON only."""


class JobNotFound(LeaseError):
    """No job with this id is recorded in the leases table."""


class InvalidJobState(LeaseError):
    """The job is not in a state that allows this operation."""


class WriteConflict(LeaseError):
    """A concurrent transaction won (a serialization failure, a deadlock, a lock timeout) and
    this write was rolled back: run the transaction again."""


class GaveUp(LeaseError):
    """The reaper gave up on this job; its error in the leases table says why."""


class Stop(BaseException):
    """This attempt must stop now: let it propagate out of the task.

    A ``BaseException``, as ``asyncio.CancelledError`` is: ``except Exception`` in your task
    and Celery's ``autoretry_for=(Exception,)`` never catch it. Clean up in ``finally``;
    code that must catch it re-raises it.
    """

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (type(self).__doc__ or "").strip().splitlines()[0])


class Cancelled(Stop):
    """An operator cancelled this job; the attempt stopped at its checkpoint."""


class Preempted(Stop):
    """The worker is shutting down; the job was handed back at its checkpoint."""


class Superseded(Stop):
    """A newer trigger of this job's lease key superseded it (``lease_key_strategy="newest"``);
    the attempt stopped at its checkpoint, and the key's next run has the newest arguments."""


class LeaseLost(Stop):
    """This attempt no longer holds the job's lease; another attempt owns it, so stop."""
