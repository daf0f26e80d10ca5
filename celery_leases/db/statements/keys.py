"""Lease keys: the job holding a key, the trigger it coalesces, its follow-up, its cursor."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..functions import least
from ..schema import (
    DONE,
    FINISHED_STATES,
    LIVE_STATES,
    QUEUED,
    RUNNING,
    SCHEMA_VERSION,
    SUPERSEDED,
)
from .common import SUPERSEDED_TEXT, Parts, param, unindexed


class Keys:
    """The statements of lease keys.

    At most one job holds a key (``schema.KEY_HELD``: a live one). A trigger of a held key is
    kept on the key, never on a job (``pending``): it waits there, whatever becomes of the job
    that holds the key, until a run of the key that started after it serves it, or a run is
    started for it (``store.TriggerOps.settle``).
    """

    def __init__(self, p: Parts) -> None:
        t, d = p.table, p.dialect
        holds_key = d.holds_key(t, param("key"), LIVE_STATES)
        #: The job holding key ``b_key``: (id, attempts, follow-up id).
        self.key_holder = sa.select(t.c.id, t.c.attempts, t.c.followup_id).where(holds_key)
        self._triggers(p)
        self._newest(p, holds_key)
        finished_with_followup = sa.and_(
            t.c.followup_id.is_not(None), t.c.state.in_(FINISHED_STATES)
        )
        # Follow-ups kept on an ended job's row by a celery-leases before revision 0003: each
        # started in one transaction (its row locked, the follow-up cleared, the follow-up
        # recorded as a job of its own), until none is left.
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
        self._debounce(p)

    def _debounce(self, p: Parts) -> None:
        t, d, now = p.table, p.dialect, p.now
        # The first trigger of a burst recorded the job (``created_at``) with a due time
        # (``run_after``); each later one moves that time, bounded by the first's max wait.
        quiet, max_wait = param("quiet", sa.Double()), param("max_wait", sa.Double())
        due = least(now + quiet, t.c.created_at + max_wait)
        waiting = sa.and_(
            p.by_id,
            t.c.lease_key == param("key", t.c.lease_key.type),
            t.c.task == param("task", t.c.task.type),
            unindexed(t.c.state) == QUEUED,
            t.c.attempts == 0,
            t.c.started_at.is_(None),
            # Due already: the burst is closed (its message may be on its way to a worker);
            # a later trigger waits as its follow-up. Moving it again would make every copy
            # in a lagging queue stale, and a steady stream of triggers would hold the run
            # back past its maximum wait.
            t.c.run_after > now,
        )
        # MySQL evaluates SET left to right: expires_at is computed from ``due`` again, not
        # from the run_after just written (PostgreSQL and SQLite would read the old one).
        moved = (
            sa.update(t)
            .where(waiting)
            .values(
                message=param("message", t.c.message.type),
                version=param("version", t.c.version.type),
                run_after=due,
                expires_at=due + param("expires_in", sa.Double()),
            )
        )
        #: A debounced trigger (``b_message``, version ``b_version``) of key ``b_key`` moved
        #: into its job ``b_id`` that has not started: its arguments, its due time
        #: ``min(now + b_quiet, created_at + b_max_wait)``; returns the seconds until that time.
        self.debounce = d.with_returning(moved, t.c.run_after - now)
        #: The seconds until job ``b_id`` is due (read back where there is no RETURNING).
        self.due_in = sa.select(t.c.run_after - now).where(p.by_id)

    def _triggers(self, p: Parts) -> None:
        t, k, d, now = p.table, p.keys, p.dialect, p.now
        columns = ["lease_key", "pending_id", "pending", "pending_at", "pending_since", "triggers"]
        trigger = sa.select(
            param("key", k.c.lease_key.type),
            param("id", k.c.pending_id.type),
            param("message", k.c.pending.type),
            now,
            now,
            sa.literal(1, sa.BigInteger()),
        )
        counted = sa.func.coalesce(k.c.triggers, 0) + 1
        #: A trigger (``b_id``, ``b_message``) of the held key ``b_key`` kept on the key: the
        #: first one waiting gives its id, its message and ``pending_since``; every one moves
        #: ``pending_at``.
        self.add_pending = d.upsert(
            k,
            trigger,
            columns,
            "lease_key",
            update=lambda new: {
                "pending_id": sa.func.coalesce(k.c.pending_id, new["pending_id"]),
                "pending": sa.func.coalesce(k.c.pending, new["pending"]),
                "pending_at": new["pending_at"],
                "pending_since": sa.func.coalesce(k.c.pending_since, new["pending_since"]),
                "triggers": counted,
            },
            returning=(k.c.pending_id,),
        )
        #: The same for a key whose newest trigger wins (``lease_key_strategy="newest"``, and
        #: a debounced key): the first one waiting gives the id, the newest one the message.
        self.add_pending_newest = d.upsert(
            k,
            trigger,
            columns,
            "lease_key",
            update=lambda new: {
                "pending_id": sa.func.coalesce(k.c.pending_id, new["pending_id"]),
                "pending": new["pending"],
                "pending_at": new["pending_at"],
                "pending_since": sa.func.coalesce(k.c.pending_since, new["pending_since"]),
                "triggers": counted,
            },
            returning=(k.c.pending_id,),
        )
        by_key = k.c.lease_key == param("key", k.c.lease_key.type)
        #: The triggers waiting on key ``b_key`` (id, message, the latest's time, the first's,
        #: the latest's number, and the clock), its row locked.
        self.pending_of = (
            sa.select(
                k.c.pending_id, k.c.pending, k.c.pending_at, k.c.pending_since, k.c.triggers, now
            )
            .where(by_key)
            .with_for_update()
        )
        #: The id the triggers waiting on key ``b_key`` were given (read back).
        self.pending_id_of = sa.select(k.c.pending_id).where(by_key)
        #: The triggers waiting on ``b_key`` as ``b_pending_id``, gone (served or run for).
        self.clear_pending = (
            sa.update(k)
            .where(by_key, k.c.pending_id == param("pending_id", k.c.pending_id.type))
            .values(pending_id=None, pending=None, pending_at=None, pending_since=None)
        )
        #: The run of key ``b_key`` that started after the triggers waiting on it and serves
        #: them: (id, state, result, error). Started after: its first claim read the key's
        #: trigger count ``b_seq`` (the latest trigger's number) or more, whatever the clock
        #: did meanwhile; for a run claimed before revision 0006, its start strictly after
        #: ``b_since`` (a run that started in the same tick of the clock may have started
        #: before the trigger: not counting it costs one more run at most). A live one first
        #: (they wait for its end), then the first that ended done; one that ended otherwise
        #: serves nothing (it is only returned when no run did better).
        seq = param("seq", sa.BigInteger())
        after = sa.or_(
            t.c.started_seq >= seq,
            sa.and_(t.c.started_seq.is_(None), t.c.started_at > param("since", sa.Double())),
        )
        self.started_since = (
            sa.select(t.c.id, t.c.state, t.c.result, t.c.error)
            .where(t.c.lease_key == param("key"), t.c.started_at.is_not(None), after)
            .order_by(
                sa.case((t.c.state.in_(LIVE_STATES), 0), (t.c.state == DONE, 1), else_=2),
                t.c.started_at,
            )
            .limit(1)
        )
        live_job = sa.exists().where(t.c.lease_key == k.c.lease_key, t.c.state.in_(LIVE_STATES))
        #: Keys with triggers waiting and no live job, the longest waiting first: a live job
        #: of the key settles them at its end, so a pass never settles a busy key in vain.
        self.pending_keys = (
            sa.select(k.c.lease_key)
            .where(k.c.pending_id.is_not(None), ~live_job)
            .order_by(k.c.pending_at)
            .limit(param("batch"))
        )
        #: The run of the triggers waiting on a key (``b_id``, their id), queued (or waiting,
        #: in its group), due in ``b_countdown`` seconds; it counts as made when the first of
        #: them came (``b_since``), so a debounced follow-up's ``max_wait`` counts from it.
        self.record_followup = d.insert_unless_exists(
            t,
            {"id": param("id"), "token": 0}
            | p.new_job()
            | {"created_at": sa.func.coalesce(param("since", sa.Double()), now)}
            | p.queued(),
        )
        #: The triggers given ``b_id`` served by run ``b_served_by``: a finished job of their
        #: own, whose end (``b_state``, ``b_result``, ``b_error``) their callers are told.
        self.record_served = d.insert_unless_exists(
            t,
            {
                "id": param("id"),
                "token": 0,
                "task": param("task", t.c.task.type),
                "generation": param("generation", sa.Integer()),
                "version": param("version", t.c.version.type),
                "message": param("message", t.c.message.type),
                "lease_key": param("key", t.c.lease_key.type),
                "state": param("state", t.c.state.type),
                "result": param("result", t.c.result.type),
                "error": param("error", t.c.error.type),
                "served_by": param("served_by", t.c.served_by.type),
                "notify": param("notify", t.c.notify.type),
                "attempts": 0,
                "stalled_attempts": 0,
                "sends": 0,
                "created_at": now,
                "finished_at": now,
                "schema_version": SCHEMA_VERSION,
            },
        )

    def _newest(self, p: Parts, holds_key: Any) -> None:
        t, now = p.table, p.now
        # Never the run recorded for the waiting triggers themselves (``b_pending_id``): it may
        # have been recorded between their trigger's read of the key and this write.
        not_theirs = t.c.id != param("pending_id", t.c.id.type)
        #: The job holding key ``b_key`` (id, state, group, admitted), locked: a supersede is
        #: one transaction, so the job cannot move between queued and running under it (a
        #: hand-back, a claim) and escape it.
        self.key_job_locked = (
            sa.select(t.c.id, t.c.state, t.c.lease_group, t.c.admitted_at)
            .where(holds_key, t.c.state.in_(LIVE_STATES), not_theirs)
            .with_for_update()
        )
        #: The queued job ``b_id`` (never claimed, or waiting to resume) ended superseded: its
        #: message is dropped at its claim, and the reaper tells the result backend REVOKED.
        self.supersede_queued = (
            sa.update(t)
            .where(p.by_id, t.c.state == QUEUED)
            .values(
                state=SUPERSEDED,
                owner=None,
                session=None,
                holder=None,
                expires_at=None,
                stop_requested=None,
                error=SUPERSEDED_TEXT,
                notify="REVOKED",
                finished_at=now,
            )
        )
        #: The running job ``b_id`` asked to stop superseded at its next checkpoint; an
        #: operator's cancel stands.
        self.supersede_running = (
            sa.update(t)
            .where(
                p.by_id,
                t.c.state == RUNNING,
                sa.or_(t.c.stop_requested.is_(None), t.c.stop_requested != "cancel"),
            )
            .values(stop_requested="supersede")
        )

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
        #: An operator's (or a test's) cursor, written only while no job holds the key and no
        #: trigger waits on it; NULL clears it. Job and token NULL: no attempt wrote it.
        waiting = k.alias("waiting")
        self.set_cursor = d.upsert(
            k,
            sa.select(
                param("key", k.c.lease_key.type),
                param("cursor", k.c.cursor_state.type),
                sa.cast(sa.null(), k.c.job_id.type),
                sa.cast(sa.null(), sa.BigInteger()),
                p.now,
            ).where(
                ~sa.exists(sa.select(t.c.id).where(holds_key)),
                # nor triggers waiting on it (their run starts from the cursor)
                ~sa.exists(
                    sa.select(waiting.c.lease_key).where(
                        waiting.c.lease_key == param("key", k.c.lease_key.type),
                        waiting.c.pending_id.is_not(None),
                    )
                ),
            ),
            columns,
            "lease_key",
        )
