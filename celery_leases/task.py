"""LeasedTask: a Celery task base class whose every run holds a database lease."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import random
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid
from celery.utils.log import get_task_logger
from sqlalchemy.engine import Connection

from . import metrics
from .config import Settings, settings_for
from .errors import (
    ArgumentsError,
    Cancelled,
    CheckpointError,
    CorruptJob,
    LeaseError,
    LeaseLost,
    Preempted,
    StoreUnavailable,
)
from .keeper import keeper_for
from .lease import Lease, checkpoint_hook, current
from .schema import CANCELLED, FINISHED_STATES
from .store import Refused, Store, store_for

logger = get_task_logger("celery_leases")
_log = logging.getLogger("celery_leases")

#: Set while a message is published that must not register the job (it already is).
_publishing_unregistered: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "celery_leases_publishing_unregistered", default=False
)

ROUTING_OPTIONS = ("queue", "exchange", "routing_key", "priority")
DB_RETRY_HEADER = "leases_db_retries"


def dumps(value: Any) -> str:
    """JSON text of ``value``; NaN and Infinity are refused (they are not JSON)."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)


class LeasedTask(Task):  # type: ignore[misc]
    """Base class for tasks that hold a lease, checkpoint, and resume after a crash.

    Use as ``@app.task(base=LeasedTask, bind=True)``. Task options ``lease_duration``,
    ``lease_renew_interval``, ``lease_stall_timeout`` (seconds), ``lease_max_checkpoint_bytes``
    and ``lease_kill_stalled`` override the app's ``leases_*`` settings for one task.
    """

    lease_duration: float | None = None
    lease_renew_interval: float | None = None
    lease_max_checkpoint_bytes: int | None = None
    lease_stall_timeout: float | None = None
    lease_kill_stalled: bool | None = None

    _lease_settings_cache: Settings | None = None

    @property
    def retry_on_worker_lost(self) -> bool:
        """Celery >= 5.7: when a pool process dies, record RETRY instead of FAILURE.

        The job resumes from its checkpoint through the reaper, so a client blocked in
        ``AsyncResult(id).get()`` keeps waiting for the final result rather than getting
        ``WorkerLostError``. Not with ``acks_late`` + ``reject_on_worker_lost``, where the
        broker delivers the message again itself.
        """
        return not (self.acks_late and self.reject_on_worker_lost)

    # -- settings and store ---------------------------------------------------------------

    @property
    def lease_settings(self) -> Settings:
        """The validated ``leases_*`` settings with this task's options applied."""
        cached = self.__dict__.get("_lease_settings_cache")
        if cached is None:
            cached = settings_for(self.app).with_task_options(self)
            self.__dict__["_lease_settings_cache"] = cached
        return cached

    @property
    def lease_store(self) -> Store:
        return store_for(self.lease_settings)

    # -- inside the task -------------------------------------------------------------------

    @property
    def lease(self) -> Lease:
        """The lease of the attempt running in this thread."""
        if not current.stack:
            raise LeaseError("self.lease is only available while a LeasedTask runs")
        return current.stack[-1]

    def checkpoint(
        self,
        state: Any,
        *,
        progress: tuple[int, int | None] | int | None = None,
        connection: Connection | None = None,
    ) -> None:
        """Save ``state`` (JSON-serializable) as the point to resume from, and renew the lease.

        ``progress`` is ``(done, total)`` or ``done``. With ``connection``, the checkpoint joins
        that SQLAlchemy transaction (same database as the leases): your writes and the
        checkpoint commit together, and a stale attempt gets :class:`LeaseLost` before
        committing anything. Raises :class:`CheckpointError` for a state that is not JSON or too
        large (nothing is written), :class:`Cancelled` or :class:`Preempted` after saving when
        the job was asked to stop.
        """
        lease = self.lease
        settings = self.lease_settings
        try:
            text = dumps(state)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint of job {lease.job_id} is not JSON-serializable ({exc}); "
                f"the previous checkpoint is kept"
            ) from exc
        size = len(text.encode())
        if size > settings.max_checkpoint_bytes:
            raise CheckpointError(
                f"checkpoint of job {lease.job_id} is {size} bytes, over "
                f"leases_max_checkpoint_bytes ({settings.max_checkpoint_bytes}); "
                f"the previous checkpoint is kept"
            )
        done_total = _progress(progress)
        self.stop_point()  # asked to stop since the last checkpoint: write nothing more
        if lease.lost:
            raise LeaseLost(f"job {lease.job_id}: this attempt lost its lease; stop")
        stop = None
        if not lease.detached:  # a direct call keeps its checkpoints in memory only
            started = time.monotonic()
            saved, stop = self._write_checkpoint(lease, text, done_total, connection)
            metrics.checkpoint_seconds(time.monotonic() - started)
            if not saved:
                lease.lost = True
                metrics.count("leases_lost")
                logger.warning(
                    "lease lost on job %s (token %s): another attempt holds it; "
                    "checkpoint not saved",
                    lease.job_id,
                    lease.token,
                )
                raise LeaseLost(f"job {lease.job_id}: another attempt holds the lease; stop")
            lease.deadline = started + lease.duration
            lease.last_progress = time.monotonic()
            if done_total is not None:
                self._report_progress(*done_total)
        lease.checkpoint = json.loads(text)
        hook = checkpoint_hook.get()
        if hook is not None:
            hook(lease, lease.checkpoint)
        lease.stop_requested = stop or lease.stop_requested
        if connection is None:
            self.stop_point()
        # Inside the caller's transaction a raise would roll the checkpoint back: the stop is
        # raised by stop_point() after the commit, or before the next checkpoint writes.

    def stop_point(self) -> None:
        """Raise :class:`Cancelled` or :class:`Preempted` if the job was asked to stop.

        ``checkpoint()`` calls it after saving; with ``checkpoint(..., connection=conn)`` call it
        yourself once your transaction has committed, so the job stops right there.
        """
        lease = self.lease
        if lease.stop_requested == "cancel":
            raise Cancelled(f"job {lease.job_id} was cancelled; stopped at its checkpoint")
        if lease.stop_requested == "preempt":
            raise Preempted(f"job {lease.job_id} handed back at its checkpoint (shutdown)")

    def _write_checkpoint(
        self,
        lease: Lease,
        text: str,
        progress: tuple[int, int | None] | None,
        connection: Connection | None,
    ) -> tuple[bool, str | None]:
        store = self.lease_store
        if connection is not None:
            return store.checkpoint(
                lease.job_id, lease.token, text, progress=progress, connection=connection
            )
        delay = 0.1
        while True:
            try:
                return store.checkpoint(lease.job_id, lease.token, text, progress=progress)
            except StoreUnavailable as exc:
                if time.monotonic() + delay > lease.deadline:
                    lease.lost = True
                    raise LeaseLost(
                        f"job {lease.job_id}: database unreachable until the lease ended; "
                        f"stop ({exc})"
                    ) from exc
                logger.warning("checkpoint of job %s waits for the database: %s", lease.job_id, exc)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _report_progress(self, done: int, total: int | None) -> None:
        if self.ignore_result or self.request.called_directly:
            return
        try:
            self.update_state(state="PROGRESS", meta={"done": done, "total": total})
        except Exception as exc:  # a result backend that cannot store states is not fatal
            logger.debug("could not store PROGRESS of %s: %r", self.request.id, exc)

    # -- publishing ------------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Record the job (state ``queued``) in the leases table, then publish it."""
        if _publishing_unregistered.get():
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        task_id = task_id or uuid()
        settings = self.lease_settings
        store = store_for(settings)
        held = next((lease for lease in current.stack if lease.job_id == task_id), None)
        registered = False
        if held is not None and not held.detached:
            # A retry of the running attempt: hand the lease back before the new message can
            # reach another worker, or its claim would find the lease still held.
            # If the retry message is lost (its worker dies holding it until its ETA), the
            # reaper publishes the job again once it is overdue; a duplicate is dropped.
            wait = settings.queued_timeout or settings.reap_grace
            reap_in = (_countdown(options) or 0.0) + wait
            store.release(held.job_id, held.token, reap_in=reap_in)
            held.released = True
        else:
            try:
                args_text = dumps(list(args or ()))
                kwargs_text = dumps(dict(kwargs or {}))
                options_text = dumps(
                    {k: options[k] for k in ROUTING_OPTIONS if options.get(k) is not None}
                )
            except (TypeError, ValueError) as exc:
                raise ArgumentsError(
                    f"arguments of {self.name} must be JSON-serializable to be recorded "
                    f"for a resume ({exc}); nothing was published"
                ) from exc
            registered = store.register(
                task_id,
                task=self.name,
                args=args_text,
                kwargs=kwargs_text,
                options=options_text,
                countdown=_countdown(options),
                queued_timeout=settings.queued_timeout,
            )
            if not registered:
                known = store.get(task_id)
                if known is not None and known.state in FINISHED_STATES:
                    _log.warning(
                        "job %s is already %s: this message will be dropped at its claim "
                        "(celery leases retry re-runs a failed job)",
                        task_id,
                        known.state,
                    )
        try:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        except BaseException:
            if registered:
                # Never published: leave no queued row that no message will ever claim.
                store.forget(task_id)
            raise

    # -- running ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.id is None:
            with _holding(Lease("(direct call)", 0, 1, None, "", 1.0, 0.5, detached=True)):
                return self.run(*args, **kwargs)
        settings = self.lease_settings
        store = store_for(settings)
        owner = f"{request.hostname or socket.gethostname()}/{os.getpid()}"
        try:
            outcome = store.claim(
                request.id,
                owner=owner,
                duration=settings.duration,
                task=self.name,
                args=_safe_dumps(list(args)) or "[]",
                kwargs=_safe_dumps(kwargs) or "{}",
                options=dumps(_routing(request)),
            )
        except StoreUnavailable as exc:
            if request.is_eager:
                raise  # no broker message to deliver again; eager mode would recurse
            self._redeliver_later(args, kwargs, exc)
            raise Ignore() from exc
        except CorruptJob as exc:
            # The row cannot be read: fail it for good rather than redeliver it forever.
            store.give_up(request.id, error=str(exc))
            logger.error("job %s: %s; marked failed", request.id, exc)
            raise
        if isinstance(outcome, Refused):
            if outcome.reason == "held" and (request.delivery_info or {}).get("redelivered"):
                # The broker gave back the message of an attempt that died (acks_late with
                # reject_on_worker_lost, a lost connection) before its lease ran out: come back
                # when it has, or nothing but a reaper would ever run the job again.
                delay = max(outcome.expires_in or 0.0, 0.0) + 0.25
                logger.info(
                    "job %s: redelivered while a lease still holds it (owner %s); "
                    "delivering again in %.1f s, when that lease has ended",
                    request.id,
                    outcome.owner,
                    delay,
                )
                self._send_again(args, kwargs, countdown=delay)
                raise Ignore()
            metrics.count("duplicates_dropped")
            logger.info("job %s: message dropped, %s", request.id, _refusal_text(outcome))
            raise Ignore()
        lease = Lease(
            job_id=request.id,
            token=outcome.token,
            attempt=outcome.attempt,
            checkpoint=outcome.checkpoint,
            owner=owner,
            duration=settings.duration,
            renew_interval=settings.renew_interval,
            stall_timeout=settings.stall_timeout,
            kill_when_stalled=settings.kill_stalled,
            checkpoint_age=outcome.checkpoint_age,
        )
        metrics.count("claims")
        if outcome.attempt > 1:
            metrics.count("resumes")
            age = (
                "none" if outcome.checkpoint_age is None else f"{outcome.checkpoint_age:.1f} s old"
            )
            logger.info(
                "job %s: resumed, attempt %d, token %d, checkpoint %s",
                lease.job_id,
                lease.attempt,
                lease.token,
                age,
            )
        else:
            logger.info("job %s: claimed, token %d", lease.job_id, lease.token)
        keeper = keeper_for(store)
        keeper.add(lease)
        try:
            with _holding(lease):
                return self._run_leased(store, lease, args, kwargs)
        finally:
            keeper.remove(lease)

    def _run_leased(self, store: Store, lease: Lease, args: Any, kwargs: Any) -> Any:
        try:
            result = self.run(*args, **kwargs)
        except Retry:
            if not lease.released:
                self._release(store, lease, reap_in=0.0)
            raise
        except Reject as exc:
            self._release(store, lease, reap_in=None if exc.requeue else 0.0)
            raise
        except LeaseLost:
            logger.warning(
                "job %s: attempt with token %d stopped, lease lost", lease.job_id, lease.token
            )
            raise Ignore() from None
        except Cancelled as exc:
            store.fail(lease.job_id, lease.token, error=str(exc), state=CANCELLED)
            logger.info("job %s: cancelled at its checkpoint", lease.job_id)
            raise
        except Preempted:
            self._release(store, lease, reap_in=0.0)
            self._republish(lease.job_id)
            logger.info("job %s: handed back at its checkpoint for another worker", lease.job_id)
            raise Ignore() from None
        except Ignore:
            self._finish(store, lease, None)
            raise
        except Exception as exc:
            if lease.released:
                raise
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            try:
                ended = store.fail(lease.job_id, lease.token, error=text)
            except LeaseError as store_exc:
                logger.error(
                    "job %s: failed, and the failure could not be recorded: %s",
                    lease.job_id,
                    store_exc,
                )
            else:
                if not ended:
                    logger.warning(
                        "job %s: a stale attempt failed (token %d); not recorded",
                        lease.job_id,
                        lease.token,
                    )
                    raise Ignore() from None
            raise
        except BaseException as exc:
            if getattr(exc, "simulated_crash", False):
                raise  # celery_leases.testing: die like a killed process, lease still held
            # The process is going down (SystemExit, KeyboardInterrupt): hand the job back.
            self._release(store, lease, reap_in=0.0)
            raise
        self._finish(store, lease, result)
        return result

    def _finish(self, store: Store, lease: Lease, result: Any) -> None:
        if lease.released:
            return
        delay = 0.2
        while True:
            try:
                ended = store.finish(lease.job_id, lease.token, result=_safe_dumps(result))
                break
            except StoreUnavailable as exc:
                if time.monotonic() + delay > lease.deadline:
                    logger.error(
                        "job %s: done, but the database stayed down until the lease "
                        "ended; it will run again from its checkpoint",
                        lease.job_id,
                    )
                    raise
                logger.warning(
                    "job %s: done, waiting for the database to record it: %s", lease.job_id, exc
                )
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        if not ended:
            metrics.count("leases_lost")
            logger.warning(
                "job %s: attempt with token %d finished after losing its lease; "
                "its result is dropped",
                lease.job_id,
                lease.token,
            )
            raise Ignore()

    def _release(self, store: Store, lease: Lease, *, reap_in: float | None) -> None:
        try:
            store.release(lease.job_id, lease.token, reap_in=reap_in)
            lease.released = True
        except LeaseError as exc:
            logger.warning(
                "job %s: could not release the lease (%s); it expires in %.0f s",
                lease.job_id,
                exc,
                lease.duration,
            )

    def _republish(self, job_id: str) -> None:
        job = self.lease_store.get(job_id)
        if job is None:
            return
        republish(self.app, job)

    def _redeliver_later(self, args: Any, kwargs: Any, exc: Exception) -> None:
        """The database is down: send the message again later instead of running unleased."""
        request = self.request
        tries = int((request.headers or {}).get(DB_RETRY_HEADER) or 0) + 1
        delay = min(2.0**tries, self.lease_settings.db_retry_max_delay) * random.uniform(0.5, 1)
        logger.error(
            "job %s: leases database unreachable, delivering again in %.1f s (try %d): %s",
            request.id,
            delay,
            tries,
            exc,
        )
        self._send_again(args, kwargs, countdown=delay, headers={DB_RETRY_HEADER: tries})

    def _send_again(
        self, args: Any, kwargs: Any, *, countdown: float, headers: dict[str, Any] | None = None
    ) -> None:
        """Publish the current message again (same id and routing) in ``countdown`` seconds."""
        request = self.request
        token = _publishing_unregistered.set(True)
        try:
            self.apply_async(
                args,
                kwargs,
                task_id=request.id,
                countdown=countdown,
                headers=headers or {},
                **_routing(request),
            )
        finally:
            _publishing_unregistered.reset(token)


def republish(app: Any, job: Any) -> None:
    """Publish a recorded job again, with its id, arguments and routing (no new row)."""
    options = {k: v for k, v in (job.options or {}).items() if k in ROUTING_OPTIONS}
    token = _publishing_unregistered.set(True)
    try:
        app.send_task(job.task, args=job.args, kwargs=job.kwargs, task_id=job.id, **options)
    finally:
        _publishing_unregistered.reset(token)


@contextmanager
def _holding(lease: Lease) -> Iterator[Lease]:
    current.stack.append(lease)
    try:
        yield lease
    finally:
        current.stack.remove(lease)


def _progress(progress: Any) -> tuple[int, int | None] | None:
    if progress is None:
        return None
    if isinstance(progress, int) and not isinstance(progress, bool):
        return (progress, None)
    if (
        isinstance(progress, tuple | list)
        and len(progress) == 2
        and isinstance(progress[0], int)
        and (progress[1] is None or isinstance(progress[1], int))
    ):
        return (int(progress[0]), None if progress[1] is None else int(progress[1]))
    raise CheckpointError(f"progress must be done or (done, total) integers, not {progress!r}")


def _routing(request: Any) -> dict[str, Any]:
    """The routing the current message came with, to publish it (or its job) there again."""
    info = request.delivery_info or {}
    routing = {
        "queue": info.get("routing_key"),
        "exchange": info.get("exchange"),
        "priority": info.get("priority"),
    }
    return {k: v for k, v in routing.items() if v not in (None, "")}


def _countdown(options: dict[str, Any]) -> float | None:
    countdown = options.get("countdown")
    if countdown:
        return float(countdown)
    eta = options.get("eta")
    if eta is not None:
        from datetime import datetime, timezone

        moment = eta if eta.tzinfo else eta.replace(tzinfo=timezone.utc)
        return float(max(0.0, (moment - datetime.now(timezone.utc)).total_seconds()))
    return None


def _safe_dumps(value: Any) -> str | None:
    try:
        return dumps(value)
    except (TypeError, ValueError):
        return None


def _refusal_text(refused: Refused) -> str:
    if refused.reason == "held":
        left = f", {refused.expires_in:.1f} s left" if refused.expires_in is not None else ""
        return f"a live lease holds it (owner {refused.owner}{left}): duplicate delivery"
    return f"the job is already {refused.reason}"
