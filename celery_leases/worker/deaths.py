"""The watch for dead pool processes, in a worker's main process."""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from ..process import leave_signals_to_the_main_thread, proc_stat

logger = logging.getLogger("celery_leases")


class Deaths(threading.Thread):
    """In a worker's main process: watches each prefork pool process that took a leased job
    (a pidfd, Linux 5.3+) and, the moment one dies, hands its job back and sends it again.

    Billiard reports a dead pool process on a timer (up to 5 s later); this thread sees the
    death at once. It tracks one job per process (a pool process runs one task at a time),
    the last it accepted: a job that ended before its process died is left alone by the
    hand-back's own conditions, and billiard's later report finds the job moved on."""

    def __init__(self) -> None:
        super().__init__(name="celery-leases-deaths", daemon=True)
        #: Called after each death this thread handled: a prefork worker asks its pool to
        #: replace the dead process now (``worker.replace_dead_processes_at_once``).
        self.after_death: Callable[[], Any] | None = None
        self._lock = threading.Lock()
        self._jobs: dict[int, Any] = {}  # pid -> its LeasedRequest
        self._pids: dict[int, int] = {}  # pidfd -> pid
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        self._poll.register(self._wake_r, select.POLLIN)

    def watch(self, request: Any, pid: int) -> None:
        """Watch pool process ``pid``, which took ``request`` (a ``LeasedRequest``): when it
        dies, ``request.resume_after_death()`` runs on this thread."""
        with self._lock:
            self._jobs[pid] = request
            if pid in self._pids.values():
                return
            try:
                if not _is_child(pid):  # a threads or gevent pool's "pid" names no process
                    raise ProcessLookupError(pid)
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError, OverflowError):  # no pidfd here, or no process
                self._jobs.pop(pid, None)
                return
            self._pids[fd] = pid
            self._poll.register(fd, select.POLLIN)
        os.write(self._wake_w, b"w")  # poll() takes new descriptors at its next call

    def run(self) -> None:
        leave_signals_to_the_main_thread()
        while True:
            for fd, _ in self._poll.poll():
                if fd == self._wake_r:
                    os.read(fd, 4096)
                    continue
                with self._lock:
                    self._poll.unregister(fd)
                    os.close(fd)
                    request = self._jobs.pop(self._pids.pop(fd), None)
                if request is not None:
                    request.resume_after_death()
                after = self.after_death
                if after is not None:
                    try:
                        after()
                    except Exception:  # billiard's own check replaces the process later
                        logger.exception("celery-leases: asking for a new pool process failed")


def _is_child(pid: int) -> bool:
    """True if ``pid`` is a process this process forked (its pool's)."""
    return int(proc_stat(pid)[1]) == os.getpid()


_deaths: Deaths | None = None
_deaths_lock = threading.Lock()


def deaths() -> Deaths:
    """This process's running :class:`Deaths` thread (started on first use, also after fork)."""
    global _deaths
    with _deaths_lock:
        if _deaths is None or not _deaths.is_alive():
            _deaths = Deaths()
            _deaths.start()
        return _deaths


__all__ = ["Deaths", "deaths"]
