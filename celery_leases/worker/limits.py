"""A soft time limit reaches a leased task's execution once.

A prefork pool process learns of its task's soft time limit by a signal (``SIGUSR1``), whose
handler raises ``SoftTimeLimitExceeded`` wherever the task is. The worker's main process can
send it twice for one execution: its timer sends it when the limit passes, and when the worker
then shuts down (a warm shutdown, a deploy), billiard's pool checks every running job's limits
once more at its shutdown (``finish_at_shutdown``) and sends it again. The second one lands in
the task's handler of the first: in the last checkpoint it saves, or in the library's record
of its end, and the job fails instead of ending as its handler decided (seen in the chaos run:
two "Soft time limit exceeded" lines in one millisecond, a job failed with the limit it had
caught).

The same goes for a limit that comes once the body has returned or raised: it would land in
the record of the attempt's end, the library's (a hand-back for a retry, a failure) or
Celery's own (storing the result, sending the links), which then stores FAILURE and calls
the errbacks of a job the table has done.

So in a pool process, the handler is wrapped (:class:`SoftLimitOnce`, installed at the first
task): during the execution of a leased task (``task_prerun`` to ``task_postrun``, Celery's
own work on the result and the links included), a second soft limit, or one after the
body has returned or raised (:func:`body_over`), is logged and ignored.
Other tasks, and processes whose handler is not billiard's (threads, gevent, solo), are left
as they are. The hard limit (``time_limit``) is untouched.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("celery_leases")

#: The signal billiard sends a pool process for a soft time limit (None where there is none).
SOFT_LIMIT_SIGNAL = getattr(signal, "SIGUSR1", None)


class SoftLimitOnce:
    """billiard's soft time limit handler, raising once per leased execution."""

    def __init__(self, handler: Callable[[int, Any], Any]) -> None:
        self.handler = handler
        self._serial = 0
        #: The leased execution running now, ``(task id, serial)``, or None.
        self.execution: tuple[str, int] | None = None
        self._raised: tuple[str, int] | None = None
        #: The leased execution's body has returned or raised.
        self.over = False

    def start(self, task_id: str, leased: bool) -> None:
        self._serial += 1
        self.execution = (task_id, self._serial) if leased else None
        self.over = False

    def end(self) -> None:
        self.execution = None

    def __call__(self, signum: int, frame: Any) -> Any:
        execution = self.execution
        if execution is not None:
            if self.over:
                logger.warning(
                    "celery-leases: task %s: its soft time limit came after it returned or "
                    "raised, while its end was recorded; ignored",
                    execution[0],
                )
                return None
            if self._raised == execution:
                logger.warning(
                    "celery-leases: task %s: its soft time limit came a second time (the "
                    "worker is shutting down); ignored, the task already had it",
                    execution[0],
                )
                return None
            self._raised = execution
        return self.handler(signum, frame)


_guard: SoftLimitOnce | None = None


def billiards_handler() -> Callable[[int, Any], Any] | None:
    """billiard's soft time limit handler, if it is the one this process has installed."""
    if SOFT_LIMIT_SIGNAL is None:
        return None
    try:
        from billiard.pool import soft_timeout_sighandler
    except ImportError:
        return None
    installed = signal.getsignal(SOFT_LIMIT_SIGNAL) is soft_timeout_sighandler
    return soft_timeout_sighandler if installed else None


def execution_starts(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """``task_prerun``: a task's execution starts in this process (guarded if it is leased)."""
    global _guard
    if SOFT_LIMIT_SIGNAL is None:
        return
    guard = _guard if signal.getsignal(SOFT_LIMIT_SIGNAL) is _guard else None
    if guard is None:
        handler = billiards_handler()
        if handler is None:  # not a prefork pool process (or another handler is in place)
            return
        guard = _guard = SoftLimitOnce(handler)
        signal.signal(SOFT_LIMIT_SIGNAL, guard)
    guard.start(str(task_id), bool(getattr(sender, "__celery_leases__", False)))


def body_over() -> None:
    """The running leased execution's body has returned or raised (``Attempt.body``): a soft
    time limit from now on would land in the record of its end, the library's (a hand-back,
    a failure) or Celery's (storing the result, sending the links), and turn that end into
    another (a done job FAILURE there, its errbacks called)."""
    if _guard is not None and _guard.execution is not None:
        _guard.over = True


def execution_ends(**_: Any) -> None:
    """``task_postrun``: the execution is over (Celery has stored its result)."""
    if _guard is not None:
        _guard.end()


__all__ = ["SoftLimitOnce", "body_over", "execution_ends", "execution_starts"]
