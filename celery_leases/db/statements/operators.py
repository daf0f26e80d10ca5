"""What operators do to jobs (``celery leases``, the Django admin) and what Celery decides
about them in a worker's main process: each a conditional write of one row."""

from __future__ import annotations

import sqlalchemy as sa

from ..schema import CANCELLED, FAILED, LIVE_STATES, QUEUED, RUNNING
from .common import CANCELLED_TEXT, Parts, param


class Operators:
    """The statements of operators' actions, and of ends decided outside any attempt."""

    def __init__(self, p: Parts) -> None:
        t, now = p.table, p.now
        no_live_lease = sa.or_(
            t.c.state == QUEUED, sa.and_(t.c.state == RUNNING, p.lease_end <= now)
        )
        # Ended outside any attempt; ``b_notify``: the Celery state the reaper then stores.
        ended_outside = {
            "owner": None,
            "session": None,
            "holder": None,
            "expires_at": None,
            "stop_requested": None,
            "error": param("error"),
            "notify": param("notify"),
            "finished_at": now,
        }
        #: A job no live lease holds, failed (the reaper's give-up, an unknown task).
        self.give_up = (
            sa.update(t).where(p.by_id, no_live_lease).values(ended_outside | {"state": FAILED})
        )
        #: What Celery decided in a worker's main process (a revoke, an expiry, a hard time
        #: limit): the result backend says so already, whatever attempt holds the job.
        self.end_live = (
            sa.update(t)
            .where(p.by_id, t.c.state.in_(LIVE_STATES))
            .values(ended_outside | {"state": param("state")})
        )
        #: A live job no live lease holds, ended as Celery decided (an expired message): a
        #: job an attempt runs under a live lease is left to it, as Celery lets a running
        #: task go on when another copy of its message expires.
        self.end_unheld = (
            sa.update(t)
            .where(p.by_id, t.c.state.in_(LIVE_STATES), no_live_lease)
            .values(ended_outside | {"state": param("state")})
        )
        #: A queued job whose message a worker discarded (it does not know its task, as an
        #: older worker of a rolling deploy): the reaper sends it again ``b_wait`` seconds from
        #: now (then with doubling waits), and ``b_error`` says why it waits.
        self.wait_for_worker = (
            sa.update(t)
            .where(p.by_id, t.c.state == QUEUED)
            .values(expires_at=now + param("wait", sa.Double()) * p.backoff, error=param("error"))
        )
        #: A job recorded whose publish failed, deleted.
        self.forget = sa.delete(t).where(p.by_id, t.c.state == QUEUED, t.c.token == 0)
        #: A queued job cancelled: its message is dropped at its claim.
        self.cancel_queued = (
            sa.update(t)
            .where(p.by_id, t.c.state == QUEUED)
            .values(
                state=CANCELLED,
                expires_at=None,
                error=CANCELLED_TEXT,
                notify="REVOKED",
                finished_at=now,
            )
        )
        #: A running job's lease expired now (its host is dead).
        self.release = (
            sa.update(t).where(p.by_id, t.c.state == RUNNING).values(expires_at=now, holder=None)
        )
        #: Running attempts asked to stop at their next checkpoint (``b_kind``).
        self.request_stop = (
            sa.update(t)
            .where(t.c.id.in_(sa.bindparam("b_ids", expanding=True)), t.c.state == RUNNING)
            .values(stop_requested=param("kind"))
        )
        #: Every running attempt of an owner (a worker shutting down) asked to stop; a
        #: shutdown's preemption never overwrites a pending cancel or supersede (the job ends).
        self.request_stop_owned_by = (
            sa.update(t)
            .where(
                t.c.state == RUNNING,
                t.c.owner.like(param("owner_like"), escape="\\"),
                sa.or_(t.c.stop_requested.is_(None), ~p.ending),
            )
            .values(stop_requested=param("kind"))
        )
        #: A finished job queued again, its checkpoint kept.
        grouped = t.c.lease_group.is_not(None)
        self.requeue = (
            sa.update(t)
            .where(p.by_id, t.c.state.in_(sa.bindparam("b_from_states", expanding=True)))
            .values(
                state=QUEUED,
                owner=None,
                session=None,
                holder=None,
                # A job of a group waits for a new admission (no expiry: no reaper re-sends it).
                admitted_at=None,
                expires_at=sa.case(
                    (grouped, sa.null()), else_=now + param("queued_timeout", sa.Double())
                ),
                error=None,
                finished_at=None,
                stalled_attempts=0,
                stop_requested=None,
            )
        )
