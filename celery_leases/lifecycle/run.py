"""An attempt's transitions, in the worker process that runs it: the claim (and what a refused
delivery comes to), and each way an attempt ends (done, failed, stopped by a cancel or a
supersede, replaced, its lease handed back), each one statement fenced by the lease's token,
then what the end hands on (``handon``).

``attempt.Attempt`` maps the task body's outcome (a return, Celery's ``Retry``, ``Reject``,
``Ignore``, a stop, an error) to these.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from .. import metrics
from ..db import Store, rows
from ..db.rows import Claimed, Refusal, Refused
from ..db.schema import FINISHED_STATES
from ..db.statements.common import SUPERSEDED_TEXT
from ..db.store.operator import behind
from ..errors import LeaseError
from ..lease import Lease, queued_by, recorded, until_deadline
from ..log import job_fields, lease_fields
from ..message import (
    COALESCE,
    DEBOUNCE_HEADER,
    GROUP_HEADER,
    KEY_HEADER,
    KEY_STRATEGY_HEADER,
    Message,
)
from ..states import State
from . import handon

logger = logging.getLogger("celery_leases")


def delivered(task: Any, message: Message) -> Message:
    """``message`` as a worker of ``task`` received it, with the lease key and group its
    client would have given it: a message sent by name (``send_task``, another language)
    carries neither, and gets the task's own (its key's strategy, and its debounce: kept on
    a busy key, its arguments replace the waiting ones, as a debounced client call's do; on
    a free key it runs at once)."""
    if message.key is None:
        key = task.key_for(message.args, message.kwargs)
        if key is not None:
            message = message.with_headers(**{KEY_HEADER: key})
            if task.lease_key_strategy != COALESCE:
                message = message.with_headers(**{KEY_STRATEGY_HEADER: task.lease_key_strategy})
            debounce = getattr(task, "lease_debounce", None)
            if debounce is not None:
                message = message.with_headers(**{DEBOUNCE_HEADER: list(debounce)})
    if message.group is None:  # it runs at once, counted in its group
        group = task.group_for(message.args, message.kwargs)
        if group is not None:
            message = message.with_headers(**{GROUP_HEADER: group})
    return message


def claim(
    task: Any,
    delivery: Message,
    *,
    owner: str,
    holder: str | None,
    fresh: bool,
    connection: Any,
) -> Claimed | Refused:
    """Claim ``delivery``'s job (``Store.claim``: one statement in the usual case). A message
    of a group sent by name runs at once, counted in its group: its group gets its row (from
    the task's options) if it has none, so that its end and its hand-backs admit the group's
    next jobs under the right limits."""
    store: Store = task.lease_store
    settings = task.lease_settings
    outcome = store.claim(
        delivery,
        owner=owner,
        duration=settings.duration,
        holder=holder,
        fresh=fresh,
        connection=connection,
    )
    if isinstance(outcome, Claimed) and outcome.created and delivery.version is not None:
        # Recorded once, yet no row: the record was lost (a database crash after an
        # unflushed record, a restore from a backup); the message was its second copy.
        logger.warning(
            "job %s: its message was recorded, but its row was missing; made again at its claim",
            delivery.id,
            extra=job_fields(delivery.id),
        )
    if isinstance(outcome, Claimed) and outcome.created and delivery.group is not None:
        limits = handon.limits_of(task.app)(delivery.task, delivery.group)
        if limits is not None:
            try:
                store.define_group(delivery.group, limits, define=False)
            except LeaseError as exc:  # its end's admission makes it, or the reaper's
                logger.warning("group %s: its row could not be made: %s", delivery.group, exc)
    return outcome


def refused(task: Any, refusal: Refused, delivery: Message, *, redelivered: bool) -> None:
    """What a refused delivery comes to (the caller drops it): sent again when it may run (a
    redelivery while the dead attempt's lease lasts, a job not due yet), the triggers of a
    key freed by it settled, the admission a waiting job's message asks for."""
    app, store = task.app, task.lease_store
    job_id = delivery.id
    reason = refusal.reason
    if reason == Refusal.HELD and redelivered:
        # The broker gave back the message of an attempt that died (acks_late with
        # reject_on_worker_lost, a lost connection) before its lease ran out: come back
        # when it has, or nothing but a reaper would ever run the job again.
        delay = max(refusal.expires_in or 0.0, 0.0) + 0.25
        logger.info(
            "job %s: redelivered while a lease still holds it (owner %s); "
            "delivering again in %.1f s, when that lease has ended",
            job_id,
            refusal.owner,
            delay,
            extra=job_fields(job_id),
        )
        delivery.send(app, countdown=delay)
        return
    if reason == Refusal.EARLY:
        # A debounced or rate-limited job's message came before its due time (the database's
        # clock; the sender's and this worker's may disagree): come back then.
        delay = max(refusal.expires_in or 0.0, 0.0)
        logger.info(
            "job %s: due in %.2f s (a debounce, or its group's rate); delivering again then",
            job_id,
            delay,
            extra=job_fields(job_id),
        )
        delivery.send(app, countdown=delay)
        return
    if reason == Refusal.COALESCED:
        logger.info(
            "job %s: its lease key %s has a live job; coalesced into job %s",
            job_id,
            delivery.key,
            refusal.serving,
            extra=job_fields(job_id),
        )
        if refusal.freed and delivery.key is not None:
            superseded = refusal.superseded
            handon.hand_on(
                app,
                store,
                handon.Ended(
                    key=delivery.key,
                    group=superseded.group if superseded and superseded.admitted else None,
                    task=delivery.task,
                    notices=superseded is not None,
                ),
            )
        return
    if reason == Refusal.WAITING:
        # The message of a job waiting in its group: one sent for its due time (a countdown,
        # a debounce, a retry's), or an older release's follow-up. It asks for the group's
        # admission, which publishes the job if it is its turn.
        logger.info(
            "job %s: waits for its admission in group %s; admitting",
            job_id,
            delivery.group,
            extra=job_fields(job_id),
        )
        if delivery.group is not None:
            handon.admit(app, store, delivery.group, task=delivery.task)
        return
    metrics.count("duplicates_dropped", task=task.name)
    logger.info(
        "job %s: message dropped, %s", job_id, refusal_text(refusal), extra=job_fields(job_id)
    )


def refusal_text(refused: Refused) -> str:
    """Why a delivery was dropped, for the log."""
    if refused.reason == Refusal.HELD:
        left = f", {refused.expires_in:.1f} s left" if refused.expires_in is not None else ""
        return f"a live lease holds it (owner {refused.owner}{left}): duplicate delivery"
    if refused.reason == Refusal.STALE:
        return "another message of this id is the recorded one: a stale or duplicate delivery"
    if refused.reason == Refusal.LAPSED:
        return (
            "its lease ended: the reaper returns it to its group, whose admission starts it again"
        )
    return f"the job is already {refused.reason}"


def why_refused(task: Any, lease: Lease, what: str) -> str | None:
    """After a fenced write of ``lease``'s attempt was refused: why, from one read of the job
    (on this refusal only), as the log says it. A newer token: another attempt holds the job.
    The same token: the job ended meanwhile (a revoke's terminate ends it before its signal
    reaches the process, an operator's cancel, a give-up), or its lease ended (renewals that
    stopped, an operator's release; the reaper sends the job again). The job gone, or at an
    older token: the database went back behind the attempt (a failover to a replica that
    missed commits, a restore), said at ERROR here with the ``lost_commits`` counter, as its
    stored checkpoint may then be older than this attempt's last one (None then). ``what``:
    what was not written ("checkpoint not saved")."""
    try:
        job = task.lease_store.get(lease.job_id)
    except LeaseError as exc:
        return f"its write was refused, and the job cannot be read now ({exc})"
    if job is None or behind(job, lease.token):
        metrics.count("lost_commits", task=task.name)
        logger.error(
            "job %s: the database is behind this attempt (token %s): it lost commits (a "
            "failover to a replica that missed them, or a restore); its checkpoint may have "
            "gone back; %s, this attempt stops",
            lease.job_id,
            lease.token,
            what,
            extra=lease_fields(lease),
        )
        return None
    if job.token > lease.token:
        return "another attempt holds it"
    if job.state in FINISHED_STATES:
        return f"the job ended meanwhile ({job.state}{': ' + job.error if job.error else ''})"
    return f"its lease ended before this write (the job is now {job.state})"


def give_up_corrupt(task: Any, job_id: str, error: str) -> None:
    """The job's row cannot be read: fail it for good rather than deliver it forever."""
    task.lease_store.give_up(job_id, error=error)
    logger.error("job %s: %s; marked failed", job_id, error, extra=job_fields(job_id))


# -- how an attempt ends ---------------------------------------------------------------------


def finish(task: Any, lease: Lease, result: Any) -> bool:
    """Record the job done with ``result`` (fenced by the lease's token, retried while the
    database is down and the lease lasts) and hand its end on; False when this attempt lost
    its lease (its result is dropped)."""
    store = task.lease_store
    ended = recorded(
        lambda: until_deadline(
            lease,
            lambda: store.finish(
                lease.job_id,
                lease.token,
                result=rows.dumps_result(result),
                connection=lease.joined,
            ),
            waiting=f"job {lease.job_id}: done, waiting for the database to record it",
            gave_up=f"job {lease.job_id}: done, but the database stayed down until the "
            f"lease ended; it will run again from its checkpoint",
            first_delay=0.2,
        )
    )
    if not ended:
        metrics.count("leases_lost", task=task.name)
        why = why_refused(task, lease, "its result is dropped")
        if why is not None:
            logger.warning(
                "job %s: attempt with token %d finished after losing its lease (%s); "
                "its result is dropped",
                lease.job_id,
                lease.token,
                why,
                extra=lease_fields(lease),
            )
        return False
    ended_attempt(task, lease)
    return True


def fail(task: Any, lease: Lease, exc: BaseException) -> bool | None:
    """Record the job failed with ``exc`` (fenced) and hand its end on: True; False when a
    stale attempt failed (not recorded); None when the database would not record it (logged:
    the lease expires and the reaper decides)."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    store = task.lease_store
    try:
        ended = recorded(
            lambda: store.fail(lease.job_id, lease.token, error=text, connection=lease.joined)
        )
    except LeaseError as store_exc:
        logger.error(
            "job %s: failed, and the failure could not be recorded: %s",
            lease.job_id,
            store_exc,
            extra=lease_fields(lease),
        )
        return None
    if not ended:
        logger.warning(
            "job %s: a stale attempt failed (token %d); not recorded",
            lease.job_id,
            lease.token,
            extra=lease_fields(lease),
        )
        return False
    ended_attempt(task, lease)
    return True


def stop(task: Any, lease: Lease, state: State, reason: str) -> None:
    """The attempt stopped at a checkpoint asked to stop: the job ends ``state`` (cancelled,
    superseded), REVOKED in the result backend as Celery stores a revoked task (chord part
    counted), and its end is handed on (a superseded job's key starts the run of the newest
    trigger). Handed back already (a retry met the stop): the reaper tells the backend."""
    store = task.lease_store
    if lease.released:
        return
    if store.fail(
        lease.job_id, lease.token, error=reason, state=state.value, connection=lease.joined
    ):
        revoked(task, SUPERSEDED_TEXT if state == State.SUPERSEDED else reason)
        ended_attempt(task, lease)


def replace(task: Any, lease: Lease) -> bool:
    """End the job ``replaced`` (fenced; ``Task.replace``: its id goes to the replacement) and
    hand its end on; False when this attempt lost its lease."""
    if not task.lease_store.replace(lease.job_id, lease.token):
        return False
    ended_attempt(task, lease)
    return True


def ended_attempt(task: Any, lease: Lease, *, notices: bool = False) -> None:
    """The attempt's job has ended: nothing is held any more (the keeper's next tick must not
    keep the lease while its end is handed on), then its key and group are handed on.
    ``notices``: it ended in a state the result backend is still to be told of."""
    lease.released = True
    handon.hand_on(
        task.app,
        task.lease_store,
        handon.Ended(
            key=lease.key,
            group=lease.group,
            task=task.name,
            connection=lease.joined,
            notices=notices and lease.joined is None,
        ),
    )


def hand_back(task: Any, lease: Lease, *, reap_in: float | None) -> str | None:
    """Give the lease back (fenced): the job's state after it, None when not handed back. A
    job queued again is the caller's to send (``send_again``); a cancel or a supersede that
    met it ended the job (handed on here)."""
    store = task.lease_store
    try:
        state = recorded(
            already=lambda: queued_by(store, lease),
            write=lambda: store.hand_back(
                lease.job_id, lease.token, reap_in=reap_in, connection=lease.joined
            ),
        )
    except LeaseError as exc:
        logger.warning(
            "job %s: could not release the lease (%s); it expires in %.0f s",
            lease.job_id,
            exc,
            lease.duration,
            extra=lease_fields(lease),
        )
        return None
    lease.handed_back(state)  # refused: a newer token holds the job, or it ended
    handed_back(task, lease, state)
    return None if state is None else str(state)


def handed_back(task: Any, lease: Lease, state: str | None) -> None:
    """Hand on what a hand-back leaves: a cancel or a supersede that met it ended the job; a
    job of a group queued again waits for a new admission, asked for now (its place is free:
    the group's oldest due job takes it)."""
    if state in (State.CANCELLED, State.SUPERSEDED):
        ended_attempt(task, lease, notices=True)
    elif state == State.QUEUED and lease.group is not None:
        handon.hand_on(task.app, task.lease_store, handon.Ended(group=lease.group, task=task.name))


def send_again(
    task: Any, lease: Lease, message: Message, *, countdown: float | None = None
) -> None:
    """The job, handed back queued, runs again elsewhere: its ``message`` sent (with
    ``countdown``). A job of a group waits for its admission instead (asked for at its
    hand-back): one due later gets its message for its due time, which asks for it then."""
    if lease.group is None:
        message.send(task.app, countdown=countdown)
    elif countdown:
        handon.wake(task.app, message, countdown)


def revoked(task: Any, reason: str) -> None:
    """Store REVOKED for the running job, as Celery does for a revoked task (chord part
    counted)."""
    request = task.request
    try:
        task.backend.mark_as_revoked(
            request.id, reason, request=request, store_result=not request.ignore_result
        )
    except Exception as exc:  # a backend that is down or disabled: the row is the truth
        logger.error(
            "job %s: could not store REVOKED: %r", request.id, exc, extra=job_fields(request.id)
        )


__all__ = [
    "claim",
    "delivered",
    "ended_attempt",
    "fail",
    "finish",
    "give_up_corrupt",
    "hand_back",
    "handed_back",
    "refusal_text",
    "refused",
    "replace",
    "revoked",
    "send_again",
    "stop",
    "why_refused",
]
