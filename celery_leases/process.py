"""This worker process, as the leases name it, and other processes of this machine.

An owner name is ``<node>/<instance>/<pid>``: the Celery node name (``celery@host``), an id of
the worker (its main process, taken at import: the pool processes it forks share it), and the
process id. Two workers started with one node name (two containers of one image, each with a
``celery@worker``, often with the same pids) have owners of their own: neither hands back,
preempts or takes the other's jobs.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket

#: This worker's id (its main process's, shared by the pool processes it forks).
INSTANCE = secrets.token_hex(4)


def owner_name(node: str | None, pid: int | None = None) -> str:
    """The owner name of process ``pid`` (default: this one) of the worker ``node``."""
    return f"{node or socket.gethostname()}/{INSTANCE}/{pid or os.getpid()}"


def owner_prefix(node: str | None) -> str:
    """What every owner name of this worker (node ``node``) starts with."""
    return f"{node or socket.gethostname()}/{INSTANCE}/"


def owner_host(owner: str | None) -> str | None:
    """The host of an owner name (``node@host/...``; ``host/...`` without a node name)."""
    if not owner:
        return None
    node = owner.split("/", 1)[0]
    return node.rpartition("@")[2] or None


#: The signals sent to a whole process: a shutdown's (TERM, INT, QUIT, HUP), billiard's SIGTERM
#: to a pool process past its hard time limit, a soft time limit's SIGUSR1.
PROCESS_SIGNALS = frozenset(
    {
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGALRM,
        signal.SIGCHLD,
    }
)


def leave_signals_to_the_main_thread() -> None:
    """Block ``PROCESS_SIGNALS`` in the calling thread, a thread of the library's own (call it
    first in its ``run``): the kernel then delivers them to the main thread only, whose mask
    Celery and billiard rely on. billiard blocks SIGTERM in a pool process's main thread while
    it writes the process's last message to the worker, under a lock the process that
    replaces it shares; after a hard time limit the worker sends SIGTERM twice, a few
    milliseconds apart, and a second one taken by a keeper thread killed the process inside
    that write: the lock stayed taken, and the replacement waited for it forever.

    Nothing is blocked on the process's main OS thread itself: under gevent (``-P gevent``) a
    "thread" is a greenlet of it, and blocking there would leave the worker deaf to SIGTERM."""
    if not _on_main_os_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, PROCESS_SIGNALS)


def _on_main_os_thread() -> bool:
    """True on the process's main OS thread (Linux: its thread id is the process id), or when
    that cannot be told."""
    try:
        task = os.readlink("/proc/thread-self")  # "<pid>/task/<tid>"
    except OSError:
        return True
    return task.rsplit("/", 1)[-1] == str(os.getpid())


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent pid, ...
    (Linux; OSError where there is no such process or no /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()


__all__ = [
    "INSTANCE",
    "PROCESS_SIGNALS",
    "leave_signals_to_the_main_thread",
    "owner_host",
    "owner_name",
    "owner_prefix",
    "proc_stat",
]
