"""The store's operations for clients: recording the job of a message about to be published,
or handing a trigger of a busy lease key to the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ...errors import ArgumentsError, LeaseError
from ...message import Message
from ...states import State
from ..identity import checked_id, takes_over
from ..rows import Recorded, Superseded
from .base import KeyTaken
from .triggers import TriggerOps, job_params


@dataclass(frozen=True)
class Registered:
    """What :meth:`ClientOps.register` did with a message: ``outcome`` (a :class:`Recorded`, or
    the :class:`State` of the job that keeps the id: this message is a copy), and ``job_id``,
    the job that serves it (another job's id when coalesced or debounced). ``debounced``:
    ``message`` is the job's message to publish, due in ``due_in`` seconds."""

    outcome: Recorded | State
    job_id: str
    message: Message | None = None
    due_in: float | None = None
    #: Coalesced, and no job holds the key now (its trigger superseded the key's queued job,
    #: or the key's job ended meanwhile): settle the key's triggers now.
    freed: bool = False
    #: The key's queued job the trigger superseded (its group's place is free).
    superseded: Superseded | None = None


class ClientOps(TriggerOps):
    """Writes of a client (``LeasedTask.apply_async``)."""

    def register(
        self,
        message: Message,
        *,
        countdown: float | None = None,
        queued_timeout: float | None = None,
        fresh: bool = True,
        debounce: tuple[float, float] | None = None,
        flush: bool = True,
    ) -> Registered:
        """Record the job of a message about to be published: ``new``, ``taken over`` (a new
        job reusing the id of one that ended, or a replacement: ``identity.takes_over``),
        ``coalesced`` (its lease key has a live job, which serves it: see :meth:`coalesce`),
        or the state of the job that keeps the id (this message is a copy, dropped at its
        claim). A trigger of a lease key a job holds is kept on the key (``coalesced``: the
        id its caller is given is the first waiting trigger's).

        ``fresh``: the message was built anew (not from a recorded one, as Celery's re-sends
        of a request are: a retry after a lost pool process carries the job's version).

        ``debounce``: (quiet, max_wait) seconds of a debounced trigger (its ``countdown`` is
        the quiet period): when the key's job is one that has not started and waits for its
        due time, the trigger becomes that job's message and moves its due time
        (``debounced``); a started job keeps it as a waiting trigger (``coalesced``).

        ``flush``: a new row's commit waits for the WAL flush (False: not, where the database
        can say so for one statement; ``Record.register_unflushed``)."""
        text = message.dumps()
        job_id = checked_id(message.id)
        expires_in = None if queued_timeout is None else (countdown or 0.0) + queued_timeout
        params = job_params(message, text) | {
            "b_id": job_id,
            "b_countdown": countdown or None,
            "b_expires_in": expires_in,
        }
        if message.key is not None:
            # A trigger of a busy key (a burst of webhooks) is coalesced after one read, with
            # no INSERT refused by the key's unique index (each refusal is an ERROR line in
            # PostgreSQL's log); an idle key's first trigger pays that read too.
            found = self._coalesce(message, text, debounce, queued_timeout)
            if found is not None:
                return found
        record = self.sql.record
        insert = record.register if flush else record.register_unflushed
        for _ in range(3):
            try:
                inserted = self._hot(
                    lambda c: self._insert(c, insert, params), refused=ArgumentsError
                )
                if inserted:
                    return Registered(Recorded.NEW, job_id)
                facts = self._facts(job_id)
                if facts is None:
                    continue  # deleted in between
                if not takes_over(message, facts, published=fresh):
                    return Registered(State(facts.state), job_id)
                seen = params | {"b_seen_token": facts.token, "b_seen_state": facts.state}
                if self._hot(lambda c, p=seen: self._take_over(c, p), refused=ArgumentsError):
                    return Registered(Recorded.TAKEN_OVER, job_id)
            except KeyTaken:
                found = self._coalesce(message, text, debounce, queued_timeout)
                if found is not None:
                    return found
                # The key's live job ended in between: record this one again.
        raise LeaseError(f"job {job_id}: its row kept changing while it was recorded; try again")

    def _coalesce(
        self,
        message: Message,
        text: str,
        debounce: tuple[float, float] | None,
        wait: float | None,
    ) -> Registered | None:
        """``message`` handed to the job holding its key: moved into it (a debounced trigger
        of a job still waiting), else kept on the key; None when no other job holds it."""
        holder = self._holder(message)
        if holder is None:
            return None
        if debounce is not None:
            moved = message.under_id(holder).new_version()
            moved_text = moved.dumps()
            quiet, max_wait = debounce
            params = job_params(moved, moved_text) | {
                "b_id": holder,
                "b_quiet": quiet,
                "b_max_wait": max_wait,
                "b_expires_in": self.settings.reap_grace if wait is None else wait,
            }
            keys = self.sql.keys

            def run(c: Connection) -> list[Any]:
                return self.dialect.rows(c, keys.debounce, params, read_back=keys.due_in)

            found = self._hot(run, reads_back=True, refused=ArgumentsError)
            if found and found[0]:
                return Registered(Recorded.DEBOUNCED, holder, moved, max(float(found[0][0]), 0.0))
        pended = self._pended(message, text)
        return Registered(
            Recorded.COALESCED, pended.id, freed=pended.freed, superseded=pended.superseded
        )

    def _take_over(self, c: Connection, params: dict[str, Any]) -> bool:
        take_over = self.sql.record.take_over
        return bool(self._keyed(c, lambda: c.execute(take_over, params).rowcount == 1))

    def forget(self, job_id: str) -> bool:
        """Delete a job registered but never published (its publish failed)."""
        return self._count(self.sql.operators.forget, {"b_id": job_id}) == 1


__all__ = ["ClientOps", "Registered"]
