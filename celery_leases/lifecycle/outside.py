"""Transitions made outside any attempt: an operator's cancel, retry and release, what Celery
decides in a worker's main process (a revoke, an expiry, a failure there, a pool process that
died), a worker shutting down, and the reaper's expiries and give-ups. Each is one conditional
statement (or one transaction) of the store, then what it hands on (``handon``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from celery import states as celery_states

from .. import metrics
from ..errors import InvalidJobState, LeaseError, StoreUnavailable
from ..log import job_fields
from ..message import Message
from ..states import State
from . import handon

logger = logging.getLogger("celery_leases")

#: Largest number of batches one reaper pass handles, so a pass always ends.
MAX_BATCHES = 100


# -- operators -------------------------------------------------------------------------------


def cancel(app: Any, store: Any, job_id: str) -> str:
    """Cancel a job: a waiting or queued one will not run (the result backend is told
    REVOKED; an admitted one of a group hands its place to the group's next job), a running
    one stops at its next checkpoint and ends ``cancelled`` (its worker hands its end on)."""
    job = store.get(job_id)
    for _ in range(3):  # the job may change state between the read and the write
        if job is None:
            break
        if job.state == State.QUEUED and store.cancel_queued(job.id):
            handon.hand_on(
                app,
                store,
                handon.Ended(
                    key=job.lease_key,
                    group=job.lease_group if job.admitted_at is not None else None,
                    task=job.task,
                    notices=True,
                ),
            )
            said = (
                "it was never sent (it waited for its group's admission)"
                if job.waiting
                else "its message is dropped when a worker receives it"
            )
            return f"job {job.id} ({job.task}) cancelled: {said}"
        if job.state == State.RUNNING and store.request_stop([job.id], "cancel"):
            return (
                f"job {job.id} ({job.task}) running on {job.owner}: it stops at its next "
                f"checkpoint and ends cancelled"
            )
        if job.state not in (State.QUEUED, State.RUNNING):
            break
        job = store.get(job.id)
    state = "gone" if job is None else job.state
    raise InvalidJobState(f"job {job_id} is {state}; only queued or running jobs can be cancelled")


def retry(app: Any, store: Any, job_id: str, *, queued_timeout: float | None) -> str:
    """Queue a ``failed`` or ``cancelled`` job again and publish its message: it resumes from
    its checkpoint. A publish that fails leaves the job cancelled, to be retried again. A job
    of a group waits for its admission again, as a new call of its group would (its group's
    row made from its task's options if it has none: a job sent by name)."""
    found = store.get(job_id)
    if found is not None and found.lease_group is not None:
        limits = handon.limits_of(app)(found.task, found.lease_group)
        if limits is not None:
            store.define_group(found.lease_group, limits, define=False)
    job = store.requeue(job_id, queued_timeout=queued_timeout)
    start = (
        "from its checkpoint"
        if job.checkpoint is not None
        else "from the start (it has no checkpoint)"
    )
    if job.lease_group is not None:
        admitted = handon.admit(app, store, job.lease_group, task=job.task)
        if job.id not in [a.id for a in admitted]:
            return (
                f"job {job.id} ({job.task}) queued again: it waits for its admission in group "
                f"{job.lease_group}, then resumes {start}"
            )
    else:
        try:
            job.message.send(app)
        except Exception as exc:
            store.cancel_queued(job.id)
            raise LeaseError(
                f"job {job.id} could not be published ({exc}); it is left cancelled, retry it again"
            ) from exc
    return f"job {job.id} ({job.task}) queued again: attempt {job.attempts + 1} resumes {start}"


def release(store: Any, job_id: str) -> str:
    """Expire a running job's lease now (its host is dead): the next reaper pass publishes
    the job again, to resume elsewhere."""
    job = store.get(job_id)
    if job is None or not end_lease(store, job_id):
        job = store.get(job_id)
        state = "gone" if job is None else job.state
        raise InvalidJobState(f"job {job_id} is {state}; only a running job holds a lease")
    return (
        f"job {job.id} ({job.task}): lease of {job.owner} expired; the next reaper pass "
        f"re-publishes it ('leases reap' does it now). If {job.owner} is alive after all, its "
        f"next renewal takes the lease back."
    )


def end_lease(store: Any, job_id: str) -> bool:
    """End a running job's lease now (its holder is gone, or a test crashes it): the next
    reaper pass publishes the job again. False when no lease held it."""
    return bool(store.release(job_id))


# -- what Celery decides in a worker's main process ----------------------------------------


def end_in_celery(
    app: Any, store: Any, job_id: str, state: State, error: str, *, unheld_only: bool = False
) -> bool:
    """End a live job as Celery decided in a worker's main process (a revoke, an expired
    message, a hard time limit: the result backend says so already), whatever attempt holds
    it; ``unheld_only``: unless an attempt holds it under a live lease (an expired copy of
    its message). Its end is handed on; True when it ended."""
    end = store.end_unheld if unheld_only else store.end_live
    try:
        ended = end(job_id, state=state.value, error=error)
    except LeaseError as exc:
        logger.error(
            "celery-leases: could not record job %s as %s: %s",
            job_id,
            state,
            exc,
            extra=job_fields(job_id),
        )
        return False
    if not ended:
        return False
    logger.warning(
        "celery-leases: job %s is %s: %s", job_id, state, error, extra=job_fields(job_id)
    )
    try:
        job = store.get(job_id)  # its key and group, on this rare path only
    except LeaseError:
        return True  # the reaper settles its key and admits its group's next
    if job is not None:
        handon.hand_on(
            app,
            store,
            handon.Ended(
                key=job.lease_key,
                group=job.lease_group if job.admitted_at is not None else None,
                task=job.task,
            ),
        )
    return True


def wait_for_worker(store: Any, job_id: str, *, wait: float, error: str) -> bool:
    """A queued job's message was discarded by a worker that does not know its task: the
    reaper sends it again ``wait`` seconds from now (then with doubling waits)."""
    return bool(store.wait_for_worker(job_id, wait=wait, error=error))


def preempt(store: Any, owner_prefix: str) -> int:
    """Ask every running attempt of a worker shutting down (``owner_prefix``) to hand its job
    back at its next checkpoint; how many were asked."""
    return int(store.request_stop_owned_by(owner_prefix, "preempt"))


def let_go(store: Any, job_id: str, token: int) -> bool:
    """Hand back the lease ``token`` of job ``job_id`` that a process gives up as it goes
    down (or a stalled one, before it ends itself): the reaper sends it again at its next
    pass (a job of a group: admits it). True when handed back."""
    return store.hand_back(job_id, token, reap_in=0.0) is not None


def resume_after_death(
    app: Any, store: Any, job_id: str, owner: str, *, reap_grace: float
) -> str | None:
    """The pool process ``owner`` holding job ``job_id`` died (its worker's main process saw
    it): hand its lease back and send the job again now, or, in a group, ask for its
    admission. The job's state after it; None when ``owner`` held no lease it may hand back
    (``Store.hand_back_owned``: the reaper decides)."""
    state, text = store.hand_back_owned(job_id, owner, reap_in=reap_grace)
    if state is None:
        return None
    message = Message.loads(text) if text is not None else None
    if state == State.QUEUED and message is not None:
        if message.group is not None:
            handon.hand_on(app, store, handon.Ended(group=message.group, task=message.task))
        else:
            try:
                message.send(app)
            except Exception as exc:  # the reaper sends it after leases_reap_grace
                logger.error(
                    "celery-leases: job %s: could not send it again: %r",
                    job_id,
                    exc,
                    extra=job_fields(job_id),
                )
    elif message is not None:  # a cancel or a supersede met it: it ended so
        handon.hand_on(
            app,
            store,
            handon.Ended(key=message.key, group=message.group, task=message.task, notices=True),
        )
    return str(state)


# -- the reaper ----------------------------------------------------------------------------


@dataclass
class Expired:
    """What a reaper pass's expiry step did (``ReapReport`` shows it)."""

    orphaned: list[str] = field(default_factory=list)
    republished: list[str] = field(default_factory=list)
    gave_up: list[str] = field(default_factory=list)
    publish_failed: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    #: Jobs of groups whose lease expired: they wait for their admission again.
    returned: list[str] = field(default_factory=list)


def expire(app: Any, store: Any, settings: Any) -> Expired:
    """End the leases whose holder is gone, or that ran out; re-publish the jobs they held
    (a job of a group waits for its admission again instead), give up on poison ones (past
    ``leases_max_attempts`` or ``leases_max_attempts_without_progress``), and end the ones
    whose message expired. Every end is handed on."""
    done = Expired()
    try:
        orphaned = store.expire_orphaned(batch=settings.reap_batch)
    except StoreUnavailable:
        raise  # nothing below can work: one error, not one a step
    except LeaseError as exc:  # never in the way of the paths below (MySQL: no GLOBAL_STATUS)
        logger.error("cannot look for jobs whose holder is gone: %s", exc)
        orphaned = []
    try:
        store.release_stale()
    except StoreUnavailable:
        raise
    except LeaseError as exc:  # the expiry path below still runs
        logger.error("cannot let go the jobs of holders that stopped renewing: %s", exc)
    for job_id, owner in orphaned:
        done.orphaned.append(job_id)
        logger.info(
            "job %s: its holder's database session is gone (owner %s)",
            job_id,
            owner,
            extra=job_fields(job_id, owner=owner),
        )
    ends: list[handon.Ended] = []
    for _ in range(MAX_BATCHES):
        batch = store.collect_expired(
            batch=settings.reap_batch,
            grace=settings.reap_grace,
            max_stalled=settings.max_attempts_without_progress,
            max_attempts=settings.max_attempts,
        )
        for job in batch.gave_up:
            done.gave_up.append(job.id)
            metrics.count("gave_up", task=job.task)
            logger.error(
                "job %s (%s): %s",
                job.id,
                job.task,
                job.error,
                extra=job_fields(job.id, token=job.token, attempt=job.attempts),
            )
            ends.append(_ended(job, notices=True))
        for job in batch.republish:
            _republish(app, store, job, batch.previous_owners.get(job.id), done, ends)
        if len(batch.republish) + len(batch.gave_up) < settings.reap_batch:
            break
    for ended in _merged(ends):
        handon.hand_on(app, store, ended)
    return done


def _republish(
    app: Any, store: Any, job: Any, owner: str | None, done: Expired, ends: list[handon.Ended]
) -> None:
    left = job.message.expires_in()
    if left is not None and left <= 0:
        # A worker would discard it as expired: end it as Celery would have.
        if store.end_live(
            job.id,
            state=State.REVOKED.value,
            error="expired (its message's expires passed)",
            notify=celery_states.REVOKED,
        ):
            done.expired.append(job.id)
            ends.append(_ended(job, notices=True))
        return
    if job.lease_group is not None:
        # Waiting for its admission again (no expiry): the group's admission publishes it.
        done.returned.append(job.id)
        ends.append(handon.Ended(group=job.lease_group, task=job.task))
        return
    try:
        job.message.send(app)
    except Exception as exc:  # the row keeps its pushed expiry: a later pass retries
        done.publish_failed.append(job.id)
        logger.error(
            "job %s: re-publish failed, next pass retries: %r",
            job.id,
            exc,
            extra=job_fields(job.id, token=job.token, attempt=job.attempts),
        )
        return
    done.republished.append(job.id)
    metrics.count("reaped", task=job.task)
    where = "no checkpoint" if job.checkpoint is None else "its checkpoint"
    logger.info(
        "job %s (%s): lease expired (owner %s, attempt %d), re-published to resume from %s",
        job.id,
        job.task,
        owner or "none",
        job.attempts,
        where,
        extra=job_fields(job.id, token=job.token, attempt=job.attempts),
    )


def _ended(job: Any, *, notices: bool = False) -> handon.Ended:
    """What the end of ``job`` (a reaper's give-up, an expired message) hands on."""
    return handon.Ended(
        key=job.lease_key,
        group=job.lease_group if job.admitted_at is not None else None,
        task=job.task,
        notices=notices,
    )


def _merged(ends: list[handon.Ended]) -> list[handon.Ended]:
    """``ends`` with each key and group once (a pass hands each on once), notices once."""
    keys = {e.key: e for e in ends if e.key is not None}
    groups = {e.group: e for e in ends if e.group is not None}
    merged = [handon.Ended(key=k, task=e.task) for k, e in keys.items()]
    merged += [handon.Ended(group=g, task=e.task) for g, e in groups.items()]
    if any(e.notices for e in ends):
        merged.append(handon.Ended(notices=True))
    return merged


__all__ = [
    "MAX_BATCHES",
    "Expired",
    "cancel",
    "end_in_celery",
    "end_lease",
    "expire",
    "let_go",
    "preempt",
    "release",
    "resume_after_death",
    "retry",
    "wait_for_worker",
]
