"""A job's lifecycle: every transition of a job, and what a job's end hands on, in one place.

The states and events are named in ``celery_leases.states`` (the map, and the docs' diagram
drawn from it); each function here carries out one event: one statement or one transaction of
the store (``db/``), then what it hands on (:func:`hand_on`: the key's waiting triggers
settled, the group's next jobs admitted, the result backend told). Every path goes through
them: a client's record (``publish``), an attempt's claim and end (``attempt``), a retry or a
replace (``task``), an operator's action (``control``, the CLI, the admin), what Celery decides
in a worker's main process (``worker/``), and the reaper (``reaper``).

- ``record``: a client's transitions (:func:`record`, :func:`retry`).
- ``run``: an attempt's (:func:`claim`, :func:`refused`, :func:`finish`, :func:`fail`,
  :func:`stop`, :func:`replace`, :func:`hand_back`).
- ``outside``: those made outside any attempt (:func:`cancel`, :func:`requeue`,
  :func:`release`, :func:`end_in_celery`, :func:`resume_after_death`, :func:`expire`).
- ``handon``: what an end hands on (:func:`hand_on`), and the reaper's catching up.
"""

from __future__ import annotations

from ..states import TRANSITIONS, Event, State, Transition
from .handon import (
    Ended,
    admit,
    admit_round_robin,
    announce,
    hand_on,
    limits_of,
    repair_orphans,
    settle,
    settle_pending,
)
from .outside import (
    Expired,
    cancel,
    end_in_celery,
    end_lease,
    expire,
    let_go,
    preempt,
    release,
    resume_after_death,
    wait_for_worker,
)
from .outside import retry as requeue
from .record import Recording, forget, hand_back_for_retry, record, retry, retry_now
from .run import (
    claim,
    delivered,
    fail,
    finish,
    give_up_corrupt,
    hand_back,
    refused,
    replace,
    send_again,
    stop,
)

__all__ = [
    "TRANSITIONS",
    "Ended",
    "Event",
    "Expired",
    "Recording",
    "State",
    "Transition",
    "admit",
    "admit_round_robin",
    "announce",
    "cancel",
    "claim",
    "delivered",
    "end_in_celery",
    "end_lease",
    "expire",
    "fail",
    "finish",
    "forget",
    "give_up_corrupt",
    "hand_back",
    "hand_back_for_retry",
    "hand_on",
    "let_go",
    "limits_of",
    "preempt",
    "record",
    "refused",
    "release",
    "repair_orphans",
    "replace",
    "requeue",
    "resume_after_death",
    "retry",
    "retry_now",
    "send_again",
    "settle",
    "settle_pending",
    "stop",
    "wait_for_worker",
]
