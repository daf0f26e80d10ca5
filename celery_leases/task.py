"""LeasedTask: a Celery task base class whose every run holds a database lease."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.utils import uuid
from sqlalchemy.engine import Connection

from . import attempt, message
from .config import Settings, settings_for
from .errors import ArgumentsError, LeaseError
from .lease import Lease, current, holding
from .schema import FINISHED_STATES
from .store import Store, store_for

_log = logging.getLogger("celery_leases")


class LeasedTask(Task):  # type: ignore[misc]
    """Base class for tasks that hold a lease, checkpoint, and resume after a crash.

    Use as ``@app.task(base=LeasedTask, bind=True)``. Task options ``lease_duration``,
    ``lease_renew_interval``, ``lease_stall_timeout`` (seconds), ``lease_max_checkpoint_bytes``
    and ``lease_kill_stalled`` override the app's ``leases_*`` settings for one task.
    """

    @property
    def retry_on_worker_lost(self) -> bool:
        """Celery >= 5.7: when a pool process dies, record RETRY instead of FAILURE.

        The job resumes from its checkpoint through the reaper, so a client blocked in
        ``AsyncResult(id).get()`` keeps waiting for the final result rather than getting
        ``WorkerLostError``. Not with ``acks_late`` + ``reject_on_worker_lost``, where the
        broker delivers the message again itself.
        """
        return not (self.acks_late and self.reject_on_worker_lost)

    @property
    def lease_settings(self) -> Settings:
        """The validated ``leases_*`` settings with this task's options applied."""
        cached: Settings | None = self.__dict__.get("_lease_settings")
        if cached is None:
            cached = self.__dict__["_lease_settings"] = settings_for(self.app).with_task_options(
                self
            )
        return cached

    @property
    def lease_store(self) -> Store:
        return store_for(self.lease_settings)

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
        attempt.checkpoint(self, self.lease, state, progress=progress, connection=connection)

    def stop_point(self) -> None:
        """Raise :class:`Cancelled` or :class:`Preempted` if the job was asked to stop.

        ``checkpoint()`` calls it after saving; with ``checkpoint(..., connection=conn)`` call it
        yourself once your transaction has committed, so the job stops right there.
        """
        attempt.stop_point(self.lease)

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
            reap_in = (message.countdown(options) or 0.0) + wait
            store.hand_back(held.job_id, held.token, reap_in=reap_in)
            held.released = True
        else:
            registered = self._register(store, task_id, args, kwargs, options)
        try:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        except BaseException:
            if registered:
                # Never published: leave no queued row that no message will ever claim.
                store.forget(task_id)
            raise

    def _register(
        self, store: Store, task_id: str, args: Any, kwargs: Any, options: dict[str, Any]
    ) -> bool:
        try:
            args_text = message.dumps(list(args or ()))
            kwargs_text = message.dumps(dict(kwargs or {}))
            routing = {k: options[k] for k in message.ROUTING_OPTIONS if options.get(k) is not None}
            options_text = message.dumps(routing)
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
            countdown=message.countdown(options),
            queued_timeout=self.lease_settings.queued_timeout,
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
        return registered

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.id is None:
            with holding(Lease("(direct call)", 0, 1, None, "", 1.0, 0.5, detached=True)):
                return self.run(*args, **kwargs)
        return attempt.Attempt(self).run(args, kwargs)
