"""The reaper's statements: expired leases, holders that are gone, give-ups, notices, purges."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..functions import db_now
from ..schema import FAILED, FINISHED_STATES, LIVE_STATES, QUEUED, RUNNING
from .common import GAVE_UP_CORRUPT, GAVE_UP_MAX_ATTEMPTS, GAVE_UP_NO_PROGRESS, Parts, param


class Reaper:
    """The statements of a reaper pass."""

    def __init__(self, p: Parts) -> None:
        t, now = p.table, p.now
        self.table = t
        # The clock read once per statement (an InitPlan on PostgreSQL), so the search on
        # (state, expires_at) is an index range and not a filter.
        clock = sa.select(db_now()).scalar_subquery()
        #: SQL true for a live job whose lease (or wait) has expired.
        self.expired = sa.and_(t.c.state.in_(LIVE_STATES), t.c.expires_at <= now)
        #: A batch of expired jobs, oldest expiry first, locked (skipping locked ones). The
        #: states are literals in its text, as in ``ix_<table>_live_expiry``'s predicate.
        live: Any = sa.bindparam("live", list(LIVE_STATES), literal_execute=True)
        self.expired_candidates = (
            sa.select(t.c.id, t.c.owner)
            .where(t.c.state.in_(live), t.c.expires_at <= clock)
            .order_by(t.c.expires_at)
            .limit(param("batch"))
            .with_for_update(skip_locked=True)
        )
        self._holders(p, clock)
        #: SQL true for a running attempt that saved no checkpoint.
        self.no_progress = sa.and_(
            t.c.state == RUNNING,
            sa.or_(t.c.checkpoint_at.is_(None), t.c.checkpoint_at < t.c.claimed_at),
        )
        ids: Any = sa.bindparam("b_ids", expanding=True)
        #: Jobs whose stored message or checkpoint cannot be read, failed.
        self.fail_corrupt = (
            sa.update(t)
            .where(t.c.id.in_(ids))
            .values(
                state=FAILED,
                owner=None,
                session=None,
                holder=None,
                expires_at=None,
                finished_at=now,
                error=GAVE_UP_CORRUPT,
                notify="FAILURE",
            )
        )
        finished_before = sa.and_(
            t.c.state.in_(FINISHED_STATES),
            t.c.followup_id.is_(None),
            t.c.finished_at
            <= sa.select(db_now() - param("older_than", sa.Double())).scalar_subquery(),
        )
        #: Finished jobs past retention, oldest first: the order makes the planner walk the
        #: finished_at index, where a bare LIMIT seq-scans the table when none is old enough.
        self.purgeable = (
            sa.select(t.c.id).where(finished_before).order_by(t.c.finished_at).limit(param("batch"))
        )
        #: Those jobs deleted (if still past retention).
        self.purge = sa.delete(t).where(t.c.id.in_(ids), finished_before)
        #: Jobs whose end the result backend has not been told yet, locked.
        self.noticed = (
            sa.select(t.c.id)
            .where(t.c.notify.is_not(None))
            .limit(param("batch"))
            .with_for_update(skip_locked=True)
        )
        #: A job marked again to be told (the result backend refused).
        self.set_notify = sa.update(t).where(p.by_id).values(notify=param("notify"))
        #: Jobs marked as told.
        self.clear_notices = sa.update(t).where(t.c.id.in_(ids)).values(notify=None)
        #: The doubling wait of a queued job sent again (``Parts.backoff``).
        self.backoff = p.backoff

    def _holders(self, p: Parts, clock: Any) -> None:
        """The statements on holders: gone, stale or idle ones, and the jobs they held."""
        t, h, d, now = p.table, p.holders, p.dialect, p.now
        # Holders whose session is gone: their process died (or its connection was cut).
        gone = d.session_gone(h)
        #: Whether the database tells a gone session in SQL (else ``Dialect.holder_gone``).
        self.sessions_in_sql = gone is not None
        gone_sql = gone if gone is not None else sa.true()
        #: Holders bound to a session that is gone (where the database cannot tell: every
        #: holder bound to one, for ``Dialect.holder_gone`` to judge), locked.
        self.gone_holders = d.locking_candidates(
            sa.select(h.c.id, h.c.owner, h.c.session)
            .where(h.c.session.is_not(None), gone_sql)
            .order_by(h.c.renewed_at)
            .limit(param("batch"))
        )
        #: A gone holder deleted, if it is still bound as read (and still gone).
        self.drop_holder = sa.delete(h).where(
            h.c.id == param("holder", h.c.id.type), h.c.session == param("session"), gone_sql
        )
        held_by = sa.and_(t.c.holder == param("holder", h.c.id.type), t.c.state == RUNNING)
        #: The running jobs of a holder (id, owner), locked.
        self.jobs_held = sa.select(t.c.id, t.c.owner).where(held_by).with_for_update()
        #: Those jobs' leases ended now, no longer bound (the expiry path re-publishes them).
        self.release_held = sa.update(t).where(held_by).values(holder=None, expires_at=now)
        # A holder that keeps its jobs' leases: its row is there and renewed in time.
        kept = sa.exists().where(h.c.id == t.c.holder, h.c.expires_at > clock)
        #: Running jobs no live holder keeps and whose lease has run out: their leases end
        #: now, no longer bound (a frozen or cut-off worker's jobs; one whose holder row is
        #: gone; one with neither a holder nor an expiry). The expiry path then re-publishes
        #: them; without this, a lease with no ``expires_at`` and no live holder would never
        #: be found by the search on ``expires_at``.
        self.release_stale = (
            sa.update(t)
            .where(t.c.state == RUNNING, t.c.expires_at.is_(None), ~kept, p.lease_end <= now)
            .values(holder=None, expires_at=now)
        )
        #: Holders no keeper renewed for ``b_idle`` seconds that hold no running job, deleted
        #: (a live keeper renews its row at least hourly).
        self.prune_holders = sa.delete(h).where(
            h.c.renewed_at <= now - param("idle", sa.Double()),
            ~sa.exists().where(t.c.holder == h.c.id, t.c.state == RUNNING),
        )

    def expired_batch(
        self, ids: list[str], *, grace: float, max_stalled: int | None, max_attempts: int | None
    ) -> tuple[Any, Any, Any]:
        """(poison select, give-up update, re-publish update) for the expired jobs ``ids``."""
        t = self.table
        now = db_now()
        give_up_when = []
        stalled_out: Any = sa.false()
        if max_stalled is not None:
            stalled_out = sa.and_(self.no_progress, t.c.stalled_attempts + 1 >= max_stalled)
            give_up_when.append(stalled_out)
        if max_attempts is not None:
            give_up_when.append(t.c.attempts >= max_attempts)
        poison = None
        give_up = None
        if give_up_when:
            poison = sa.select(t.c.id).where(t.c.id.in_(ids), self.expired, sa.or_(*give_up_when))
            reason = sa.case(
                (stalled_out, sa.literal(GAVE_UP_NO_PROGRESS)),
                else_=sa.literal(GAVE_UP_MAX_ATTEMPTS),
            )
            # MySQL evaluates SET left to right: read the old state before changing it.
            give_up = sa.update(t).ordered_values(
                (t.c.error, reason),
                (
                    t.c.stalled_attempts,
                    t.c.stalled_attempts + sa.case((self.no_progress, 1), else_=0),
                ),
                (t.c.state, FAILED),
                (t.c.owner, None),
                (t.c.session, None),
                (t.c.holder, None),
                (t.c.expires_at, None),
                (t.c.notify, "FAILURE"),
                (t.c.finished_at, now),
            )
        # A job still queued when its wait ran out may only be waiting in a long backlog:
        # each re-publish of it doubles the wait (``Parts.backoff``), so copies stay few.
        # A job of a group is never re-published here: it waits for its admission again (no
        # expiry), which counts its next start under the group's limit and rate.
        backoff = self.backoff
        grouped = t.c.lease_group.is_not(None)
        republish = sa.update(t).ordered_values(
            (
                t.c.stalled_attempts,
                sa.case(
                    (self.no_progress, t.c.stalled_attempts + 1),
                    (t.c.state == RUNNING, 0),
                    else_=t.c.stalled_attempts,
                ),
            ),
            (
                t.c.expires_at,
                sa.case(
                    (grouped, sa.null()),
                    else_=now + grace * sa.case((t.c.state == QUEUED, backoff), else_=1),
                ),
            ),
            (t.c.admitted_at, sa.case((grouped, sa.null()), else_=t.c.admitted_at)),
            (t.c.sends, sa.case((t.c.state == QUEUED, t.c.sends + 1), else_=0)),
            (t.c.state, QUEUED),
            (t.c.owner, None),
            (t.c.session, None),
            (t.c.holder, None),
        )
        return poison, give_up, republish
