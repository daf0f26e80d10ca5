"""How an attempt ends: done, failed, replaced, or its lease handed back."""

from __future__ import annotations

import sqlalchemy as sa

from ..schema import DONE, REPLACED, RUNNING
from .common import Parts, param, unindexed


class End:
    """The statements that end an attempt, each fenced by its lease's token."""

    def __init__(self, p: Parts) -> None:
        t, d = p.table, p.dialect
        # Idempotent for the token that ended it: a retry after a commit whose reply was lost
        # (the connection dropped) finds its own outcome and reports success.
        ended_by = sa.and_(p.by_id, t.c.token == param("token"))
        #: The job done, with its result.
        self.finish = (
            sa.update(t)
            .where(ended_by, unindexed(t.c.state).in_([RUNNING, DONE]))
            .values(p.ended() | {"state": DONE, "result": param("result", t.c.result.type)})
        )
        #: The job failed (or cancelled: ``b_state``), its checkpoint kept.
        self.fail = (
            sa.update(t)
            .where(ended_by, unindexed(t.c.state).in_([RUNNING, param("state")]))
            .values(
                p.ended()
                | {"state": param("state", t.c.state.type), "error": param("error", t.c.error.type)}
            )
        )
        #: The job replaced (``Task.replace``): its id goes to the replacement.
        self.replace = (
            sa.update(t).where(p.by_token).values(p.ended() | {"state": REPLACED, "result": None})
        )
        #: The lease given back (``Parts.handed_back``); returns the state after it.
        self.hand_back = d.with_returning(
            sa.update(t).where(p.by_token).ordered_values(*p.handed_back()), t.c.state
        )
        #: The lease given back for a Celery retry (or a run again after a conflict), whose
        #: message becomes the job's, due ``b_countdown`` seconds from now.
        self.hand_back_retry = d.with_returning(
            sa.update(t)
            .where(p.by_token)
            .ordered_values(
                (t.c.version, sa.case((p.ending, t.c.version), else_=param("version"))),
                (t.c.message, sa.case((p.ending, t.c.message), else_=param("message"))),
                (
                    t.c.run_after,
                    sa.case(
                        (p.ending, t.c.run_after), else_=p.now + param("countdown", sa.Double())
                    ),
                ),
                *p.handed_back(),
            ),
            t.c.state,
        )
        #: A job's state (read back where there is no RETURNING).
        self.state_of = sa.select(t.c.state).where(p.by_id)
        # A worker's main process saw the pool process holding the lease die. Only an attempt
        # that saved a checkpoint, under leases_max_attempts: one that died before any (a job
        # that kills its process) is left to the reaper, which counts it towards giving up.
        owned = sa.and_(
            p.by_id,
            t.c.owner == param("owner"),
            p.held,
            t.c.checkpoint_at >= t.c.claimed_at,
            sa.or_(
                param("max_attempts", sa.Integer()).is_(None),
                t.c.attempts < param("max_attempts", sa.Integer()),
            ),
        )
        #: The lease of a dead pool process handed back; returns (state, message).
        self.hand_back_owned = d.with_returning(
            sa.update(t).where(owned).ordered_values(*p.handed_back()), t.c.state, t.c.message
        )
        #: A job's state and message (read back where there is no RETURNING).
        self.state_and_message = sa.select(t.c.state, t.c.message).where(p.by_id)
