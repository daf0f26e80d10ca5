"""Which job a message belongs to: the recorded one, a copy of it, or a new job reusing its id.

Celery reuses task ids: ``Task.replace`` freezes the replacement with the replaced task's id
(and counts it in ``replaced_task_nesting``), a chord's ``celery.accumulate`` can run under the
id of a header task that has ended, a signature frozen once runs again under its id when it is
sent again, and a retry sends the same id again. The claim and the register decide with these
rules what a message with a known id is.
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import ArgumentsError
from ..message import Message
from .schema import FINISHED_STATES, MAX_ID_LENGTH, MAX_KEY_LENGTH


class Facts(NamedTuple):
    """What a claim or a register that matched no row reads to decide."""

    state: str
    owner: str | None
    expires_in: float | None
    task: str
    generation: int
    version: str | None
    token: int
    attempts: int = 0
    #: A job of a group waiting for its admission (``schema.WAITING``).
    waiting: bool = False
    #: Seconds until the job may run (``run_after``: a countdown, a debounce), None: any time.
    due_in: float | None = None
    #: The rate of the job's group (admissions a second), None: none.
    group_rate: float | None = None


def same_job(message: Message, facts: Facts) -> bool:
    """Whether ``message`` is (a copy of) the recorded message of the job in ``facts``."""
    if message.task != facts.task or message.generation != facts.generation:
        return False
    return message.version is None or facts.version is None or message.version == facts.version


def takes_over(message: Message, facts: Facts, *, published: bool = False) -> bool:
    """Whether ``message`` is a new job reusing the id of the job in ``facts``, as Celery runs
    one: a replacement (``Task.replace``: a higher ``replaced_task_nesting``), or, once the
    recorded job has ended, a fresh publish (``published``: a client is sending a message built
    anew, not one Celery re-sends from a request) or a message of another task (a chord's
    ``celery.accumulate``). A delivery of the same task
    that is not the recorded message is a copy, never a new job."""
    if message.generation != facts.generation:
        return message.generation > facts.generation
    if facts.state not in FINISHED_STATES:
        return False
    return published or message.task != facts.task


def checked_id(job_id: str) -> str:
    """``job_id``, or :class:`ArgumentsError` when the table cannot hold it whole."""
    return _whole(job_id, MAX_ID_LENGTH, "task id {} cannot be a celery-leases job id")


def checked_key(key: str | None) -> str | None:
    """``key`` (a lease key, or None), or :class:`ArgumentsError` when the table cannot hold
    it whole."""
    return None if key is None else _whole(key, MAX_KEY_LENGTH, "lease key {} cannot be stored")


def _whole(value: str, longest: int, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > longest:
        shown = repr(value) if len(str(value)) <= 60 else repr(str(value)[:57]) + "..."
        raise ArgumentsError(
            f"{what.format(shown)}: it must be a string of 1 to {longest} characters (the "
            f"table holds no more, and never truncates one)"
        )
    return value
