"""What the store returns: claim outcomes, renewals, reaper batches and jobs as recorded.

Stored JSON is decoded here; a value that is not JSON raises :class:`CorruptJob` naming the job
and the column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kombu.utils import json as kombu_json

from ..errors import CorruptJob
from ..message import Message


@dataclass(frozen=True)
class Claimed:
    """A successful claim: this attempt now holds the lease under ``token``."""

    token: int
    attempt: int
    checkpoint: Any
    checkpoint_age: float | None
    created: bool
    #: A holder (the claimant's keeper) keeps the lease; False: its own expiry does, until
    #: the keeper binds it (``Store.bind``).
    bound: bool = True


@dataclass(frozen=True)
class Refused:
    """A refused claim. ``reason`` is the job's state, ``held`` when a live lease holds it, or
    ``stale`` when another message of the id is the recorded one (an older retry, a copy), or
    ``coalesced`` when the delivery is a trigger of a lease key whose live job serves it, or
    ``early`` when a debounced job is not due yet (``expires_in``: seconds until it is)."""

    reason: str
    owner: str | None
    expires_in: float | None
    #: ``coalesced``: the job of the delivery's lease key that serves it instead.
    serving: str | None = None
    #: ``coalesced``: it superseded the key's queued job; the key's triggers can run now.
    freed: bool = False


@dataclass(frozen=True)
class Job:
    """A job as recorded in the leases table. Ages and ``expires_in`` are seconds, DB clock."""

    id: str
    task: str
    #: The whole task message the job carries (see :class:`~celery_leases.message.Message`).
    message: Message
    state: str
    owner: str | None
    token: int
    attempts: int
    stalled_attempts: int
    checkpoint: Any
    progress_done: int | None
    progress_total: int | None
    result: Any
    error: str | None
    stop_requested: str | None
    expires_in: float | None
    checkpoint_age: float | None
    age: float
    created_at: float
    claimed_at: float | None
    renewed_at: float | None
    checkpoint_at: float | None
    finished_at: float | None
    generation: int = 0
    version: str | None = None
    sends: int = 0
    notify: str | None = None
    #: The database session its holder's keeper is bound to (``Store.expire_orphaned``).
    session: int | None = None
    #: The resource it works on (``lease_key``); at most one live job per key.
    lease_key: str | None = None
    #: The id of a follow-up kept on this job by a celery-leases before revision 0003.
    followup_id: str | None = None
    #: The keeper whose renewals keep its lease (``<table>_holders``), or None.
    holder: str | None = None
    #: When its first attempt claimed it (database clock), or None.
    started_at: float | None = None
    #: For the triggers of a key that a run of the key served: that run's id.
    served_by: str | None = None
    #: The group it is admitted in (``lease_group``), or None.
    lease_group: str | None = None
    #: When it was admitted in its group (database clock); None while it waits.
    admitted_at: float | None = None

    @property
    def waiting(self) -> bool:
        """A job of a group waiting in the database for its admission (never published)."""
        return self.lease_group is not None and self.admitted_at is None and self.state == "queued"

    @property
    def args(self) -> list[Any]:
        return self.message.args

    @property
    def kwargs(self) -> dict[str, Any]:
        return self.message.kwargs

    @property
    def route(self) -> dict[str, Any]:
        """Exchange, routing key and priority of its message."""
        return self.message.route


@dataclass(frozen=True)
class Reaped:
    """What one reaper batch did: jobs to re-publish, and jobs given up as failed."""

    republish: list[Job]
    gave_up: list[Job]
    #: The owner each expired lease had before the reaper cleared it.
    previous_owners: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class StateCounts:
    """Jobs by state (a state without jobs is left out), as ``Store.count_states`` counts
    them: ``capped`` are the states counted up to a bound, which hold at least their count."""

    counts: dict[str, int]
    capped: frozenset[str] = frozenset()

    @property
    def total(self) -> int:
        """Every count added up: at least that many jobs when any state is capped."""
        return sum(self.counts.values())


def dumps(value: Any) -> str:
    """JSON text of a checkpoint; NaN and Infinity are refused (they are not JSON)."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def dumps_result(value: Any) -> str | None:
    """Celery's JSON of a task's result (datetimes, UUIDs, Decimals, NaN as Celery stores them),
    or None when even that cannot hold it (the result backend keeps it then, the row does not)."""
    try:
        return str(kombu_json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    except (TypeError, ValueError):
        return None


def loads(
    text: str | None, job_id: str = "?", column: str = "?", *, celery_json: bool = False
) -> Any:
    """The value stored as JSON text (``celery_json``: Celery's, with its types restored)."""
    if text is None:
        return None
    try:
        return kombu_json.loads(text) if celery_json else json.loads(text)
    except ValueError as exc:
        raise CorruptJob(
            f"job {job_id}: column {column} holds text that is not JSON ({exc}); "
            f"celery-leases reads JSON only"
        ) from exc


def load_message(text: str, job_id: str) -> Message:
    """The stored message of job ``job_id``; :class:`CorruptJob` if it cannot be read."""
    try:
        return Message.loads(text)
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptJob(
            f"job {job_id}: column message holds text that is not JSON of a Celery message "
            f"({exc}); celery-leases reads JSON only"
        ) from exc


def job(m: Any) -> Job:
    """A Job from a row of ``Statements.select_jobs``."""
    job_id = m["id"]
    return Job(
        id=m["id"],
        task=m["task"],
        message=load_message(m["message"], job_id),
        state=m["state"],
        owner=m["owner"],
        token=m["token"],
        attempts=m["attempts"],
        stalled_attempts=m["stalled_attempts"],
        checkpoint=loads(m["checkpoint"], job_id, "checkpoint"),
        progress_done=m["progress_done"],
        progress_total=m["progress_total"],
        result=loads(m["result"], job_id, "result", celery_json=True),
        error=m["error"],
        stop_requested=m["stop_requested"],
        expires_in=m["expires_in"],
        checkpoint_age=m["checkpoint_age"],
        age=m["age"],
        created_at=m["created_at"],
        claimed_at=m["claimed_at"],
        renewed_at=m["renewed_at"],
        checkpoint_at=m["checkpoint_at"],
        finished_at=m["finished_at"],
        generation=m["generation"],
        version=m["version"],
        sends=m["sends"],
        notify=m["notify"],
        session=m["session"],
        lease_key=m["lease_key"],
        followup_id=m["followup_id"],
        holder=m["holder"],
        started_at=m["started_at"],
        served_by=m["served_by"],
        lease_group=m.get("lease_group"),
        admitted_at=m.get("admitted_at"),
    )
