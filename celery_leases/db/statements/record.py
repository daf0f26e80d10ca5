"""Recording a job and claiming its lease: the client's write, and a worker's first."""

from __future__ import annotations

import sqlalchemy as sa

from ..schema import QUEUED, RUNNING
from .common import Parts, param, unindexed


class Record:
    """The statements that record a job and claim its lease."""

    def __init__(self, p: Parts) -> None:
        t, d, now = p.table, p.dialect, p.now
        #: A new job, queued, as a client publishes it (nothing when the id exists).
        self.register = d.insert_unless_exists(
            t, {"id": param("id"), "token": 0} | p.new_job() | p.queued()
        )
        #: A message no client recorded (sent by name from elsewhere): the job created claimed.
        self.create_claimed = d.insert_unless_exists(
            t, {"id": param("id"), "token": 1} | p.new_job() | p.claimed()
        )
        # Fenced by what the deciding read saw (``facts``).
        as_seen = sa.and_(
            p.by_id, t.c.token == param("seen_token"), t.c.state == param("seen_state")
        )
        taken = {"token": t.c.token + 1} | p.new_job() | p.fresh()
        #: Another job takes the id over (``identity.takes_over``), queued.
        self.take_over = sa.update(t).where(as_seen).values(taken | p.queued())
        #: Another job takes the id over, claimed by the delivery that brought it.
        self.take_over_claimed = d.with_returning(
            sa.update(t).where(as_seen).values(taken | p.claimed()), t.c.token
        )
        #: The token a take-over wrote (read back where there is no RETURNING).
        self.token_of = sa.select(t.c.token).where(p.by_id)
        #: What a claim that matched no row reads to decide (``identity.Facts``).
        self.facts = sa.select(
            t.c.state, t.c.owner, t.c.expires_at - now, t.c.task, t.c.generation, t.c.version,
            t.c.token,
        ).where(p.by_id)  # fmt: skip

        claimable = sa.and_(
            p.by_id,
            sa.or_(unindexed(t.c.state) == QUEUED, sa.and_(p.held, t.c.expires_at <= now)),
        )
        #: What a claim reads: token, attempt, checkpoint and its age.
        self.claim_reads = (t.c.token, t.c.attempts, t.c.checkpoint, (now - t.c.checkpoint_at))
        claim = sa.update(t).values(
            token=t.c.token + 1,
            attempts=t.c.attempts + 1,
            state=RUNNING,
            owner=param("owner", t.c.owner.type),
            session=p.claimed_session(),
            duration=p.seconds,
            expires_at=now + p.seconds,
            claimed_at=now,
            renewed_at=now,
            # A preemption was for the attempt that saw it; a cancel stands.
            stop_requested=sa.case((p.cancelled, "cancel"), else_=sa.null()),
        )
        claim = d.with_returning(claim, *self.claim_reads)
        #: The claim of the recorded message (its version): the usual claim, one statement.
        self.claim_version = claim.where(claimable, t.c.version == param("version"))
        #: The claim of a job recorded without a version (sent by name): same task, generation.
        self.claim_job = claim.where(
            claimable,
            t.c.task == param("task"),
            t.c.generation == param("generation", sa.Integer()),
        )
        #: A claim's row, read back where there is no RETURNING.
        self.claimed = sa.select(*self.claim_reads).where(p.by_id)
