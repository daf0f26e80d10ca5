"""One attempt at a leased job, in the worker process that runs it.

:class:`Attempt` claims the lease, runs the task body with the keeper renewing it, and records
how the attempt ended (done, failed, cancelled, handed back, retried, lost). The fenced writes
the body makes are ``checkpoint.py``'s.
"""

from __future__ import annotations

import logging
import random
import traceback
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

from celery.exceptions import Ignore, Reject, Retry

from . import groups, keys, metrics
from .checkpoint import lost_commits
from .db import Store, rows
from .db.errors import conflict_in, ended_idle_transaction, first_line
from .db.joined import Joined, ambient
from .db.rows import Refused
from .db.schema import CANCELLED, QUEUED, SUPERSEDED
from .db.statements.common import SUPERSEDED_TEXT
from .errors import (
    Cancelled,
    ConfigurationError,
    CorruptJob,
    LeaseError,
    LeaseLost,
    Preempted,
    StoreUnavailable,
    Superseded,
    WriteConflict,
)
from .lease import Lease, holding, queued_by, recorded, until_deadline
from .log import job_fields, lease_fields
from .message import (
    COALESCE,
    CONFLICT_HEADER,
    DB_RETRY_HEADER,
    GROUP_HEADER,
    KEY_HEADER,
    KEY_STRATEGY_HEADER,
    Message,
)
from .process import owner_name
from .worker.keeper import Keeper, keeper_for
from .worker.limits import body_over

T = TypeVar("T")

logger = logging.getLogger("celery_leases")

#: Times a job whose transaction keeps losing to concurrent ones runs again before it fails.
CONFLICT_TRIES = 8

#: What a process (or a gevent worker's greenlet) raises when it is being stopped.
GOING_DOWN: tuple[type[BaseException], ...] = (SystemExit, KeyboardInterrupt)
try:
    from greenlet import GreenletExit
except ImportError:  # no gevent/eventlet here
    pass
else:
    GOING_DOWN += (GreenletExit,)


class Attempt:
    """Claim, run and end one delivery of a leased task's message (``task.request``)."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.request = task.request
        self.settings = task.lease_settings
        self.store: Store = task.lease_store
        self.owner = owner_name(self.request.hostname)

    def run(self, args: Any, kwargs: Any) -> Any:
        """The task body's return value; raises Celery's ``Ignore`` when this delivery must not
        run (a duplicate, a stale delivery, the database down) or must not record a result.

        An attempt that starts inside a transaction on the leases' database (``Task.apply()``
        in a Django ``TestCase`` or an ``ATOMIC_REQUESTS`` view) joins it with every write,
        claim and end included: it commits or rolls back with it, and no keeper renews it
        meanwhile (its rows are the transaction's until it ends). A worker's attempt never
        starts inside one: that is refused, with what to do."""
        outer = self.outer_transaction()
        keeper = None if outer is not None else keeper_for(self.store)
        lease = self.claim(args, kwargs, keeper, outer)
        if keeper is not None:
            keeper.add(lease)
        try:
            with holding(lease):
                return self.outcome(lease, args, kwargs)
        finally:
            if keeper is not None:
                keeper.remove(lease)

    def outer_transaction(self) -> Joined | None:
        """The transaction this attempt starts inside, on the leases' database (``db.joined``:
        Django's ``atomic()``), joined without an idle bound: its caller holds it around the
        whole attempt."""
        found = ambient(self.store)
        if found is None:
            return None
        if not self.request.is_eager:
            raise ConfigurationError(
                f"task {self.task.name}: its attempt starts inside a transaction on the leases "
                f"database that the task did not open (a task_prerun receiver or a middleware "
                f"opened it): a lease held inside it would be the transaction's until it ends. "
                f"Open the transaction inside the task, around the work of each checkpoint"
            )
        return replace(found, guard_idle=False)

    # -- the claim -------------------------------------------------------------------------

    def claim(self, args: Any, kwargs: Any, keeper: Keeper | None, outer: Joined | None) -> Lease:
        request, settings = self.request, self.settings
        delivery = Message.received(request, args, kwargs)
        if delivery.key is None:  # sent by name: the task's own lease_key, if any
            key = self.task.key_for(args, kwargs)
            if key is not None:
                delivery = delivery.with_headers(**{KEY_HEADER: key})
                if self.task.lease_key_strategy != COALESCE:
                    strategy = self.task.lease_key_strategy
                    delivery = delivery.with_headers(**{KEY_STRATEGY_HEADER: strategy})
        if delivery.group is None:  # sent by name: it runs at once, counted in its group
            group = self.task.group_for(args, kwargs)
            if group is not None:
                delivery = delivery.with_headers(**{GROUP_HEADER: group})
        self.delivery = delivery
        try:
            # Task.apply() runs the job now, as Celery does, even one that has ended.
            holder = None if keeper is None else keeper.holder_for(self.owner, settings.duration)
            outcome = self.store.claim(
                delivery,
                owner=self.owner,
                duration=settings.duration,
                holder=holder,
                fresh=request.is_eager,
                connection=outer,
            )
        except (StoreUnavailable, WriteConflict) as exc:
            # The database is down, or the claim kept losing to concurrent transactions (a
            # lock timeout on the job's row, SQLite's write lock): deliver it again later.
            if request.is_eager:
                raise  # no broker message to deliver again; eager mode would recurse
            self.redeliver_later(delivery, exc)
            raise Ignore() from exc
        except CorruptJob as exc:
            # The row cannot be read: fail it for good rather than redeliver it forever.
            self.store.give_up(request.id, error=str(exc))
            logger.error("job %s: %s; marked failed", request.id, exc, extra=job_fields(request.id))
            raise
        if isinstance(outcome, Refused):
            self.refused(outcome, delivery)
        lease = Lease(
            job_id=request.id,
            token=outcome.token,
            attempt=outcome.attempt,
            checkpoint=outcome.checkpoint,
            owner=self.owner,
            duration=settings.duration,
            renew_interval=settings.renew_interval,
            stall_timeout=settings.stall_timeout,
            kill_when_stalled=settings.kill_stalled,
            checkpoint_age=outcome.checkpoint_age,
            key=delivery.key,
            group=delivery.group,
            bound=outcome.bound,
            joined=outer,
        )
        if lease.key is not None:
            key_of_lease = lease.key
            lease.read_cursor = lambda: self.store.cursor(key_of_lease)
        metrics.count("claims", task=self.task.name)
        if outcome.attempt > 1:
            metrics.count("resumes", task=self.task.name)
            age = (
                "none" if outcome.checkpoint_age is None else f"{outcome.checkpoint_age:.1f} s old"
            )
            logger.info(
                "job %s: resumed, attempt %d, token %d, checkpoint %s",
                lease.job_id,
                lease.attempt,
                lease.token,
                age,
                extra=lease_fields(lease),
            )
        else:
            logger.info(
                "job %s: claimed, token %d", lease.job_id, lease.token, extra=lease_fields(lease)
            )
        return lease

    def refused(self, refused: Refused, delivery: Message) -> NoReturn:
        """Drop this delivery (always raises Ignore)."""
        request = self.request
        if refused.reason == "held" and (request.delivery_info or {}).get("redelivered"):
            # The broker gave back the message of an attempt that died (acks_late with
            # reject_on_worker_lost, a lost connection) before its lease ran out: come back
            # when it has, or nothing but a reaper would ever run the job again.
            delay = max(refused.expires_in or 0.0, 0.0) + 0.25
            logger.info(
                "job %s: redelivered while a lease still holds it (owner %s); "
                "delivering again in %.1f s, when that lease has ended",
                request.id,
                refused.owner,
                delay,
                extra=job_fields(request.id),
            )
            delivery.send(self.task.app, countdown=delay)
            raise Ignore()
        if refused.reason == "early":
            # A debounced or rate-limited job's message came before its due time (the database's
            # clock; the sender's and this worker's may disagree): come back then.
            delay = max(refused.expires_in or 0.0, 0.0)
            logger.info(
                "job %s: due in %.2f s (a debounce, or its group's rate); delivering again then",
                request.id,
                delay,
                extra=job_fields(request.id),
            )
            delivery.send(self.task.app, countdown=delay)
            raise Ignore()
        if refused.reason == "coalesced":
            logger.info(
                "job %s: its lease key %s has a live job; coalesced into job %s",
                request.id,
                delivery.key,
                refused.serving,
                extra=job_fields(request.id),
            )
            if refused.freed and delivery.key is not None:
                keys.settle(self.task.app, self.store, delivery.key)
            raise Ignore()
        metrics.count("duplicates_dropped", task=self.task.name)
        logger.info(
            "job %s: message dropped, %s",
            request.id,
            _refusal_text(refused),
            extra=job_fields(request.id),
        )
        raise Ignore()

    def redeliver_later(self, delivery: Message, exc: Exception) -> None:
        """The claim could not be made (the database is down, or it kept losing to concurrent
        transactions): send the message again later instead of running unleased."""
        request = self.request
        tries = int(delivery.headers.get(DB_RETRY_HEADER) or 0) + 1
        delay = min(2.0**tries, self.settings.db_retry_max_delay) * random.uniform(0.5, 1)
        why = "unreachable" if isinstance(exc, StoreUnavailable) else "busy"
        logger.error(
            "job %s: leases database %s, delivering again in %.1f s (try %d): %s",
            request.id,
            why,
            delay,
            tries,
            exc,
            extra=job_fields(request.id),
        )
        delivery.send(self.task.app, countdown=delay, **{DB_RETRY_HEADER: tries})

    # -- how the attempt ends --------------------------------------------------------------

    def body(self, args: Any, kwargs: Any) -> Any:
        """The task's body. Once it has returned or raised, what follows is the record of the
        attempt's end, the library's and then Celery's: a soft time limit from then on is
        logged and ignored (``worker.limits``), or it would turn that end into another."""
        try:
            return self.task.run(*args, **kwargs)
        finally:
            body_over()

    def outcome(self, lease: Lease, args: Any, kwargs: Any) -> Any:
        store = self.store
        try:
            result = self.body(args, kwargs)
            self.held_back(lease)
        except Retry:
            self.held_back(lease)
            if not lease.released:
                self.hand_back(lease, reap_in=0.0)
            if lease.fenced_out:
                # A stale attempt (frozen, then woken) whose error asked for a retry: the job
                # lives on under a newer token. Its retry message is a copy the claim drops;
                # storing RETRY would contradict the job's own state in the backend.
                logger.warning(
                    "job %s: attempt with token %d asked for a retry after losing its lease; "
                    "dropped",
                    lease.job_id,
                    lease.token,
                    extra=lease_fields(lease),
                )
                raise Ignore() from None
            raise
        except Reject as exc:
            if exc.requeue:
                # Celery puts the message back only with acks_late; otherwise it is gone and
                # the reaper sends the job again at once.
                wait = self.settings.reap_grace if self.task.acks_late else 0.0
                self.hand_back(lease, reap_in=wait)
            else:
                self.failed(lease, exc)  # Celery stores FAILURE for it
            raise
        except LeaseLost:
            logger.warning(
                "job %s: attempt with token %d stopped, lease lost",
                lease.job_id,
                lease.token,
                extra=lease_fields(lease),
            )
            raise Ignore() from None
        except Cancelled as exc:
            # Handed back already (a retry met the cancel): the reaper tells the backend.
            if not lease.released and store.fail(
                lease.job_id, lease.token, error=str(exc), state=CANCELLED, connection=lease.joined
            ):
                self.revoked(str(exc))
                self.ended(lease)
            logger.info(
                "job %s: cancelled at its checkpoint", lease.job_id, extra=lease_fields(lease)
            )
            raise Ignore() from None
        except Superseded as exc:
            # The key's next run has the newest trigger's arguments: it starts once this end
            # is recorded (``ended`` settles the key). Handed back already (a retry met the
            # supersede): the reaper tells the backend and settles the key.
            if not lease.released and store.fail(
                lease.job_id, lease.token, error=str(exc), state=SUPERSEDED, connection=lease.joined
            ):
                self.revoked(SUPERSEDED_TEXT)
                self.ended(lease)
            logger.info(
                "job %s: superseded by a newer trigger of its key %s, stopped at its checkpoint",
                lease.job_id,
                lease.key,
                extra=lease_fields(lease),
            )
            raise Ignore() from None
        except Preempted:
            if self.hand_back(lease, reap_in=0.0) == QUEUED:
                self.delivery.send(self.task.app)
                logger.info(
                    "job %s: handed back at its checkpoint for another worker",
                    lease.job_id,
                    extra=lease_fields(lease),
                )
            raise Ignore() from None
        except Ignore:
            self.held_back(lease)
            self.finish(lease, None)
            raise
        except Exception as exc:
            if lease.released:
                raise
            if lease.idle_bounded and ended_idle_transaction(exc):
                self.idle_transaction_ended(lease, exc)
            if conflict_in(exc) and lease.joined is None:
                self.conflicted(lease, exc)
            self.failed(lease, exc)
            raise
        except GOING_DOWN:
            # The process is going down: hand the job back so it resumes at once elsewhere.
            # Any other BaseException leaves the lease to expire, as a crash would.
            self.hand_back(lease, reap_in=0.0)
            raise
        self.finish(lease, result)
        return result

    def held_back(self, lease: Lease) -> None:
        """Do what the task asked for inside a transaction of its own that may have held the
        job's row (``Lease.held_back``), now that its body has returned or raised past that
        transaction: hand the lease back for its retry and send the retry's message, or end
        the job replaced and send the replacement (``Ignore``)."""
        held_back, lease.held_back = lease.held_back, None
        if held_back is None or lease.released or lease.fenced_out:
            return
        if held_back[0] == "replace":
            self.task.replace_now(lease, held_back[1])
            return
        _, message, countdown = held_back
        wait = self.settings.queued_timeout or self.settings.reap_grace
        try:
            state = recorded(
                already=lambda: queued_by(self.store, lease),
                write=lambda: until_deadline(
                    lease,
                    lambda: self.store.hand_back_retry(
                        lease.job_id, lease.token, message, reap_in=countdown + wait
                    ),
                    waiting=f"the retry of job {lease.job_id} waits for the database",
                    gave_up=f"job {lease.job_id}: the database stayed down; its retry is not sent",
                ),
            )
        except LeaseError as exc:
            logger.warning(
                "job %s: could not hand the lease back for its retry (%s); it expires in %.0f s",
                lease.job_id,
                exc,
                lease.duration,
                extra=lease_fields(lease),
            )
            raise Ignore() from exc
        lease.released = state is not None
        lease.fenced_out = state is None
        if state in (CANCELLED, SUPERSEDED):  # a cancel met the retry: the reaper says REVOKED
            self.ended(lease)
            raise Ignore()
        if state == QUEUED:
            message.send(self.task.app)

    def idle_transaction_ended(self, lease: Lease, exc: Exception) -> NoReturn:
        """The database ended the task's transaction after its checkpoint: it sat idle longer
        than the lease (a frozen worker, or a slow step before the commit), and nothing of it
        was saved. Not the task's failure: the attempt ends as a crash would, leaving its
        lease to expire, so the reaper resumes the job from its last committed checkpoint and
        counts the attempt towards giving up when it saved none
        (``leases_max_attempts_without_progress``)."""
        lease.lost = True
        logger.warning(
            "job %s: the transaction of its checkpoint sat idle longer than the lease (%g s) "
            "and the database ended it (%s); the job resumes from its last committed "
            "checkpoint when the lease expires",
            lease.job_id,
            lease.duration,
            type(getattr(exc, "orig", exc)).__name__,
            extra=lease_fields(lease),
        )
        raise Ignore() from None

    def conflicted(self, lease: Lease, exc: Exception) -> None:
        """A transaction of the task's lost to a concurrent one (a serialization failure, a
        deadlock, a lock timeout: ``db.errors.Kind``) and was rolled back, its checkpoint with
        it: not the task's failure, nor an outage. The job goes back and runs again from its
        last committed checkpoint, after a short backoff; a job that keeps losing (``tries``
        over ``CONFLICT_TRIES``) fails with the error."""
        tries = int(self.delivery.headers.get(CONFLICT_HEADER) or 0) + 1
        if tries > CONFLICT_TRIES:
            return  # failed by the caller, with the error
        delay = min(0.1 * 2**tries, self.settings.db_retry_max_delay) * random.uniform(0.5, 1)
        if self.hand_back(lease, reap_in=self.settings.reap_grace) == QUEUED:
            self.delivery.send(self.task.app, countdown=delay, **{CONFLICT_HEADER: tries})
        logger.warning(
            "job %s: its transaction lost to a concurrent one (%s); it runs again from its last "
            "checkpoint in %.1f s (try %d)",
            lease.job_id,
            first_line(exc),
            delay,
            tries,
            extra=lease_fields(lease),
        )
        raise Ignore() from None

    def failed(self, lease: Lease, exc: Exception) -> None:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            ended = recorded(
                lambda: self.store.fail(
                    lease.job_id, lease.token, error=text, connection=lease.joined
                )
            )
        except LeaseError as store_exc:
            logger.error(
                "job %s: failed, and the failure could not be recorded: %s",
                lease.job_id,
                store_exc,
                extra=lease_fields(lease),
            )
            return
        if not ended:
            logger.warning(
                "job %s: a stale attempt failed (token %d); not recorded",
                lease.job_id,
                lease.token,
                extra=lease_fields(lease),
            )
            raise Ignore() from None
        self.ended(lease)

    def finish(self, lease: Lease, result: Any) -> None:
        if lease.released:
            return
        ended = recorded(
            lambda: until_deadline(
                lease,
                lambda: self.store.finish(
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
            metrics.count("leases_lost", task=self.task.name)
            if not lost_commits(self.task, lease, "its result is dropped"):
                logger.warning(
                    "job %s: attempt with token %d finished after losing its lease; "
                    "its result is dropped",
                    lease.job_id,
                    lease.token,
                    extra=lease_fields(lease),
                )
            raise Ignore()
        self.ended(lease)

    def ended(self, lease: Lease) -> None:
        """The job has ended: settle the triggers waiting on its key (``keys.settle``), and
        admit the next waiting jobs of its group (``groups.admit``), each a statement of its
        own after the end's."""
        # Nothing is held any more: the keeper's next tick must not keep the lease while the
        # triggers are settled.
        lease.released = True
        if lease.key is not None:
            keys.settle(self.task.app, self.store, lease.key, connection=lease.joined)
        if lease.group is not None and lease.joined is None:
            groups.admit(self.task.app, self.store, lease.group)

    def hand_back(self, lease: Lease, *, reap_in: float | None) -> str | None:
        """Give the lease back; the job's state after it (None: not handed back)."""
        try:
            state = recorded(
                already=lambda: queued_by(self.store, lease),
                write=lambda: self.store.hand_back(
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
        lease.released = state is not None
        lease.fenced_out = state is None  # a newer token holds the job, or it ended
        lease.lost = lease.lost or lease.fenced_out
        if state in (CANCELLED, SUPERSEDED):
            self.ended(lease)
        return state

    def revoked(self, reason: str) -> None:
        """Store REVOKED for the job, as Celery does for a revoked task (chord part counted)."""
        request = self.request
        try:
            self.task.backend.mark_as_revoked(
                request.id, reason, request=request, store_result=not request.ignore_result
            )
        except Exception as exc:  # a backend that is down or disabled: the row is the truth
            logger.error(
                "job %s: could not store REVOKED: %r", request.id, exc, extra=job_fields(request.id)
            )


def _refusal_text(refused: Refused) -> str:
    if refused.reason == "held":
        left = f", {refused.expires_in:.1f} s left" if refused.expires_in is not None else ""
        return f"a live lease holds it (owner {refused.owner}{left}): duplicate delivery"
    if refused.reason == "stale":
        return "another message of this id is the recorded one: a stale or duplicate delivery"
    if refused.reason == "waiting":
        return "the job waits for its admission in its group, which publishes it"
    return f"the job is already {refused.reason}"
