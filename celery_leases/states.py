"""A job's states and the events that move it, named once: the map every transition follows.

``celery_leases.lifecycle`` carries out each event (one statement or one transaction of the
store, then what the event hands on); this module only names them, so the storage wing, the
CLI, the docs' diagram (``dot``) and the model-based test read the same map. As Celery names
its task states once (``celery.states``), every part of celery-leases reads a job's states
from here.

========================  =====================  =======================================
state                     event                  next state
========================  =====================  =======================================
(none)                    record                 queued, or waiting (a job of a group)
(none)                    claim                  running (sent by name: no row before)
(none)                    follow up              queued or waiting (a key's triggers)
(none)                    serve                  done (triggers a later run served)
waiting                   admit                  queued
queued                    claim                  running
running                   checkpoint             running
running                   finish                 done
running                   fail                   failed
running                   replace                replaced
running                   stop                   cancelled, or superseded
running                   hand back              queued, waiting, cancelled, superseded
running                   expire                 queued, or waiting
queued                    expire                 queued (sent again)
queued, running           give up                failed
waiting, queued           cancel                 cancelled
running                   cancel                 running (asked to stop)
waiting, queued           supersede              superseded
running                   supersede              running (asked to stop)
waiting, queued           debounce               itself (message and due time moved)
failed, cancelled         retry                  queued, or waiting
running                   release                running (lease ended: expire follows)
waiting, queued, running  revoke                 revoked
waiting, queued, running  fail outside           failed
queued                    message expired        revoked
finished                  take over              queued, or running
queued                    forget                 (none)
finished                  purge                  (none)
========================  =====================  =======================================

A job of a group that waits for its admission is stored ``queued`` with no ``admitted_at``:
:attr:`State.WAITING` names that, for people and for the map; the table's ``state`` column
never holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class State(str, Enum):
    """A job's state. Live: waiting, queued, running; the others are ends."""

    #: A job of a group, recorded and not published: it waits for its admission (stored as
    #: ``queued`` with no ``admitted_at``).
    WAITING = "waiting"
    #: Published (or about to be), waiting for a worker's claim.
    QUEUED = "queued"
    #: An attempt holds its lease.
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    #: Cancelled by an operator.
    CANCELLED = "cancelled"
    #: Revoked or expired in Celery.
    REVOKED = "revoked"
    #: Ended by ``Task.replace``: its id went to the replacement.
    REPLACED = "replaced"
    #: Gave way to a newer trigger of its lease key (``lease_key_strategy="newest"``).
    SUPERSEDED = "superseded"

    def __str__(self) -> str:
        return self.value


class Event(str, Enum):
    """What moves a job from one state to another (see the module's table)."""

    RECORD = "record"
    FOLLOW_UP = "follow up"
    SERVE = "serve"
    ADMIT = "admit"
    CLAIM = "claim"
    CHECKPOINT = "checkpoint"
    FINISH = "finish"
    FAIL = "fail"
    REPLACE = "replace"
    STOP = "stop"
    HAND_BACK = "hand back"
    EXPIRE = "expire"
    GIVE_UP = "give up"
    CANCEL = "cancel"
    SUPERSEDE = "supersede"
    DEBOUNCE = "debounce"
    RETRY = "retry"
    RELEASE = "release"
    REVOKE = "revoke"
    FAIL_OUTSIDE = "fail outside"
    MESSAGE_EXPIRED = "message expired"
    TAKE_OVER = "take over"
    FORGET = "forget"
    PURGE = "purge"

    def __str__(self) -> str:
        return self.value


#: The stored states of a live job (``waiting`` is stored ``queued``).
LIVE = (State.QUEUED, State.RUNNING)
#: The ends.
FINISHED = (
    State.DONE,
    State.FAILED,
    State.CANCELLED,
    State.REVOKED,
    State.REPLACED,
    State.SUPERSEDED,
)
#: The ends a client sees as REVOKED in the result backend.
REVOKED_ENDS = (State.CANCELLED, State.REVOKED, State.SUPERSEDED)


@dataclass(frozen=True)
class Transition:
    """One arrow of the map: ``event`` moves a job from ``source`` to ``target`` (None: no
    row, before the job is recorded or after it is deleted); ``by`` says who makes it."""

    source: State | None
    event: Event
    target: State | None
    by: str


def _arrows(sources: tuple[State | None, ...], event: Event, targets: tuple[State | None, ...],
            by: str) -> tuple[Transition, ...]:  # fmt: skip
    return tuple(Transition(s, event, t, by) for s in sources for t in targets)


_S = State
_E = Event
#: Every transition, as ``celery_leases.lifecycle`` makes them.
TRANSITIONS: tuple[Transition, ...] = (
    *_arrows((None,), _E.RECORD, (_S.QUEUED, _S.WAITING), "client"),
    *_arrows((None,), _E.CLAIM, (_S.RUNNING,), "worker (a message sent by name)"),
    *_arrows((None,), _E.FOLLOW_UP, (_S.QUEUED, _S.WAITING), "the end of a key's job"),
    *_arrows((None,), _E.SERVE, (_S.DONE,), "the end of a key's job"),
    *_arrows((_S.WAITING,), _E.ADMIT, (_S.QUEUED,), "client, an end in the group, reaper"),
    *_arrows((_S.QUEUED,), _E.CLAIM, (_S.RUNNING,), "worker"),
    *_arrows((_S.RUNNING,), _E.CHECKPOINT, (_S.RUNNING,), "worker"),
    *_arrows((_S.RUNNING,), _E.FINISH, (_S.DONE,), "worker"),
    *_arrows((_S.RUNNING,), _E.FAIL, (_S.FAILED,), "worker"),
    *_arrows((_S.RUNNING,), _E.REPLACE, (_S.REPLACED,), "worker"),
    *_arrows((_S.RUNNING,), _E.STOP, (_S.CANCELLED, _S.SUPERSEDED), "worker, at a checkpoint"),
    *_arrows(
        (_S.RUNNING,),
        _E.HAND_BACK,
        (_S.QUEUED, _S.WAITING, _S.CANCELLED, _S.SUPERSEDED),
        "worker (retry, preempt, conflict, shutdown, a dead pool process)",
    ),
    *_arrows((_S.RUNNING,), _E.EXPIRE, (_S.QUEUED, _S.WAITING), "reaper"),
    *_arrows((_S.QUEUED,), _E.EXPIRE, (_S.QUEUED,), "reaper (sent again)"),
    *_arrows((_S.QUEUED, _S.RUNNING), _E.GIVE_UP, (_S.FAILED,), "reaper, claim"),
    *_arrows((_S.WAITING, _S.QUEUED), _E.CANCEL, (_S.CANCELLED,), "operator"),
    *_arrows((_S.RUNNING,), _E.CANCEL, (_S.RUNNING,), "operator (stop asked)"),
    *_arrows((_S.WAITING, _S.QUEUED), _E.SUPERSEDE, (_S.SUPERSEDED,), "client (newest wins)"),
    *_arrows((_S.RUNNING,), _E.SUPERSEDE, (_S.RUNNING,), "client (stop asked)"),
    *_arrows((_S.WAITING,), _E.DEBOUNCE, (_S.WAITING,), "client (debounce)"),
    *_arrows((_S.QUEUED,), _E.DEBOUNCE, (_S.QUEUED,), "client (debounce)"),
    *_arrows((_S.FAILED, _S.CANCELLED), _E.RETRY, (_S.QUEUED, _S.WAITING), "operator"),
    *_arrows((_S.RUNNING,), _E.RELEASE, (_S.RUNNING,), "operator (lease ended now)"),
    *_arrows((_S.WAITING, _S.QUEUED, _S.RUNNING), _E.REVOKE, (_S.REVOKED,), "Celery"),
    *_arrows((_S.WAITING, _S.QUEUED, _S.RUNNING), _E.FAIL_OUTSIDE, (_S.FAILED,), "Celery"),
    *_arrows((_S.QUEUED,), _E.MESSAGE_EXPIRED, (_S.REVOKED,), "reaper"),
    *_arrows(FINISHED, _E.TAKE_OVER, (_S.QUEUED, _S.RUNNING), "client, worker (an id reused)"),
    *_arrows((_S.QUEUED,), _E.FORGET, (None,), "client (its publish failed)"),
    *_arrows(FINISHED, _E.PURGE, (None,), "reaper (retention)"),
)


def targets(source: State | None, event: Event) -> frozenset[State | None]:
    """The states ``event`` may move a job in ``source`` to (empty: the event does not apply
    there)."""
    return frozenset(t.target for t in TRANSITIONS if t.source == source and t.event == event)


def dot() -> str:
    """The map as a Graphviz ``digraph`` (the docs' lifecycle diagram): a node per state, the
    ends in a box of their own, an arrow per (source, target) labelled with its events; an
    event that leaves every end alike (take over, purge) is one arrow from the box."""
    from_every_end = {
        (t.event, t.target)
        for t in TRANSITIONS
        if t.source in FINISHED
        and all(Transition(end, t.event, t.target, t.by) in TRANSITIONS for end in FINISHED)
    }
    labels: dict[tuple[str, str, bool], list[str]] = {}
    for t in TRANSITIONS:
        if t.source == t.target:
            continue  # the loops (checkpoint, debounce, a stop asked) are the table's
        whole = (t.event, t.target) in from_every_end
        if whole and t.source != FINISHED[0]:
            continue
        edge = (_node(t.source, "new"), _node(t.target, "gone"), whole)
        labels.setdefault(edge, [])
        if t.event.value not in labels[edge]:
            labels[edge].append(t.event.value)
    lines = [
        "digraph lifecycle {",
        '  rankdir=LR; compound=true; node [shape=box, style="rounded,filled", '
        'fontname="sans-serif", fillcolor="#e7f5e9"]; edge [fontname="sans-serif", '
        "fontsize=10];",
        '  new [label="(no row)", shape=plaintext, style=""];',
        '  gone [label="(deleted)", shape=plaintext, style=""];',
    ]
    live = [state.value for state in State if state not in FINISHED]
    lines += [f"  {name};" for name in live]
    lines.append('  subgraph cluster_ends { label="ends"; style="rounded,dashed";')
    lines += [f'    {state.value} [fillcolor="#f4f4f4"];' for state in FINISHED]
    lines.append("  }")
    for (source, target, whole), events in labels.items():
        tail = ", ltail=cluster_ends" if whole else ""
        lines.append(f'  {source} -> {target} [label="{", ".join(events)}"{tail}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node(state: State | None, none: str) -> str:
    return none if state is None else state.value


__all__ = [
    "FINISHED",
    "LIVE",
    "REVOKED_ENDS",
    "TRANSITIONS",
    "Event",
    "State",
    "Transition",
    "dot",
    "targets",
]
