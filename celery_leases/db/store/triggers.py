"""The store's operations on the triggers of lease keys: a trigger of a held key is kept on the
key (it survives any end of the job that holds the key), and settled when that job ends: served
by a run that started after it and ended done, or run for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ...errors import ArgumentsError, CorruptJob
from ...message import KEY_STRATEGY_HEADER, NEWEST, Message
from .. import rows
from ..identity import checked_id, checked_key
from ..joined import joined as as_joined
from ..schema import DONE, LIVE_STATES
from .base import KeyTaken, StoreBase


@dataclass(frozen=True)
class Pended:
    """A trigger kept on its busy key: ``id``, the one its caller is given (the first waiting
    trigger's); ``freed``: it superseded the key's queued job, so the key is free and its
    waiting triggers are to be settled now (``keys.settle``)."""

    id: str
    freed: bool = False


@dataclass(frozen=True)
class Settled:
    """What :meth:`Triggers.settle` did with the triggers waiting on a key: the run started for
    them (its message, to publish), or ``served``: a run that started after them served them,
    and their callers are to be told its end (``notify``)."""

    followup: Message | None = None
    served: bool = False


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


class Triggers(StoreBase):
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
        waiting trigger's message, then supersedes the job holding the key: a queued one ends
        ``superseded`` at once (``Pended.freed``: settle the key now), a running one is asked
        to stop at its next checkpoint, and ends ``superseded`` there."""
        keys = self.sql.keys
        newest = message.headers.get(KEY_STRATEGY_HEADER) == NEWEST
        pending_id = self._pend(message, text, newest=newest)
        if not newest:
            return Pended(pending_id)
        params = {"b_key": message.key, "b_pending_id": pending_id}
        if self._count(keys.supersede_queued, params):
            return Pended(pending_id, freed=True)
        self._count(keys.supersede_running, params)
        return Pended(pending_id)

    def _pend(self, message: Message, text: str, *, newest: bool = False) -> str:
        keys = self.sql.keys
        params = {"b_key": message.key, "b_id": checked_id(message.id), "b_message": text}
        add = keys.add_pending_newest if newest else keys.add_pending

        def run(c: Connection) -> str:
            found = self.dialect.rows(c, add, params, read_back=keys.pending_id_of)
            return str(found[0][0])

        return self._hot(run, reads_back=True, refused=ArgumentsError)  # type: ignore[no-any-return]

    def settle(self, key: str, *, connection: Any = None) -> Settled:
        """Settle the triggers waiting on ``key``, in one transaction (the key's row locked): a
        run of the key that started after the latest of them and ended done serves them all
        (recorded as a finished job of their own, with its result, for their callers:
        ``Settled.served``); while a job holds the key, they wait for its end; else (no run
        started after them, or none that did ended done) a run of their own is recorded for them
        (``Settled.followup``), under the id their callers were given, as soon as possible:
        without the first trigger's ``expires`` or countdown. ``connection``: in the caller's
        transaction (an attempt that started inside one)."""
        if not self._schema_ready:
            self.check_schema()
        joined = as_joined(self, connection)
        try:
            if joined is not None:
                with self.db.wrapped_errors("triggers not settled"):
                    return self._settle(joined.executor, key)
            return self.db.run(  # type: ignore[no-any-return]
                lambda c: self._settle(c, key), single=False, direct=True
            )
        except KeyTaken:
            return Settled()  # a job took the key meanwhile: it settles them when it ends

    def _settle(self, c: Connection, key: str) -> Settled:
        keys = self.sql.keys
        found = c.execute(keys.pending_of, {"b_key": key}).first()
        if found is None or found[0] is None:
            return Settled()
        pending_id, text, pending_at = found
        cleared = {"b_key": key, "b_pending_id": pending_id}
        try:
            trigger = rows.load_message(text, pending_id)
        except CorruptJob:
            c.execute(keys.clear_pending, cleared)  # nothing can run it
            return Settled()
        if trigger.id != pending_id:  # the newest trigger's message, under the shared id
            trigger = trigger.under_id(pending_id)
            text = trigger.dumps()
        first = c.execute(keys.started_since, {"b_key": key, "b_since": pending_at}).first()
        if first is not None and first[1] in LIVE_STATES:
            return Settled()  # it may serve them; they are settled when it ends
        if first is not None and first[1] == DONE:
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
        followup_text = followup.dumps()
        settings = self.settings
        params = job_params(followup, followup_text) | {
            "b_id": pending_id,
            "b_countdown": None,
            # Its message goes out right after this: if that publish is lost (its sender
            # dies), the reaper sends it once this has passed.
            "b_expires_in": settings.queued_timeout or settings.reap_grace,
        }
        inserted = self._insert(c, self.sql.record.register, params)  # KeyTaken: rolled back
        c.execute(keys.clear_pending, cleared)
        return Settled(followup=followup if inserted else None)

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


__all__ = ["Pended", "Settled", "Triggers", "job_params"]
