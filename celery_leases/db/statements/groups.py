"""Job groups: a group's row (its limit, rate and token bucket), locked by each admission, and
the admission of its oldest waiting jobs."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..functions import greatest, least
from ..schema import LIVE_STATES, QUEUED
from .common import Parts, param


def due_now(t: sa.Table, now: Any) -> Any:
    """SQL true for a job that may run now: no due time (``run_after``), or one passed."""
    return sa.or_(t.c.run_after.is_(None), t.c.run_after <= now)


class Groups:
    """The statements of job groups.

    An admission is one transaction per group: the group's row is locked first (``define``
    or ``lock``), so admissions of one group never overlap; under that lock the group's live
    admitted jobs are counted (``facts``), its oldest waiting jobs taken (``oldest_waiting``)
    up to its limit and its bucket, each admitted (``admit``), and the bucket written back
    (``take_tokens``). The admitted count is read from the jobs themselves: an end needs no
    write on the group, and a process that dies anywhere leaves nothing to repair.
    """

    def __init__(self, p: Parts) -> None:
        t, g, d, now = p.table, p.groups, p.dialect, p.now
        self.table = g
        self._lists(p)
        by_name = g.c.name == param("group", g.c.name.type)
        of_group = t.c.lease_group == param("group", t.c.lease_group.type)
        #: The group ``b_group`` made, or its limit ``b_limit`` and rate ``b_rate`` written; its
        #: row is locked until the transaction ends. A new group's bucket is full.
        self.define = d.upsert(
            g,
            sa.select(
                param("group", g.c.name.type),
                param("limit", sa.Integer()),
                param("rate", sa.Double()),
                sa.literal(1.0, sa.Double()),
                now,
                now,
            ),
            ["name", "group_limit", "rate", "tokens", "refilled_at", "created_at"],
            "name",
            update=lambda new: {"group_limit": new["group_limit"], "rate": new["rate"]},
        )
        #: The row of group ``b_group`` made with limit ``b_limit`` and rate ``b_rate`` if it
        #: is missing (a group whose first job no client recorded: sent by name, a key's
        #: follow-up, an operator's retry); an existing row keeps its own. Locked until the
        #: transaction ends, as ``define``'s.
        self.ensure = d.upsert(
            g,
            sa.select(
                param("group", g.c.name.type),
                param("limit", sa.Integer()),
                param("rate", sa.Double()),
                sa.literal(1.0, sa.Double()),
                now,
                now,
            ),
            ["name", "group_limit", "rate", "tokens", "refilled_at", "created_at"],
            "name",
            update=lambda new: {"name": new["name"]},
        )
        #: The row of group ``b_group``, locked until the transaction ends.
        self.lock = sa.select(g.c.name).where(by_name).with_for_update()
        live_admitted = sa.and_(of_group, t.c.state.in_(LIVE_STATES), t.c.admitted_at.is_not(None))
        #: Group ``b_group`` as its admission reads it: the clock (read once: the bucket's
        #: arithmetic uses that one reading), its limit, its rate, its bucket's tokens and
        #: when they were counted, and how many of its jobs are admitted and live.
        self.facts = sa.select(
            now,
            g.c.group_limit,
            g.c.rate,
            g.c.tokens,
            g.c.refilled_at,
            sa.select(sa.func.count()).where(live_admitted).scalar_subquery(),
        ).where(by_name)
        waiting_of_group = sa.and_(of_group, t.c.state == QUEUED, t.c.admitted_at.is_(None))
        #: The ``b_n`` oldest waiting jobs of group ``b_group`` that are due (first in, first
        #: out), locked. Ordered as ``ix_<table>_group_waiting`` is (admitted_at is NULL in
        #: every row), ties of the clock broken as ``Dialect.arrival_order`` says: the index is
        #: read in order up to ``b_n``, never the group's whole backlog sorted. A job due later
        #: (a countdown, a debounce, a retry's) is passed over: admitted now, it would hold a
        #: place under the limit, and a token, for a start that comes later, when other
        #: tokens start jobs too; its message, sent for its due time, asks for its admission.
        self.oldest_waiting = (
            sa.select(t.c.id)
            .where(waiting_of_group, due_now(t, now))
            .order_by(t.c.admitted_at, *d.arrival_order(t))
            .limit(param("n", sa.Integer()))
            .with_for_update()
        )
        # Not before its own countdown, nor before its token's time ``b_due_at`` (the clock
        # the admission read, plus the token's wait: one clock reading for the whole bucket).
        due_at = param("due_at", sa.Double())
        due = greatest(sa.func.coalesce(t.c.run_after, due_at), due_at)
        #: The waiting job ``b_id`` admitted: it may run at ``b_due_at`` (its token's time),
        #: and the reaper re-publishes it ``b_wait`` seconds after that if its message is
        #: lost. MySQL evaluates SET left to right: expires_at reads the old run_after.
        self.admit = (
            sa.update(t)
            .where(p.by_id, p.waiting)
            .ordered_values(
                (t.c.expires_at, due + param("wait", sa.Double())),
                (t.c.run_after, due),
                (t.c.admitted_at, now),
                (t.c.sends, 0),
            )
        )
        ids: Any = sa.bindparam("b_ids", expanding=True)
        #: The jobs just admitted: (id, message, seconds until they may run).
        self.admitted = sa.select(t.c.id, t.c.message, t.c.run_after - now).where(t.c.id.in_(ids))
        #: Group ``b_group``'s bucket after an admission: ``b_tokens`` at ``b_at``.
        self.take_tokens = (
            sa.update(g)
            .where(by_name)
            .values(
                tokens=param("tokens", sa.Double()),
                refilled_at=param("at", sa.Double()),
                admitted_at=now,
            )
        )

    def _lists(self, p: Parts) -> None:
        """The reads over all groups: the reaper's, and the operators'."""
        t, g, now = p.table, self.table, p.now
        #: SQL: the tokens of a bucket now (refilled at ``rate`` a second, at most 1).
        self.tokens_now = sa.case(
            (g.c.rate.is_(None), g.c.tokens),
            # A clock stepped back refills nothing until it passes refilled_at again.
            else_=least(1.0, g.c.tokens + greatest(now - g.c.refilled_at, 0.0) * g.c.rate),
        )
        waiting_of_row = sa.and_(
            t.c.lease_group == g.c.name, t.c.state == QUEUED, t.c.admitted_at.is_(None)
        )
        live_of_row = sa.and_(
            t.c.lease_group == g.c.name, t.c.state.in_(LIVE_STATES), t.c.admitted_at.is_not(None)
        )
        admitted = sa.select(sa.func.count()).where(live_of_row).scalar_subquery()
        horizon = param("horizon", sa.Double())
        #: Groups an admission would admit a job of now (``b_batch`` of them, the longest
        #: since an admission first: a reaper pass serves them round-robin): a waiting job
        #: due, room under the limit, and a token due within ``b_horizon`` seconds. A full
        #: group is not read again and again: it never stands in the way of one with room.
        self.with_room = (
            sa.select(g.c.name)
            .where(
                sa.exists().where(waiting_of_row, due_now(t, now)),
                sa.or_(g.c.group_limit.is_(None), admitted < g.c.group_limit),
                sa.or_(
                    g.c.rate.is_(None),
                    self.tokens_now + horizon * g.c.rate >= 1.0,
                    # The clock stepped back past its last count: its admission says so and
                    # counts from now on, instead of waiting for the clock to catch up.
                    g.c.refilled_at > now,
                ),
            )
            .order_by(sa.func.coalesce(g.c.admitted_at, 0.0), g.c.name)
            .limit(param("batch"))
        )
        has_row = sa.exists().where(g.c.name == t.c.lease_group)
        #: Groups of waiting jobs that have no row (``b_batch`` of them), with a task of each:
        #: left by an earlier release (a client that died between recording and admitting,
        #: a message sent by name). Their rows are made from the task's options.
        self.orphans = (
            sa.select(t.c.lease_group, sa.func.min(t.c.task))
            .where(
                t.c.lease_group.is_not(None),
                t.c.state == QUEUED,
                t.c.admitted_at.is_(None),
                ~has_row,
            )
            .group_by(t.c.lease_group)
            .limit(param("batch"))
        )
        waiting = sa.select(sa.func.count()).where(waiting_of_row).scalar_subquery()
        columns = sa.select(
            g.c.name,
            g.c.group_limit,
            g.c.rate,
            self.tokens_now,
            admitted.label("admitted"),
            waiting.label("waiting"),
        )
        #: Every group (``leases groups``): name, limit, rate, tokens now, admitted and live,
        #: waiting.
        self.listing = columns.order_by(g.c.name)
        names: Any = sa.bindparam("b_names", expanding=True)
        #: The groups named ``b_names`` as ``listing`` shows them (a page of the admin's).
        self.listing_of = columns.where(g.c.name.in_(names)).order_by(g.c.name)
        #: The ``b_n`` groups with the most jobs waiting, then admitted, as ``listing`` shows
        #: them (the metrics' groups).
        busiest_first: Any = (sa.desc("waiting"), sa.desc("admitted"), g.c.name)
        self.busiest = columns.order_by(*busiest_first).limit(param("n", sa.Integer()))
        #: How many groups there are.
        self.count = sa.select(sa.func.count()).select_from(g)
