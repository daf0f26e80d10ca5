"""What the store returns: claim outcomes, renewals, reaper batches and jobs as recorded.

Stored JSON is decoded here; a value that is not JSON raises :class:`CorruptJob` naming the job
and the column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kombu.utils import json as kombu_json

from .. import jsontext
from ..errors import CorruptJob
from ..message import Message
from ..states import State


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


class Refusal(str, Enum):
    """Why a claim refused a delivery (besides an end: then the job's ``State``)."""

    #: A live lease holds the job: a duplicate delivery.
    HELD = "held"
    #: Another message of the id is the recorded one (an older retry, a copy).
    STALE = "stale"
    #: A trigger of a lease key whose live job serves it (kept on the key).
    COALESCED = "coalesced"
    #: Not due yet (a countdown, a debounce, its group's token): deliver it again then.
    EARLY = "early"
    #: A job of a group not admitted yet: its admission publishes it.
    WAITING = "waiting"
    #: A job of a group whose lease ended: the reaper returns it to its group, whose
    #: admission starts it again (a start of a group's job is always an admission's).
    LAPSED = "lapsed"

    def __str__(self) -> str:
        return self.value


class Recorded(str, Enum):
    """What recording a client's message did (``Store.register``), besides finding a job
    that keeps the id (then its ``State``: this message is a copy)."""

    #: A new job.
    NEW = "new"
    #: A new job reusing the id of one that ended, or a replacement.
    TAKEN_OVER = "taken over"
    #: A trigger of a held lease key, kept on the key.
    COALESCED = "coalesced"
    #: A debounced trigger moved into its key's job that has not started.
    DEBOUNCED = "debounced"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Superseded:
    """A queued job a newer trigger of its key ended: its id, and its group (``admitted``:
    it held a place under the group's limit, free now)."""

    id: str
    group: str | None
    admitted: bool


@dataclass(frozen=True)
class Refused:
    """A refused claim. ``reason``: a :class:`Refusal`, or the :class:`State` of a job that
    has ended. ``expires_in``: seconds left on the lease that holds it, or until it is due
    (``early``)."""

    reason: Refusal | State
    owner: str | None
    expires_in: float | None
    #: ``coalesced``: the job of the delivery's lease key that serves it instead.
    serving: str | None = None
    #: ``coalesced``: no job holds the key now; its waiting triggers can run now.
    freed: bool = False
    #: ``coalesced``: the key's queued job it superseded (its group's place is free).
    superseded: Superseded | None = None


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


#: What ``json.dumps(value, allow_nan=False, separators=SEPARATORS, ensure_ascii=...)`` builds
#: at each call, built once (a checkpoint's hot path encodes with it): non-ASCII characters
#: as they are, and escaped (for a value UTF-8 cannot hold: ``jsontext``).
_ENCODER = json.JSONEncoder(allow_nan=False, separators=jsontext.SEPARATORS, ensure_ascii=False)
_ESCAPING = json.JSONEncoder(allow_nan=False, separators=jsontext.SEPARATORS)


def dumps(value: Any) -> str:
    """JSON text of a checkpoint, as stored (``jsontext``); NaN and Infinity are refused (they
    are not JSON)."""
    text = _ENCODER.encode(value)
    return text if jsontext.storable(text) else _ESCAPING.encode(value)


def dumps_result(value: Any) -> str | None:
    """Celery's JSON of a task's result (datetimes, UUIDs, Decimals, NaN as Celery stores them),
    or None when even that cannot hold it (the result backend keeps it then, the row does not)."""
    try:
        return jsontext.celery_json(value)
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
