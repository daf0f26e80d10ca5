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


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent pid, ...
    (Linux; OSError where there is no such process or no /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()


__all__ = ["INSTANCE", "owner_host", "owner_name", "owner_prefix", "proc_stat"]
