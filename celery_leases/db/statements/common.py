"""What the statement groups of one table share: bind parameters, the conditions that find a
job's row, and the column values of a job's states.

Values travel as bind parameters (``b_*``), so each statement object keeps its SQLAlchemy cache
key and a call only binds: building an UPDATE on every call cost more CPU than the database
spends on it (docs/benchmarks.md). Every time is the database clock (``db_now()``).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..dialects import Dialect
from ..functions import db_now, greatest
from ..schema import CANCELLED, QUEUED, RUNNING, SCHEMA_VERSION, SUPERSEDED

#: Errors the reaper writes on the jobs it gives up on, and an operator's cancel.
GAVE_UP_NO_PROGRESS = (
    "gave up: its last attempts ended (crashed, killed or lost) without saving a checkpoint "
    "(leases_max_attempts_without_progress)"
)
GAVE_UP_MAX_ATTEMPTS = "gave up: reached leases_max_attempts"
GAVE_UP_CORRUPT = "gave up: its stored message or checkpoint cannot be read"
CANCELLED_TEXT = "cancelled by an operator"
SUPERSEDED_TEXT = "superseded by a newer trigger of its lease key"


#: A claim's fencing token is at least the database clock in milliseconds times this (the
#: claims one row may take in one millisecond before its tokens run ahead of the clock).
TOKENS_PER_MS = 1024


def param(name: str, type_: Any = None) -> Any:
    """The bind parameter ``b_<name>``."""
    return sa.bindparam(f"b_{name}", type_=type_)


def unindexed(column: Any) -> Any:
    """``column`` in a form no index serves, for a row found by primary key.

    Statistics taken while few jobs ran (a burst after a quiet spell) make PostgreSQL prefer
    the (state, expires_at) index for ``state = 'running'`` and walk every running job on
    each write; SQLite does so without statistics. See docs/benchmarks.md.
    """
    return sa.func.coalesce(column, "")


class Parts:
    """The building blocks of the statements on one jobs table for one dialect."""

    def __init__(
        self,
        table: sa.Table,
        dialect: Dialect,
        keys: sa.Table,
        holders: sa.Table,
        groups: sa.Table,
    ) -> None:
        t = self.table = table
        h = self.holders = holders
        self.dialect = dialect
        self.keys = keys
        self.groups = groups
        self.now = db_now()
        # The database clock as a token (milliseconds, TOKENS_PER_MS apart).
        self._clock_token = sa.cast(self.now * 1000, sa.BigInteger) * TOKENS_PER_MS
        #: The lease's length, in seconds.
        self.seconds = param("duration", sa.Double())
        #: The job ``b_id``.
        self.by_id = t.c.id == param("id")
        #: A running job (found by primary key: ``unindexed``).
        self.held = unindexed(t.c.state) == RUNNING
        #: The running job ``b_id`` under the lease ``b_token``: every write of an attempt.
        self.by_token = sa.and_(self.by_id, t.c.token == param("token"), self.held)
        #: SQL true for a job of a group waiting for its admission (``schema.WAITING``).
        self.waiting = sa.and_(
            t.c.lease_group.is_not(None), t.c.admitted_at.is_(None), t.c.state == QUEUED
        )
        #: An operator cancelled the job.
        self.cancelled = t.c.stop_requested == "cancel"
        #: A newer trigger of its lease key superseded the job (``lease_key_strategy``).
        self.superseded = t.c.stop_requested == "supersede"
        #: The job is to end at its next checkpoint, not to run again: cancelled or superseded
        #: (a stop request that a claim keeps and a hand-back turns into the job's end).
        self.ending = t.c.stop_requested.in_(("cancel", "supersede"))
        # A running job's lease ends ``duration`` after its last renewal: a claim or a
        # checkpoint of its own, or a renewal of its holder (``holder``: its keeper's row).
        # A job no holder keeps has its lease's end in ``expires_at`` (as a queued job has its
        # wait's end there); one with neither (its holder row gone, say) ends ``duration``
        # after its own last claim or checkpoint: never a running job without an end.
        holder_renewed = sa.select(h.c.renewed_at).where(h.c.id == t.c.holder).scalar_subquery()
        renewed = greatest(t.c.renewed_at, sa.func.coalesce(holder_renewed, t.c.renewed_at))
        #: When the job's lease (or a queued job's wait) ends.
        self.lease_end = sa.func.coalesce(
            t.c.expires_at, sa.case((t.c.state == RUNNING, renewed + t.c.duration))
        )
        #: How many waits a queued job sent again waits next: each re-publish (``sends``)
        #: doubles it, up to 64, so a job in a long backlog, or one waiting for a worker that
        #: knows its task, is sent few copies.
        self.backoff = sa.case(*((t.c.sends == n, 2**n) for n in range(6)), else_=64)
        # The claimant's keeper (``b_holder``), bound only while its row exists and its session
        # (if it has one) is alive: a keeper that has not seen its connection drop yet binds
        # nothing, and the lease lasts by ``expires_at`` until the keeper binds it again.
        alive = sa.or_(h.c.session.is_(None), dialect.session_alive(h.c.session))
        #: The claimant's holder, if it can hold the lease (else NULL).
        self.bound_holder = (
            sa.select(h.c.id).where(h.c.id == param("holder", h.c.id.type), alive).scalar_subquery()
        )

    def token_after(self, previous: Any) -> Any:
        """The fencing token a claim (or a take-over) writes after ``previous``: one more,
        and at least the database clock in milliseconds (``TOKENS_PER_MS`` apart). Within one
        history that is still one more than the last; across a failover to a replica that
        missed the last commits, it is above any token the lost history handed out (those
        were handed out before the primary failed, by a clock the promoted server's agrees
        with to well within a failover's seconds), so a live attempt of the lost history
        never shares its token with a new one, and a write fenced by ``last_token <=
        token`` elsewhere orders them the same way."""
        return greatest(previous + 1, self._clock_token)

    def new_job(self) -> dict[str, Any]:
        """A new job's message, and its counters reset (a new id, or one taken over)."""
        t = self.table
        return {
            "task": param("task", t.c.task.type),
            "generation": param("generation", sa.Integer()),
            "version": param("version", t.c.version.type),
            "message": param("message", t.c.message.type),
            "lease_key": param("key", t.c.lease_key.type),
            "lease_group": param("group", t.c.lease_group.type),
            "stalled_attempts": 0,
            "sends": 0,
            "created_at": self.now,
            "schema_version": SCHEMA_VERSION,
        }

    @staticmethod
    def fresh() -> dict[str, Any]:
        """What an earlier job of a taken-over id left, cleared."""
        return {
            c: None
            for c in (
                "checkpoint", "progress_done", "progress_total", "result", "error",
                "stop_requested", "notify", "checkpoint_at", "finished_at", "started_at",
                "started_seq",
                "served_by", "holder",
            )
        }  # fmt: skip

    def queued(self) -> dict[str, Any]:
        """A job waiting for a worker: run after ``b_countdown``, re-published by the reaper
        ``b_expires_in`` seconds from now (NULL: never). A job of a group (``b_group``) waits
        for its admission instead, never re-published by the reaper until admitted."""
        ungrouped = param("group", self.table.c.lease_group.type).is_(None)
        expires_in = param("expires_in", sa.Double())
        return {
            "state": QUEUED,
            "owner": None,
            "session": None,
            "holder": None,
            "attempts": 0,
            "duration": None,
            "run_after": self.now + param("countdown", sa.Double()),
            "expires_at": sa.case((ungrouped, self.now + expires_in), else_=sa.null()),
            "admitted_at": None,
            "claimed_at": None,
            "renewed_at": None,
        }

    def claimed(self) -> dict[str, Any]:
        """A job its first attempt holds (``b_owner``), kept by its holder if it can hold it
        (``bound_holder``), else by its own ``expires_at``."""
        return {
            "state": RUNNING,
            "owner": param("owner", self.table.c.owner.type),
            "session": None,
            "holder": self.bound_holder,
            "attempts": 1,
            "duration": self.seconds,
            "expires_at": self.unbound_expiry(),
            "claimed_at": self.now,
            "started_at": self.now,
            "started_seq": self.triggers_of(param("key", self.table.c.lease_key.type)),
            "renewed_at": self.now,
            # A message no client recorded runs without waiting: it counts in its group.
            "admitted_at": self.now,
        }

    def triggers_of(self, key: Any) -> Any:
        """SQL: how many triggers ever waited on lease key ``key`` (0: none, or no key)."""
        k = self.keys
        counted = sa.select(k.c.triggers).where(k.c.lease_key == key).scalar_subquery()
        return sa.func.coalesce(counted, 0)

    def unbound_expiry(self) -> Any:
        """A claim's ``expires_at``: the lease's end when no holder keeps it, else NULL."""
        return sa.case((self.bound_holder.is_(None), self.now + self.seconds), else_=sa.null())

    def ended(self) -> dict[str, Any]:
        """A job whose attempt ended: no holder, no lease."""
        return {
            "owner": None,
            "session": None,
            "holder": None,
            "expires_at": None,
            "stop_requested": None,
            "finished_at": self.now,
        }

    def handed_back(self) -> list[tuple[Any, Any]]:
        """The lease given back: the job queued again, unless an operator cancelled it or a
        newer trigger of its key superseded it, which it then is (and the reaper tells the
        result backend). ``b_reap_in`` seconds from now the reaper re-publishes it (NULL: a
        message for it is already on its way). A job of a group waits for its admission
        again (no expiry: its admission publishes it): its next start is counted under the
        group's limit and takes a token of its rate, whatever sent it back. MySQL evaluates
        SET left to right: the columns read come first."""
        t, now, cancel, supersede, end = (
            self.table, self.now, self.cancelled, self.superseded, self.ending
        )  # fmt: skip
        grouped = t.c.lease_group.is_not(None)
        return [
            (
                t.c.error,
                sa.case((cancel, CANCELLED_TEXT), (supersede, SUPERSEDED_TEXT), else_=t.c.error),
            ),
            (t.c.notify, sa.case((end, "REVOKED"), else_=t.c.notify)),
            (t.c.finished_at, sa.case((end, now), else_=sa.null())),
            (
                t.c.admitted_at,
                sa.case((end, t.c.admitted_at), (grouped, sa.null()), else_=t.c.admitted_at),
            ),
            (
                t.c.expires_at,
                sa.case(
                    (end, sa.null()),
                    (grouped, sa.null()),
                    else_=now + param("reap_in", sa.Double()),
                ),
            ),
            (t.c.state, sa.case((cancel, CANCELLED), (supersede, SUPERSEDED), else_=QUEUED)),
            (t.c.stop_requested, None),
            (t.c.owner, None),
            (t.c.session, None),
            (t.c.holder, None),
        ]


__all__ = [
    "CANCELLED_TEXT",
    "GAVE_UP_CORRUPT",
    "GAVE_UP_MAX_ATTEMPTS",
    "GAVE_UP_NO_PROGRESS",
    "SUPERSEDED_TEXT",
    "Parts",
    "param",
    "unindexed",
]
