"""Lease keys: the job holding a key, the trigger it coalesces, its follow-up, its cursor."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..schema import FINISHED_STATES, LIVE_STATES, RUNNING
from .common import Parts, param, unindexed


class Keys:
    """The statements of lease keys.

    The job holding a key (``schema.KEY_HELD``) is live, or ended with a follow-up to start. A
    trigger of a held key is read first (no lock, nothing written in the usual case): a job
    never claimed yet (attempts = 0) starts after it and absorbs it; one with a follow-up
    already has the job that serves it. Otherwise the trigger becomes the follow-up of a job
    that has run, conditionally.
    """

    def __init__(self, p: Parts) -> None:
        t, d = p.table, p.dialect
        holds_key = d.holds_key(t, param("key"), LIVE_STATES)
        #: The job holding key ``b_key``: (id, attempts, follow-up id).
        self.key_holder = sa.select(t.c.id, t.c.attempts, t.c.followup_id).where(holds_key)
        #: A trigger (``b_id``, ``b_message``) made the follow-up of the key's job that has
        #: run and has none yet. MySQL evaluates SET left to right: the text first.
        self.set_followup = d.with_returning(
            sa.update(t)
            .where(holds_key, t.c.attempts > 0, t.c.followup_id.is_(None))
            .ordered_values(
                (t.c.followup, param("message", t.c.followup.type)),
                (t.c.followup_id, param("id", t.c.followup_id.type)),
            ),
            t.c.id,
        )
        finished_with_followup = sa.and_(
            t.c.followup_id.is_not(None), t.c.state.in_(FINISHED_STATES)
        )
        # The hand-over of the key to the follow-up, in one transaction: the ended job's row
        # locked, the follow-up cleared (the key is free inside the transaction only), the
        # follow-up recorded as a job of its own (``Record.register``).
        #: The follow-up (message, id) of the ended job ``b_id``, its row locked.
        self.followup_of = (
            sa.select(t.c.followup, t.c.followup_id)
            .where(p.by_id, finished_with_followup)
            .with_for_update()
        )
        #: Ended jobs whose follow-up was not started (their ender died).
        self.followups_pending = (
            sa.select(t.c.id).where(finished_with_followup).limit(param("batch"))
        )
        #: The follow-up ``b_followup_id`` cleared from the ended job ``b_id``.
        self.clear_followup = (
            sa.update(t)
            .where(p.by_id, t.c.followup_id == param("followup_id"))
            .values(followup=None, followup_id=None)
        )
        self._cursors(p, holds_key)

    def _cursors(self, p: Parts, holds_key: Any) -> None:
        t, k, d = p.table, p.keys, p.dialect
        assert k is not None
        columns = ["lease_key", "cursor_state", "job_id", "token", "cursor_at"]
        #: The cursor of key ``b_key``.
        self.cursor_of = sa.select(k.c.cursor_state).where(k.c.lease_key == param("key"))
        # Fenced by the live job's token; the job's row is read with a share lock, so a
        # claim that bumps the token waits for this write, or this write sees the new token
        # and writes nothing (a stale attempt cannot move the cursor).
        holder = (
            sa.select(t.c.id)
            .where(
                p.by_id,
                t.c.token == param("token"),
                unindexed(t.c.state) == RUNNING,
                t.c.lease_key == param("key"),
            )
            .with_for_update(read=True)
        )
        written = sa.select(
            param("key", k.c.lease_key.type),
            param("cursor", k.c.cursor_state.type),
            param("id", k.c.job_id.type),
            param("token", sa.BigInteger()),
            p.now,
        ).where(sa.exists(holder))
        #: A key's cursor saved by the attempt holding its live job (``b_id``, ``b_token``).
        self.save_cursor = d.upsert(k, written, columns, "lease_key")
        #: The same in a transaction of the caller's, bounding its idle time as a checkpoint's.
        self.save_cursor_in_tx = d.upsert(
            k, d.with_idle_guard(written, "leases_cursor_idle_guard"), columns, "lease_key"
        )
        #: An operator's (or a test's) cursor, written only while no job holds the key; NULL
        #: clears it. Job and token NULL: no attempt wrote it.
        self.set_cursor = d.upsert(
            k,
            sa.select(
                param("key", k.c.lease_key.type),
                param("cursor", k.c.cursor_state.type),
                sa.cast(sa.null(), k.c.job_id.type),
                sa.cast(sa.null(), sa.BigInteger()),
                p.now,
            ).where(~sa.exists(sa.select(t.c.id).where(holds_key))),
            columns,
            "lease_key",
        )
