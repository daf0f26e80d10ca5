"""The lease an attempt holds on its job while it runs."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from billiard.exceptions import SoftTimeLimitExceeded

from .errors import LeaseError, LeaseLost, StoreUnavailable, WriteConflict
from .log import lease_fields

T = TypeVar("T")
logger = logging.getLogger("celery_leases")

_UNREAD: Any = object()


class Hold(str, Enum):
    """Where an attempt's hold on its job's lease stands."""

    #: The attempt holds the lease (its writes are fenced by its token).
    HELD = "held"
    #: Given back (a hand-back, a retry) or ended with the job: nothing held, nothing lost.
    RELEASED = "released"
    #: Another attempt took the job, or renewals failed past the lease's end.
    LOST = "lost"
    #: A hand-back was refused by the fence: a newer attempt holds the job, or it ended (lost).
    FENCED_OUT = "fenced out"

    def __str__(self) -> str:
        return self.value


@dataclass
class Lease:
    """The running attempt's hold on its job.

    ``token`` is the fencing token (it grows on every claim), ``attempt`` counts claims from 1,
    ``checkpoint`` is the last saved state (None before the first checkpoint), and ``owner``
    names the worker process. Durations are seconds.
    """

    job_id: str
    token: int
    attempt: int
    checkpoint: Any
    owner: str
    duration: float
    renew_interval: float
    stall_timeout: float | None = None
    #: Terminate this (prefork pool) process when the attempt stalls.
    kill_when_stalled: bool = False
    #: Seconds since the checkpoint was saved, at claim time (None without one).
    checkpoint_age: float | None = None
    #: Where the hold stands (held, released, lost, fenced out): ``released``, ``lost`` and
    #: ``fenced_out`` read it.
    hold: Hold = Hold.HELD
    #: ``cancel`` or ``preempt`` when the job was asked to stop at its next checkpoint.
    stop_requested: str | None = None
    #: A checkpoint already saw the stop request (it raises at the next one at the latest).
    stop_seen: bool = False
    #: A checkpoint joined a transaction of the task's (``checkpoint(connection=...)``) on a
    #: database that bounds that transaction's idle time by the lease (PostgreSQL, MariaDB;
    #: ``database.ended_idle_transaction`` tells its error).
    idle_bounded: bool = False
    detached: bool = False
    stall_reported: bool = False
    #: The resource the job works on (the task's ``lease_key``), or None.
    key: str | None = None
    #: The group it was admitted in (the task's ``lease_group``), or None.
    group: str | None = None
    #: Its keeper's holder keeps it (else its own expiry does, until the keeper binds it).
    bound: bool = True
    #: The caller's transaction every write of the attempt joins (an attempt that started
    #: inside one: ``db.joined``), or None.
    joined: Any = None
    #: A write of the attempt joined a transaction of the task's (``connection=``, Django's
    #: ``atomic()``), which may still hold the job's row.
    joined_write: bool = False
    #: What the attempt does once its body has returned, because the task asked for it
    #: inside such a transaction: ``("retry", message, countdown)`` or ``("replace", sig)``.
    held_back: Any = None
    #: Reads the key's cursor from the database (the first ``cursor`` read calls it).
    read_cursor: Callable[[], Any] | None = field(default=None, repr=False)
    _cursor: Any = field(default=_UNREAD, repr=False)
    # Monotonic times of this process: when the lease ends without a renewal, and the last
    # checkpoint (for the stall deadline). Never compared with a database time.
    deadline: float = field(default=0.0, repr=False)
    last_progress: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        now = time.monotonic()
        self.deadline = self.deadline or now + self.duration
        self.last_progress = self.last_progress or now

    @property
    def released(self) -> bool:
        """Given back, or ended with its job: nothing is held any more."""
        return self.hold is Hold.RELEASED

    @released.setter
    def released(self, value: bool) -> None:
        if value:
            self.hold = Hold.RELEASED
        elif self.hold is Hold.RELEASED:
            self.hold = Hold.HELD

    @property
    def lost(self) -> bool:
        """Another attempt took the job, or renewals failed past the lease's end (a refused
        hand-back included)."""
        return self.hold in (Hold.LOST, Hold.FENCED_OUT)

    @lost.setter
    def lost(self, value: bool) -> None:
        if value and not self.lost:
            self.hold = Hold.LOST

    @property
    def fenced_out(self) -> bool:
        """A hand-back was refused by the fence: a newer attempt holds the job, or it ended."""
        return self.hold is Hold.FENCED_OUT

    def handed_back(self, state: str | None) -> None:
        """A hand-back left the job in ``state``: released, or (None) refused by the fence."""
        self.hold = Hold.RELEASED if state is not None else Hold.FENCED_OUT

    @property
    def cursor(self) -> Any:
        """The cursor of the job's lease key: what the key's runs saved with
        ``self.save_cursor()`` (None before the first), read at first use. It outlives the
        job: the key's next run starts from it."""
        if self.key is None and self.detached:
            raise LeaseError(
                "a leased task called directly (task(...), not task.delay() or task.apply()) "
                "runs here with no job in the leases table: no lease key, no cursor, and its "
                "checkpoints are kept in memory only; send it with .delay() (.apply() in a "
                "test) to run it as a job"
            )
        if self.key is None:
            raise LeaseError(
                f"job {self.job_id} has no lease key: give its task a lease_key option (or "
                f"apply_async(..., lease_key=...)) to keep a cursor per resource"
            )
        if self._cursor is _UNREAD:
            self._cursor = self.read_cursor() if self.read_cursor is not None else None
        return self._cursor

    @cursor.setter
    def cursor(self, value: Any) -> None:
        self._cursor = value

    def carry(self, settings: Any, store: Any) -> None:
        """Keep the task's settings and the store of the database the attempt claimed its job
        in (the claim's): its checkpoints write there without looking them up again. Not a
        field: a copy of the lease (``copy``, or serialized) leaves them out (a store holds an
        engine), and then looks them up at each write, as a lease made by hand does."""
        self.__dict__[_CARRIED] = (settings, store)

    @property
    def carried(self) -> tuple[Any, Any] | None:
        """(settings, store) kept by :meth:`carry`, or None."""
        return self.__dict__.get(_CARRIED)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop(_CARRIED, None)
        return state

    @property
    def stalled(self) -> bool:
        """True when no checkpoint was saved for longer than the stall timeout."""
        if self.stall_timeout is None:
            return False
        return time.monotonic() - self.last_progress > self.stall_timeout


#: Where a lease keeps what :meth:`Lease.carry` was given.
_CARRIED = "_carried"


class _Saved:
    """A saved checkpoint's JSON text, decoded at its first read. One per save, never
    changed but for its decoded value: a reader in another thread decodes this save's text
    or finds it decoded, and never writes into the lease (a later save replaces the whole)."""

    __slots__ = ("text", "value")

    def __init__(self, text: str) -> None:
        self.text = text
        self.value: Any = _UNREAD

    def decoded(self) -> Any:
        value = self.value
        if value is _UNREAD:
            value = self.value = json.loads(self.text)
        return value


def _read_checkpoint(lease: Lease) -> Any:
    value = lease.__dict__.get("_checkpoint")
    return value.decoded() if isinstance(value, _Saved) else value


def _write_checkpoint(lease: Lease, value: Any) -> None:
    lease.__dict__["_checkpoint"] = value


def saved_checkpoint(lease: Lease, text: str) -> None:
    """``lease``'s checkpoint is now the state whose JSON is ``text``: ``lease.checkpoint``
    decodes it at its first read (the value a resume would read), not at every save."""
    lease.__dict__["_checkpoint"] = _Saved(text)


# ``checkpoint`` stays a field of the dataclass (its __init__, repr and comparison go through
# the property); a property written in the class body would be taken for its default.
Lease.checkpoint = property(  # type: ignore[assignment]
    _read_checkpoint,
    _write_checkpoint,
    doc="The last saved state (None before the first checkpoint), as a resume would read it.",
)


class _Current(threading.local):
    def __init__(self) -> None:
        self.stack: list[Lease] = []


#: The leases of the attempts running in this thread, innermost last.
current = _Current()


@contextmanager
def holding(lease: Lease) -> Iterator[Lease]:
    """Make ``lease`` the current one (``LeasedTask.lease``) for the duration of the block."""
    current.stack.append(lease)
    try:
        yield lease
    finally:
        current.stack.remove(lease)


def held(job_id: str | None) -> Lease | None:
    """The lease this thread's running attempt holds on ``job_id`` (for a retry or a replace
    of it), or None."""
    for lease in current.stack:
        if lease.job_id == job_id and not (lease.detached or lease.released):
            return lease
    return None


def until_deadline(
    lease: Lease,
    operation: Callable[[], T],
    *,
    waiting: str,
    gave_up: str | None = None,
    lost: bool = False,
    first_delay: float = 0.1,
) -> T:
    """Run ``operation`` (a write of ``lease``'s attempt), retrying while the database is
    unavailable, or a concurrent transaction keeps winning (:class:`WriteConflict`, on the
    store's own connection: in a caller's transaction it is the caller's to run again), and
    the lease has time left. When it runs out: with ``lost``, the lease counts as lost
    (:class:`LeaseLost`); otherwise ``gave_up`` is logged and the error raised."""
    delay = first_delay
    retried = (StoreUnavailable,) if lease.joined is not None else (StoreUnavailable, WriteConflict)
    while True:
        try:
            return operation()
        except retried as exc:
            if time.monotonic() + delay > lease.deadline:
                if lost:
                    lease.lost = True
                    raise LeaseLost(
                        f"job {lease.job_id}: database unreachable until the lease ended; "
                        f"stop ({exc})"
                    ) from exc
                logger.error("%s", gave_up, extra=lease_fields(lease))
                raise
            logger.warning("%s: %s", waiting, exc, extra=lease_fields(lease))
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def recorded(write: Callable[[], T], already: Callable[[], T] | None = None) -> T:
    """Run ``write``, a record of how the attempt ends (done, failed, its lease handed back
    for a retry or at a stop); if a soft time limit lands inside it, run it again (once, on
    a new connection: the interrupted one is closed): the attempt's end must be recorded as
    the task made it, not as the limit. Done and failed are idempotent for their token (a
    done job is done again), so a first write the server committed before the interruption
    changes nothing. A hand-back is not (the second finds the job queued): when the second
    write is refused, ``already`` tells whether the first was made."""
    try:
        return write()
    except SoftTimeLimitExceeded:
        logger.warning("the soft time limit came while the attempt's end was recorded; again")
        outcome = write()
        if not outcome and already is not None:
            return already()
        return outcome


def queued_by(store: Any, lease: Lease) -> str | None:
    """After a hand-back a soft time limit interrupted and a second one refused: ``queued``
    if the first was made (the server ran it before the cancel reached it: the job is queued
    under this attempt's token, which only a hand-back of it or an expiry of its lease
    leaves), else None. Outside a caller's transaction only (that one is gone)."""
    if lease.joined is not None:
        return None
    job = store.get(lease.job_id)
    mine = job is not None and job.state == "queued" and job.token == lease.token
    return "queued" if mine else None
