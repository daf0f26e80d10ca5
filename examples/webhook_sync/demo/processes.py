"""The demo's child processes: each in its own session, logging to a file, stopped as a group."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    # If the demo itself is killed (kill -9, a CI timeout), its children must not outlive it:
    # a leftover worker would take the next run's messages.
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ChildFailed(Exception):
    """A child process exited, or did not log what it should have in time."""


class Child:
    """One subprocess; its stdout and stderr go to ``log_path``."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str]):
        self.name = name
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                list(argv),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_for(self, pattern: str, *, timeout: float) -> re.Match[str]:
        """Wait until the log matches ``pattern`` (regex); ``timeout`` in seconds."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.log_text())
            if match:
                return match
            if not self.alive():
                problem = f"exited with status {self.process.returncode}"
            elif time.monotonic() > deadline:
                problem = f"did not log {pattern!r} within {timeout:.0f} s"
            else:
                time.sleep(0.05)
                continue
            raise ChildFailed(
                f"{self.name} (pid {self.pid}) {problem}; end of {self.log_path}:\n"
                f"{self.log_tail()}"
            )

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process and every process of its session (a worker's pool)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


class Children:
    """Starts children with one environment and log folder, and stops them all."""

    def __init__(self, log_dir: Path, env: Mapping[str, str]) -> None:
        self.log_dir = log_dir
        self.env = dict(env)
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: Sequence[str]) -> Child:
        child = Child(name, argv, self.log_dir / f"{name}.log", self.env)
        self.children.append(child)
        return child

    def stop_all(self, timeout: float = 3.0) -> None:
        """SIGTERM every child, then SIGKILL each process group after ``timeout`` seconds.

        A worker's warm shutdown hands a running job back within a second (celery-leases
        preempts it at its next checkpoint); an idle worker then spends ~3 s more in billiard's
        exit handlers, which is not worth waiting for.
        """
        for child in self.children:
            if child.alive():
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
            child.kill_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(5)
