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
