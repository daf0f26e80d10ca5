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
        #: ``register`` committed without waiting for its WAL flush where the database can
        #: (PostgreSQL; elsewhere ``register``): a plain job's record, its message the
        #: second copy (``leases_record_sync_commit``).
        unflushed = d.unflushed(sa.literal(0))
        self.register_unflushed = (
            self.register
            if unflushed is None
            else d.insert_unless_exists(
                t, {"id": param("id"), "token": unflushed} | p.new_job() | p.queued()
            )
        )
        #: A message no client recorded (sent by name from elsewhere): the job created claimed.
        self.create_claimed = d.insert_unless_exists(
            t,
            {"id": param("id"), "token": p.token_after(sa.literal(0))} | p.new_job() | p.claimed(),
        )
        # Fenced by what the deciding read saw (``facts``).
        as_seen = sa.and_(
            p.by_id, t.c.token == param("seen_token"), t.c.state == param("seen_state")
        )
        taken = {"token": p.token_after(t.c.token)} | p.new_job() | p.fresh()
        #: Another job takes the id over (``identity.takes_over``), queued.
        self.take_over = sa.update(t).where(as_seen).values(taken | p.queued())
        #: Another job takes the id over, claimed by the delivery that brought it.
        self.take_over_claimed = d.with_returning(
            sa.update(t).where(as_seen).values(taken | p.claimed()), t.c.token
        )
        #: The token a take-over or a created claim wrote (read back where there is no
        #: RETURNING, and after a created claim).
        self.token_of = sa.select(t.c.token).where(p.by_id)
        g = p.groups
        group_rate = sa.select(g.c.rate).where(g.c.name == t.c.lease_group).scalar_subquery()
        #: What a claim that matched no row reads to decide (``identity.Facts``).
        self.facts = sa.select(
            t.c.state, t.c.owner, p.lease_end - now, t.c.task, t.c.generation, t.c.version,
            t.c.token, t.c.attempts, p.waiting, t.c.run_after - now, group_rate,
        ).where(p.by_id)  # fmt: skip

        claimable = sa.and_(
            p.by_id,
            sa.or_(
                unindexed(t.c.state) == QUEUED,
                # A job of a group whose lease ended starts again through an admission only:
                # the reaper returns it to its group.
                sa.and_(p.held, p.lease_end <= now, t.c.lease_group.is_(None)),
            ),
            # leases_max_attempts: a claim past it is refused (``b_max_attempts`` NULL: none).
            sa.or_(
                param("max_attempts", sa.Integer()).is_(None),
                t.c.attempts < param("max_attempts", sa.Integer()),
            ),
            # A debounced job (``b_any_time`` false) is not claimed before its due time: a
            # later trigger of its burst may still move it.
            sa.or_(
                param("any_time", sa.Boolean()),
                t.c.run_after.is_(None),
                t.c.run_after <= now,
            ),
            # A job of a group runs once admitted, never while it waits for its admission.
            sa.or_(t.c.lease_group.is_(None), t.c.admitted_at.is_not(None)),
        )
        #: What a claim reads: token, attempt, checkpoint and its age, and its holder.
        self.claim_reads = (
            t.c.token, t.c.attempts, t.c.checkpoint, (now - t.c.checkpoint_at), t.c.holder,
        )  # fmt: skip
        # MySQL evaluates SET left to right: expires_at reads the holder before it changes.
        claim = sa.update(t).ordered_values(
            (t.c.expires_at, p.unbound_expiry()),
            (t.c.holder, p.bound_holder),
            (t.c.token, p.token_after(t.c.token)),
            (t.c.attempts, t.c.attempts + 1),
            (t.c.state, RUNNING),
            (t.c.owner, param("owner", t.c.owner.type)),
            (t.c.session, None),
            (t.c.duration, p.seconds),
            (t.c.claimed_at, now),
            # A first claim counts the key's triggers it starts after (before started_at: MySQL
            # evaluates SET left to right); a resume keeps its first's.
            (
                t.c.started_seq,
                sa.case(
                    (t.c.started_at.is_(None), p.triggers_of(t.c.lease_key)), else_=t.c.started_seq
                ),
            ),
            (t.c.started_at, sa.func.coalesce(t.c.started_at, now)),
            (t.c.renewed_at, now),
            (t.c.error, None),  # a wait's reason (``Operators.wait_for_worker``) is over
            # A preemption was for the attempt that saw it; a cancel or a supersede stands.
            (t.c.stop_requested, sa.case((p.ending, t.c.stop_requested), else_=sa.null())),
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
