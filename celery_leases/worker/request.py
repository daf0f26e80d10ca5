"""LeasedRequest: a leased job's request in the worker's main process.

- When the pool process running the job dies (SIGKILL, the OOM killer, a segfault), the main
  process sees it at once (:class:`Deaths`; else billiard's report, up to 5 s later) and
  knows its pid: it hands that process's lease back and sends the job's recorded message
  again, so another pool process resumes it from its checkpoint without waiting for the
  lease to expire or the reaper. If the job already lives on elsewhere, it is left alone.
  The result backend is left as it was: a client in ``AsyncResult.get()`` keeps waiting for
  the real end.
- ``revoke(terminate=True)`` ends the job ``revoked`` in the table before the pool process is
  signalled, so the process's hand-back on its way out cannot put it back in the queue.
- When it dies after its attempt marked the job done but before Celery stored the result, the
  main process stores it and sends the callbacks and the chain's next step.
- A hard time limit is reported by billiard twice (the job's error callback, then its timeout
  callback), and Celery 5.7 stores the failure and fires the errbacks for each: the second
  report is skipped, so the errbacks fire once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import TimeLimitExceeded
from celery import signature
from celery.exceptions import WorkerLostError
from celery.worker.request import Request
from celery.worker.state import task_ready

from .. import lifecycle, routes
from ..db import Store, store_for
from ..db.rows import Job
from ..db.schema import DONE, FINISHED_STATES, LIVE_STATES, QUEUED
from ..errors import LeaseError
from ..log import job_fields
from ..process import owner_name
from ..states import State
from .deaths import deaths
from .signals import SHUTTING_DOWN, end_job

logger = logging.getLogger("celery_leases")


class LeasedRequest(Request):  # type: ignore[misc]
    """Celery's Request, resuming a leased job at once when its pool process dies."""

    _time_limit_reported = False
    #: Deaths handed this job back the moment its process died: billiard's later report of
    #: the death must leave it alone (a resumed attempt may even have finished it by then).
    _resumed_after_death = False

    #: Received while this worker shuts down: put back in the queue, never run here.
    _put_back = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Held while this job's dead process is handled: by ``Deaths`` the moment it died,
        #: or by billiard's report (``on_failure``), which then waits for the first to end
        #: instead of racing it (one connection, and a report that tells what happened).
        self._death_lock = threading.Lock()
        if SHUTTING_DOWN.is_set() and not self.acknowledged:
            # This worker is going down: a job received now (the hand-off of one of its own
            # jobs, say) would wait among its reserved messages until the shutdown ends, and
            # only then be restored. Put it back in the queue now, for another worker.
            self._put_back = True
            self.reject(requeue=True)
            logger.info(
                "celery-leases: job %s: this worker is shutting down; put back",
                self.id,
                extra=job_fields(self.id),
            )

    def revoked(self) -> bool:
        # Celery's worker runs a subclass of this class whose execute_using_pool is its own
        # (celery.worker.request.create_request_cls): it asks revoked() first, and skips a
        # request for which it is true. A request put back is skipped the same way.
        if self._put_back:
            task_ready(self)  # out of the worker's reserved requests
            return True
        return bool(super().revoked())

    def on_accepted(self, pid: int, time_accepted: float) -> Any:
        result = super().on_accepted(pid, time_accepted)
        task = self.task
        if pid and pid != os.getpid() and not (task.acks_late and task.reject_on_worker_lost):
            deaths().watch(self, pid)
        return result

    def resume_after_death(self) -> None:
        """The pool process that took this job has died (seen by ``deaths.Deaths``): hand its
        lease back and send the job again now; nothing if the job has moved on or ended."""
        try:
            with self._death_lock, routes.using(self._route()):
                store = store_for(self.task.lease_settings)
                self._resumed_after_death = self._resume_at_once(
                    store, self._dead_owner(), seen_at_once=True
                )
        except Exception as exc:  # billiard's report of the death comes later and retries
            logger.warning(
                "celery-leases: job %s: pool process lost, %r",
                self.id,
                exc,
                extra=job_fields(self.id),
            )

    def _route(self) -> str | None:
        """The leases database of this request's job (None: its task's own; the only one
        without routes); a database that cannot be asked leaves the task's own."""
        try:
            return self.task.lease_route(self._context)  # type: ignore[no-any-return]
        except LeaseError as exc:
            logger.warning(
                "celery-leases: job %s: its leases database is unknown here: %s",
                self.id,
                exc,
                extra=job_fields(self.id),
            )
            return None

    def _dead_owner(self) -> str:
        return owner_name(self.hostname, self.worker_pid)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        if isinstance(_unwrapped(exc_info.exception), TimeLimitExceeded):
            self._time_limit_reported = True
        if self._lost(exc_info.exception):
            # After the Deaths thread's hand-back, if it is at it.
            with self._death_lock, routes.using(self._route()):
                handled = self._handled_loss()
            if handled:
                task_ready(self)
                if self.task.acks_late:
                    self.acknowledge()
                return None
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft and self._time_limit_reported:
            return None  # on_failure stored FAILURE and fired the errbacks already
        return super().on_timeout(soft, timeout)

    def terminate(self, pool: Any, signal: Any = None) -> Any:
        if self.time_start:
            end_job(self.task, self.id, State.REVOKED, f"terminated in Celery ({self.hostname})")
        return super().terminate(pool, signal)

    def _lost(self, exc: Any) -> bool:
        exc = _unwrapped(exc)
        if isinstance(exc, SystemExit | KeyboardInterrupt):
            # The process died of a signal we did not send (a revoke's terminate is ours).
            return not (self._already_cancelled or self._already_revoked)
        return isinstance(exc, WorkerLostError)

    def _handled_loss(self) -> bool:
        """The pool process running this job died: settle it here and return True, or return
        False to let Celery decide as usual (FAILURE, or RETRY with ``retry_on_worker_lost``).

        Billiard notices a dead pool process on a timer (up to 5 s later), so by then the
        lease may have expired and the reaper sent the job again: a job that lives on
        elsewhere is left alone, and nothing is stored in the result backend for it."""
        if self._resumed_after_death:
            return True
        if self.worker_pid is None:
            return False  # it never started
        task = self.task
        broker_redelivers = task.acks_late and task.reject_on_worker_lost
        owner = self._dead_owner()
        store = store_for(task.lease_settings)
        try:
            if not broker_redelivers and self._resume_at_once(store, owner):
                return True
            job = store.get(self.id)
        except LeaseError as exc:
            logger.warning(
                "celery-leases: job %s: pool process lost, %s",
                self.id,
                exc,
                extra=job_fields(self.id),
            )
            return False
        if job is None:
            return False
        if job.state in LIVE_STATES and job.owner != owner:
            logger.warning(
                "celery-leases: job %s: pool process %s died; the job lives on (%s%s)",
                self.id,
                self.worker_pid,
                job.state,
                f", held by {job.owner}" if job.owner else "",
                extra=job_fields(self.id),
            )
            return True
        if job.state in FINISHED_STATES and job.state != DONE:
            # Ended since, outside this attempt (the reaper gave up on it, an operator
            # cancelled it, Celery revoked it): whoever ended it stored its end in the
            # result backend, which a WorkerLostError stored now would contradict.
            logger.warning(
                "celery-leases: job %s: pool process %s died; the job has ended %s since",
                self.id,
                self.worker_pid,
                job.state,
                extra=job_fields(self.id),
            )
            return True
        return job.state == DONE and self._finish_done(job)

    def _resume_at_once(self, store: Store, owner: str, *, seen_at_once: bool = False) -> bool:
        """Hand back the dead process's lease and send the job again (a job of a group: ask
        for its admission); False when that process held no lease on it that it may hand
        back (see ``Store.hand_back_owned``). ``seen_at_once``: the death was seen by
        ``deaths.Deaths``, not reported by billiard."""
        settings = self.task.lease_settings
        state = lifecycle.resume_after_death(
            self.task.app, store, self.id, owner, reap_grace=settings.reap_grace
        )
        if state is None:
            return False
        logger.warning(
            "celery-leases: job %s: pool process %s died%s; %s",
            self.id,
            self.worker_pid,
            " (seen at once)" if seen_at_once else "",
            "sent again to resume from its checkpoint" if state == QUEUED else f"now {state}",
            extra=job_fields(self.id),
        )
        return True

    def _finish_done(self, job: Job) -> bool:
        """The process died after its attempt marked the job done and before Celery stored
        the result: store it and send the callbacks and the chain's next step, as the trace
        would have. False (Celery decides) if the job was done before the pool process took
        this delivery (by another attempt), or its result was stored (the trace got that far,
        so it sent the callbacks too)."""
        if job.finished_at is None:
            return False
        finished_ago = job.created_at + job.age - job.finished_at  # database clock
        started = getattr(self, "time_start", None)
        # How long ago the pool process took this delivery: a duration on this host's clock
        # (not a time), compared with one on the database's. Billiard may report the death
        # long after it happened, so "long ago" cannot be the test.
        running_for = time.time() - started if started is not None else 0.0
        if finished_ago > running_for + 1.0:
            return False  # done before this delivery ran: by another attempt
        stored = getattr(self, "_success_was_stored", None)  # Celery >= 5.7
        if self.ignore_result or stored is None or stored():
            return False
        request = self._context
        self.task.backend.mark_as_done(self.id, job.result, request=request)
        parent = {"parent_id": self.id, "root_id": request.root_id or self.id}
        for callback in request.callbacks or ():
            signature(callback, app=self.task.app).apply_async((job.result,), **parent)
        if request.chain:
            step = signature(request.chain[-1], app=self.task.app)
            step.apply_async((job.result,), chain=request.chain[:-1], **parent)
        self.send_event("task-succeeded", result=repr(job.result), runtime=None)
        logger.warning(
            "celery-leases: job %s: pool process %s died after the job was done; its result "
            "stored and its callbacks sent",
            self.id,
            self.worker_pid,
            extra=job_fields(self.id),
        )
        return True


def _unwrapped(exc: Any) -> Any:
    return exc.exc if isinstance(exc, ExceptionWithTraceback) else exc
