"""One attempt at a leased job, in the worker process that runs it.

:class:`Attempt` claims the lease, runs the task body with the keeper renewing it, and records
how the attempt ended (done, failed, cancelled, handed back, retried, lost). The fenced writes
the body makes are ``checkpoint.py``'s.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

from celery.exceptions import Ignore, Reject, Retry

from . import lifecycle, metrics, routes
from .db import Store
from .db.errors import conflict_in, ended_idle_transaction, first_line
from .db.joined import Joined, ambient
from .db.rows import Refused
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
from .lease import Lease, holding
from .log import job_fields, lease_fields
from .message import (
    COALESCE,
    CONFLICT_HEADER,
    DB_RETRY_HEADER,
    GROUP_HEADER,
    KEY_HEADER,
    KEY_STRATEGY_HEADER,
    ROUTE_HEADER,
    Message,
)
from .process import owner_name
from .states import State
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


def deliver_later(task: Any, args: Any, kwargs: Any, exc: StoreUnavailable) -> NoReturn:
    """A delivery this worker cannot claim before it runs (its message names a leases
    database this worker does not know: a rolling deploy): sent again later, as when the
    database is down, for a worker that knows it."""
    if task.request.is_eager:
        raise exc
    with routes.using(routes.DEFAULT):
        attempt = Attempt(task)
    attempt.redeliver_later(Message.received(task.request, args, kwargs), exc)
    raise Ignore() from exc


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
        route = routes.active()
        if route is not None and not delivery.headers.get(ROUTE_HEADER):
            # Sent by name (or before the app had routes): the row its claim makes keeps its
            # database, for the reaper's re-publish and every later delivery.
            delivery = delivery.with_headers(**{ROUTE_HEADER: route})
        self.delivery = delivery
        try:
            # Task.apply() runs the job now, as Celery does, even one that has ended.
            holder = None if keeper is None else keeper.holder_for(self.owner, settings.duration)
            outcome = lifecycle.claim(
                self.task,
                delivery,
                owner=self.owner,
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
            lifecycle.give_up_corrupt(self.task, request.id, str(exc))
            raise
        if isinstance(outcome, Refused):
            redelivered = bool((request.delivery_info or {}).get("redelivered"))
            lifecycle.refused(self.task, outcome, delivery, redelivered=redelivered)
            raise Ignore()
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
        lease.carry(settings, self.store)
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
        task = self.task
        try:
            result = self.body(args, kwargs)
            self.held_back(lease)
        except Retry:
            self.held_back(lease)
            if not lease.released:
                lifecycle.hand_back(task, lease, reap_in=0.0)
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
                wait = self.settings.reap_grace if task.acks_late else 0.0
                lifecycle.hand_back(task, lease, reap_in=wait)
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
            lifecycle.stop(task, lease, State.CANCELLED, str(exc))
            logger.info(
                "job %s: cancelled at its checkpoint", lease.job_id, extra=lease_fields(lease)
            )
            raise Ignore() from None
        except Superseded as exc:
            # The key's next run has the newest trigger's arguments: it starts once this end
            # is recorded (its end is handed on: the key settled).
            lifecycle.stop(task, lease, State.SUPERSEDED, str(exc))
            logger.info(
                "job %s: superseded by a newer trigger of its key %s, stopped at its checkpoint",
                lease.job_id,
                lease.key,
                extra=lease_fields(lease),
            )
            raise Ignore() from None
        except Preempted:
            if lifecycle.hand_back(task, lease, reap_in=0.0) == State.QUEUED:
                lifecycle.send_again(task, lease, self.delivery)
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
            lifecycle.hand_back(task, lease, reap_in=0.0)
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
        try:
            recording = lifecycle.retry_now(self.task, lease, message, countdown, lost=False)
        except (Cancelled, Superseded):
            raise Ignore() from None  # a cancel met the retry: the reaper says REVOKED
        except LeaseError as exc:
            logger.warning(
                "job %s: could not hand the lease back for its retry (%s); it expires in %.0f s",
                lease.job_id,
                exc,
                lease.duration,
                extra=lease_fields(lease),
            )
            raise Ignore() from exc
        if recording.message is not None and lease.released:
            recording.message.send(self.task.app)

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
        # The count travels in the job's message (every copy sent again carries it).
        again = self.delivery.with_headers(**{CONFLICT_HEADER: tries})
        try:
            state = lifecycle.hand_back_for_retry(self.task, lease, again, delay)
        except LeaseError as store_exc:
            logger.warning(
                "job %s: could not release the lease (%s); it expires in %.0f s",
                lease.job_id,
                store_exc,
                lease.duration,
                extra=lease_fields(lease),
            )
            state = None
        if state == State.QUEUED:
            lifecycle.send_again(self.task, lease, again, countdown=delay)
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
        if lifecycle.fail(self.task, lease, exc) is False:
            raise Ignore() from None  # a stale attempt's failure: not recorded

    def finish(self, lease: Lease, result: Any) -> None:
        if lease.released:
            return
        if not lifecycle.finish(self.task, lease, result):
            raise Ignore()
