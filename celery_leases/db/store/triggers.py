"""The store's operations on the triggers of lease keys: a trigger of a held key is kept on the
key (it survives any end of the job that holds the key), and settled when that job ends: served
by a run that started after it and ended done, or run for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ...errors import ArgumentsError, CorruptJob
from ...message import KEY_STRATEGY_HEADER, NEWEST, Message
from .. import rows
from ..identity import checked_id, checked_key
from ..joined import joined as as_joined
from ..rows import Superseded
from ..schema import DONE, LIVE_STATES, QUEUED
from .base import KeyTaken, StoreBase

#: ``limits(task, group)``: the limit and rate of a group, as the task's options give them, or
#: None where they are not known (the task is not registered in this process).
LimitsOf = Callable[[str, str], "tuple[int | None, float | None] | None"]


@dataclass(frozen=True)
class Pended:
    """A trigger kept on its busy key: ``id``, the one its caller is given (the first waiting
    trigger's); ``freed``: no job holds the key any more (the trigger superseded its queued
    job, or the job ended between the trigger's read of the key and its write), so the key's
    waiting triggers are to be settled now. ``superseded``: the job the trigger superseded
    while it was queued, whose group's room is free."""

    id: str
    freed: bool = False
    superseded: Superseded | None = None


@dataclass(frozen=True)
class Settled:
    """What :meth:`TriggerOps.settle` did with the triggers waiting on a key: the run started for
    them (its message, to publish, due in ``due_in`` seconds: a debounced key's quiet), or
    ``served``: a run that started after them served them, and their callers are to be told its
    end (``notify``)."""

    followup: Message | None = None
    served: bool = False
    due_in: float = 0.0


def job_params(message: Message, text: str) -> dict[str, Any]:
    """The bind parameters of a job's message (``Parts.new_job``)."""
    return {
        "b_key": checked_key(message.key),
        "b_group": checked_key(message.group),
        "b_task": message.task,
        "b_generation": message.generation,
        "b_version": message.version,
        "b_message": text,
    }


class TriggerOps(StoreBase):
    """Keeping and settling the triggers of lease keys."""

    def _trigger(self, message: Message, text: str) -> Pended | None:
        """Hand ``message``, a trigger of its lease key, to the key when a job holds it: the
        id its caller is given (the first waiting trigger's). None when no job holds the key,
        or the job holding it is this very one (a copy of its message): record it then."""
        if self._holder(message) is None:
            return None
        return self._pended(message, text)

    def _holder(self, message: Message) -> str | None:
        """The job holding the lease key of ``message``; None when none does, or when the job
        holding it is this very one (a copy of its message)."""
        keys = self.sql.keys
        params = {"b_key": message.key}
        found = self._hot(lambda c: c.execute(keys.key_holder, params).first())
        if found is None or found[0] == message.id:
            return None
        return str(found[0])

    def _pended(self, message: Message, text: str) -> Pended:
        """``message`` kept on its held key as a waiting trigger.

        A trigger whose newest call wins (``KEY_STRATEGY_HEADER``: ``newest``) replaces the
        waiting trigger's message, then supersedes the job holding the key, in one
        transaction: a queued one ends ``superseded`` at once (``Pended.freed``: settle the
        key now), a running one is asked to stop at its next checkpoint, and ends
        ``superseded`` there. A debounced trigger replaces the message too (the newest
        arguments run), without superseding anything.

        The job holding the key may end between the trigger's read of it and this write, and
        settle the key before the trigger is on it: the key is read again after, and found
        free, the trigger is ``freed`` (settled now, not at the reaper's next pass)."""
        newest = message.headers.get(KEY_STRATEGY_HEADER) == NEWEST
        pending_id = self._pend(message, text, newest=newest or message.debounce is not None)
        superseded = None
        if newest:
            superseded = self._supersede(message.key, pending_id)
            if superseded is not None:
                return Pended(pending_id, freed=True, superseded=superseded)
        params = {"b_key": message.key}
        held = self._hot(lambda c: c.execute(self.sql.keys.key_holder, params).first())
        return Pended(pending_id, freed=held is None)

    def _supersede(self, key: str | None, pending_id: str) -> Superseded | None:
        """Supersede the job holding ``key`` (one transaction, its row locked): a queued one
        ends now (returned), a running one is asked to stop at its next checkpoint."""
        keys = self.sql.keys
        params = {"b_key": key, "b_pending_id": pending_id}

        def run(c: Connection) -> Superseded | None:
            found = c.execute(keys.key_job_locked, params).first()
            if found is None:
                return None
            job_id, state, group, admitted_at = found
            if state == QUEUED:
                c.execute(keys.supersede_queued, {"b_id": job_id})
                return Superseded(job_id, group, admitted_at is not None)
            c.execute(keys.supersede_running, {"b_id": job_id})
            return None

        if not self._schema_ready:
            self.check_schema()
        return self.db.run(run, single=False, direct=True)  # type: ignore[no-any-return]

    def _pend(self, message: Message, text: str, *, newest: bool = False) -> str:
        keys = self.sql.keys
        params = {"b_key": message.key, "b_id": checked_id(message.id), "b_message": text}
        add = keys.add_pending_newest if newest else keys.add_pending

        def run(c: Connection) -> str:
            found = self.dialect.rows(c, add, params, read_back=keys.pending_id_of)
            return str(found[0][0])

        return self._hot(run, reads_back=True, refused=ArgumentsError)  # type: ignore[no-any-return]

    def settle(
        self, key: str, *, connection: Any = None, limits: LimitsOf | None = None
    ) -> Settled:
        """Settle the triggers waiting on ``key``, in one transaction (the key's row locked): a
        run of the key that started after the latest of them and ended done serves them all
        (recorded as a finished job of their own, with its result, for their callers:
        ``Settled.served``); while a job holds the key, they wait for its end; else (no run
        started after them, or none that did ended done) a run of their own is recorded for them
        (``Settled.followup``), under the id their callers were given, with the newest
        trigger's arguments where newest wins or the key is debounced, without the first
        trigger's ``expires`` or countdown. It is due now, or, for a debounced key, ``quiet``
        seconds after the latest trigger and never later than ``max_wait`` after the first.

        A run of a group waits for its admission; ``limits(task, group)`` gives the group's
        limits, for its row where it has none (None: its row must exist). ``connection``: in
        the caller's transaction (an attempt that started inside one)."""
        if not self._schema_ready:
            self.check_schema()
        joined = as_joined(self, connection)
        try:
            if joined is not None:
                with self.db.wrapped_errors("triggers not settled"):
                    return self._settle(joined.executor, key, limits)
            return self.db.run(  # type: ignore[no-any-return]
                lambda c: self._settle(c, key, limits), single=False, direct=True
            )
        except KeyTaken:
            return Settled()  # a job took the key meanwhile: it settles them when it ends

    def _settle(self, c: Connection, key: str, limits: LimitsOf | None) -> Settled:
        keys = self.sql.keys
        found = c.execute(keys.pending_of, {"b_key": key}).first()
        if found is None or found[0] is None:
            return Settled()
        pending_id, text, pending_at, pending_since, triggers, now = found
        cleared = {"b_key": key, "b_pending_id": pending_id}
        try:
            trigger = rows.load_message(text, pending_id)
        except CorruptJob:
            c.execute(keys.clear_pending, cleared)  # nothing can run it
            return Settled()
        if trigger.id != pending_id:  # the newest trigger's message, under the shared id
            trigger = trigger.under_id(pending_id)
            text = trigger.dumps()
        after = {"b_key": key, "b_since": pending_at, "b_seq": triggers}
        first = c.execute(keys.started_since, after).first()
        if first is not None and first[1] in LIVE_STATES:
            return Settled()  # it may serve them; they are settled when it ends
        # Where the newest arguments must run (newest wins, a debounced key), only a run of
        # the waiting trigger's own message serves it: another run that started after it
        # (the key's job, due before it came and not yet claimed) has older arguments.
        newest = trigger.debounce is not None or trigger.headers.get(KEY_STRATEGY_HEADER) == NEWEST
        if first is not None and first[1] == DONE and not newest:
            run_id, _, result, _ = first
            served = job_params(trigger, text) | {
                "b_id": pending_id,
                "b_served_by": run_id,
                "b_state": DONE,
                "b_result": result,
                "b_error": None,
                "b_notify": "SUCCESS",
            }
            inserted = self._insert(c, keys.record_served, served)
            c.execute(keys.clear_pending, cleared)
            return Settled(served=inserted)
        if c.execute(keys.key_holder, {"b_key": key}).first() is not None:
            return Settled()  # a job holds the key and has not started: it will serve them
        followup = trigger.followup()
        due_in = 0.0
        first_at: float | None = None
        if followup.debounce is not None:
            quiet, max_wait = followup.debounce
            first_at = float(pending_since if pending_since is not None else pending_at)
            due_in = max(min(float(pending_at) + quiet, first_at + max_wait) - float(now), 0.0)
        if followup.group is not None and limits is not None:
            found_limits = limits(followup.task, followup.group)
            if found_limits is not None:
                self._ensure_group(c, followup.group, found_limits)
        settings = self.settings
        wait = settings.queued_timeout or settings.reap_grace
        params = job_params(followup, followup.dumps()) | {
            "b_id": pending_id,
            "b_countdown": due_in or None,
            "b_since": first_at,
            # Its message goes out right after this: if that publish is lost (its sender
            # dies), the reaper sends it once this has passed.
            "b_expires_in": due_in + wait,
        }
        inserted = self._insert(c, keys.record_followup, params)  # KeyTaken: rolled back
        c.execute(keys.clear_pending, cleared)
        return Settled(followup=followup if inserted else None, due_in=due_in)

    def _ensure_group(self, c: Connection, group: str, limits: tuple[Any, Any]) -> None:
        """Make group ``group``'s row with ``limits`` if it has none, in ``c``'s transaction."""
        params = {"b_group": group, "b_limit": limits[0], "b_rate": limits[1]}
        c.execute(self.sql.groups.ensure, params)

    def pending_keys(self, *, batch: int) -> list[str]:
        """Keys with triggers waiting and no queued or running job (which settles them when it
        ends), the longest waiting first."""
        pending = self.sql.keys.pending_keys
        return [r[0] for r in self._run(lambda c: c.execute(pending, {"b_batch": batch}).all())]

    # -- follow-ups kept on a job's row before revision 0003 -------------------------------

    def start_followup(self, job_id: str) -> Message | None:
        """Start the follow-up a celery-leases before revision 0003 kept on the ended job
        ``job_id`` (a rolling deploy's older clients): in one transaction, the follow-up is
        cleared from the ended job and recorded as a job of its own, so the key is never free
        in between. The message to publish, or None (none waits, or another caller took it)."""
        settings, keys = self.settings, self.sql.keys

        def hand_over(c: Any) -> Message | None:
            found = c.execute(keys.followup_of, {"b_id": job_id}).first()
            if found is None:
                return None
            text, followup_id = found
            c.execute(keys.clear_followup, {"b_id": job_id, "b_followup_id": followup_id})
            try:
                followup = rows.load_message(text, followup_id).followup()
            except CorruptJob:
                return None  # nothing can run it: dropped with the mark
            params = job_params(followup, followup.dumps()) | {
                "b_id": checked_id(followup.id),
                "b_countdown": None,
                "b_expires_in": settings.queued_timeout or settings.reap_grace,
            }
            return followup if self._insert(c, self.sql.record.register, params) else None

        if not self._schema_ready:
            self.check_schema()
        return self.db.run(hand_over, single=False, direct=True)  # type: ignore[no-any-return]

    def followups_pending(self, *, batch: int) -> list[str]:
        """Ids of ended jobs whose follow-up (kept on their row before revision 0003) was not
        started yet."""
        pending = self.sql.keys.followups_pending
        found = self._run(lambda c: c.execute(pending, {"b_batch": batch}).all())
        return [r[0] for r in found]


__all__ = ["LimitsOf", "Pended", "Settled", "Superseded", "TriggerOps", "job_params"]
