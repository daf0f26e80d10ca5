"""Structured fields on celery-leases' log records.

Every record about one job carries, as attributes (``extra=``), the fields below, so a JSON
formatter or a log pipeline can filter on them; the message texts stay as they are.

- ``job_id``: the job's id (its Celery task id), on every record about a job;
- ``lease_token``: the fencing token of the attempt, when one is known;
- ``lease_attempt``: the attempt number (claims of the job, from 1), when known;
- ``lease_owner``: the worker process holding (or that held) the lease, when known.

A field that is not known for a record is absent, not None.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lease import Lease

JOB_ID = "job_id"
TOKEN = "lease_token"
ATTEMPT = "lease_attempt"
OWNER = "lease_owner"

#: Every field a celery-leases log record may carry.
FIELDS = (JOB_ID, TOKEN, ATTEMPT, OWNER)


def job_fields(
    job_id: str | None,
    *,
    token: int | None = None,
    attempt: int | None = None,
    owner: str | None = None,
) -> dict[str, Any]:
    """The ``extra=`` of a record about job ``job_id``; unknown fields left out."""
    values = {JOB_ID: job_id, TOKEN: token, ATTEMPT: attempt, OWNER: owner}
    return {name: value for name, value in values.items() if value is not None}


def lease_fields(lease: Lease) -> dict[str, Any]:
    """The ``extra=`` of a record about the attempt holding ``lease``."""
    return job_fields(lease.job_id, token=lease.token, attempt=lease.attempt, owner=lease.owner)


__all__ = ["ATTEMPT", "FIELDS", "JOB_ID", "OWNER", "TOKEN", "job_fields", "lease_fields"]


class QuietPasses(logging.Filter):
    """Celery's INFO lines about a periodic task of the library's (the reaper): the worker's
    "received" and "succeeded" and beat's "Sending due task", at DEBUG, except the success of
    a pass that did something (not in ``idle``). One line per pass that acted, none for the
    others (two a pass, 17,000 a day at a 10 s interval, before)."""

    #: Idle passes remembered at most (their success lines consume them).
    KEEP = 1000

    def __init__(self, task_name: str) -> None:
        super().__init__()
        self.task_name = task_name
        self.idle: set[str] = set()

    def idle_pass(self, task_id: str) -> None:
        """The pass ``task_id`` did nothing: its success line goes to DEBUG."""
        if len(self.idle) >= self.KEEP:
            self.idle.clear()
        self.idle.add(task_id)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not self._ours(record):
            return True
        data = getattr(record, "data", None)
        if isinstance(data, dict) and "runtime" in data:  # "succeeded": keep a busy pass's
            if str(data.get("id")) not in self.idle:
                return True
            self.idle.discard(str(data.get("id")))
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)

    def _ours(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if isinstance(data, dict):  # the worker's received / succeeded
            return data.get("name") == self.task_name
        args = record.args  # beat: "Scheduler: Sending due task %s (%s)", entry, task
        return (
            isinstance(args, tuple)
            and len(args) == 2
            and args[1] == self.task_name
            and str(record.msg).startswith("Scheduler: Sending due task")
        )


#: Celery's loggers of the lines :class:`QuietPasses` quiets.
QUIETED_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


def quiet(passes: QuietPasses) -> None:
    """Install ``passes`` on Celery's loggers (once)."""
    for name in QUIETED_LOGGERS:
        target = logging.getLogger(name)
        if passes not in target.filters:
            target.addFilter(passes)
