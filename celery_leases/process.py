"""Processes of this machine, as Linux's ``/proc`` shows them."""

from __future__ import annotations

import os
import socket


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent pid, ...
    (Linux; OSError where there is no such process or no /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()


def local_process_gone(owner: str | None, pid: int | None) -> bool:
    """True if ``owner`` ("node@host/pid") runs on this host and its process ``pid`` is gone
    (a zombie counts as gone)."""
    if not owner or not pid:
        return False
    node = owner.rsplit("/", 1)[0]
    if node.rpartition("@")[2] != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (owned by another user)
        return False
    try:
        return proc_stat(pid)[0] == "Z"
    except OSError:
        return False


__all__ = ["local_process_gone", "proc_stat"]
