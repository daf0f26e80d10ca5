"""Real ``celery worker`` and ``celery beat`` subprocesses for end-to-end tests.

    worker = Worker("tests.support.apps.plain_app", env=celery_env(settings), log_dir=tmp_path)
    with worker.start():
        ...  # send tasks; worker.children(); worker.signal(signal.SIGSTOP); worker.kill()

In tests prefer the ``spawn`` fixture (tests/conftest.py): it passes ``log_dir``, kills every
process it made at teardown, and shows the end of each log when the test fails.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent

# Every process started here and not yet reaped: killed at interpreter exit as a last resort.
_live: set[CeleryProcess] = set()
_numbers = itertools.count(1)
P = TypeVar("P", bound="CeleryProcess")


class CeleryProcess:
    """A ``python -m celery -A <app_module> <command>`` subprocess, logging to a file.

    The process runs in its own session, so Ctrl-C in the test run does not reach it and
    ``stop()`` can clean up everything it forked.
    """

    command_name = ""
    #: A log line that says the process is up; ``start()`` waits for it.
    ready_pattern = re.compile("")

    def __init__(
        self,
        app_module: str,
        *,
        env: Mapping[str, str] | None = None,
        loglevel: str = "info",
        extra_args: Iterable[str] = (),
        cwd: str | os.PathLike[str] = REPO_ROOT,
        log_dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
    ) -> None:
        self.app_module = app_module
        self.env = dict(env or {})
        self.loglevel = loglevel
        self.extra_args = tuple(extra_args)
        self.cwd = Path(cwd)
        self.name = name or f"{self.command_name}{next(_numbers)}-{uuid.uuid4().hex[:6]}"
        folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="celery-leases-"))
        self.log_path = folder / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._terminating = False

    def __repr__(self) -> str:
        state = "not started" if self.process is None else f"pid {self.process.pid}"
        return f"<{type(self).__name__} {self.name} -A {self.app_module} ({state})>"

    def args(self) -> list[str]:
        """The command-line arguments after ``celery -A <app_module>``."""
        return [self.command_name, "-l", self.loglevel, *self.extra_args]

    def command(self) -> list[str]:
        return [sys.executable, "-m", "celery", "-A", self.app_module, *self.args()]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(REPO_ROOT), str(TESTS_DIR)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        return env

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self: P, timeout: float = 30) -> P:
        """Start the process and wait until its log says it is ready (seconds)."""
        if self.process is not None:
            raise RuntimeError(f"{self!r} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.cwd,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _live.add(self)
        try:
            self.wait_for_log(self.ready_pattern, timeout=timeout)
        except BaseException:
            self.stop(timeout=5)
            raise
        return self

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self!r} is not started")
        return self.process.pid

    def is_alive(self) -> bool:
        """True while the main process has not exited (a stopped or zombie process counts)."""
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit status once reaped: negative signal number when killed by a signal."""
        return None if self.process is None else self.process.poll()

    def children(self) -> list[int]:
        """Pids of the main process's direct children (the prefork pool processes)."""
        return children_of(self.pid)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the main process only."""
        os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the main process (prefork children die with it: PR_SET_PDEATHSIG)."""
        self.signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        """Wait for the main process to exit (seconds); returns its exit status."""
        assert self.process is not None
        return self.process.wait(timeout)

    def terminate(self) -> None:
        """Ask for a warm shutdown: SIGCONT (a stopped process would not act), then SIGTERM."""
        if self.is_alive() and not self._terminating:
            self._terminating = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)

    def stop(self, timeout: float = 10) -> int | None:
        """SIGTERM (warm shutdown), SIGKILL after ``timeout`` seconds, reap; kill leftovers.

        Returns the exit status (negative signal number if killed), None if never started.
        """
        if self.process is None:
            return None
        try:
            if self.process.poll() is None:
                self.terminate()
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.process.pid, signal.SIGKILL)
                    self.process.wait(10)
        finally:
            # Pool children or anything else left in the process's own session.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            _live.discard(self)
        return self.process.returncode

    def __enter__(self: P) -> P:
        if self.process is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- log -------------------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_for_log(
        self, pattern: str | re.Pattern[str], *, timeout: float = 30, start: int = 0
    ) -> re.Match[str]:
        """Wait until the log (from character ``start``) matches ``pattern``; return the match.

        Raises RuntimeError with the end of the log if the process exits or ``timeout`` seconds
        pass first.
        """
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.log_text(), start)
            if match:
                return match
            if not self.is_alive():
                problem = f"exited with status {self.returncode}"
            elif time.monotonic() > deadline:
                problem = f"did not log {regex.pattern!r} within {timeout} s"
            else:
                time.sleep(0.05)
                continue
            raise RuntimeError(f"{self!r} {problem}. Log {self.log_path}:\n{self.log_tail()}")


class Worker(CeleryProcess):
    """``celery -A <app_module> worker -l info -n <hostname> -P <pool> -c <concurrency> ...``.

    ``hostname`` defaults to a unique ``<name>@%h``. ``queues`` is passed as ``-Q``.
    ``fast_start`` adds ``--without-mingle --without-gossip`` (saves ~1 s a start; pass False
    when a test depends on workers syncing revoked ids at startup).
    """

    command_name = "worker"
    ready_pattern = re.compile(r"\S+@\S+ ready\.")

    def __init__(
        self,
        app_module: str,
        *,
        env: Mapping[str, str] | None = None,
        pool: str = "prefork",
        concurrency: int = 1,
        queues: Iterable[str] | None = None,
        hostname: str | None = None,
        fast_start: bool = True,
        loglevel: str = "info",
        extra_args: Iterable[str] = (),
        cwd: str | os.PathLike[str] = REPO_ROOT,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(
            app_module, env=env, loglevel=loglevel, extra_args=extra_args, cwd=cwd, log_dir=log_dir
        )
        self.pool = pool
        self.concurrency = concurrency
        self.queues = list(queues) if queues is not None else None
        self.hostname = hostname or f"{self.name}@%h"
        self.fast_start = fast_start

    def args(self) -> list[str]:
        args = ["worker", "-l", self.loglevel, "-n", self.hostname]
        args += ["-P", self.pool, "-c", str(self.concurrency)]
        if self.queues:
            args += ["-Q", ",".join(self.queues)]
        if self.fast_start:
            args += ["--without-mingle", "--without-gossip"]
        return [*args, *self.extra_args]


class Beat(CeleryProcess):
    """``celery -A <app_module> beat -l info -s <schedule_path> ...``.

    ``schedule_path`` defaults to a file next to the log (never the working directory);
    ``max_interval`` (seconds) bounds beat's sleep between schedule checks.
    """

    command_name = "beat"
    ready_pattern = re.compile(r"beat: Starting\.\.\.")

    def __init__(
        self,
        app_module: str,
        *,
        env: Mapping[str, str] | None = None,
        schedule_path: str | os.PathLike[str] | None = None,
        max_interval: float | None = None,
        loglevel: str = "info",
        extra_args: Iterable[str] = (),
        cwd: str | os.PathLike[str] = REPO_ROOT,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(
            app_module, env=env, loglevel=loglevel, extra_args=extra_args, cwd=cwd, log_dir=log_dir
        )
        self.schedule_path = (
            Path(schedule_path) if schedule_path else self.log_path.with_suffix(".schedule")
        )
        self.max_interval = max_interval

    def args(self) -> list[str]:
        args = ["beat", "-l", self.loglevel, "-s", str(self.schedule_path)]
        if self.max_interval is not None:
            args += ["--max-interval", str(self.max_interval)]
        return [*args, *self.extra_args]


def children_of(pid: int) -> list[int]:
    """Pids of the direct children of ``pid``, read from /proc (no psutil)."""
    task_dir = Path(f"/proc/{pid}/task")
    try:
        files = list(task_dir.glob("*/children"))
    except OSError:
        return []
    if files:
        children: set[int] = set()
        for file in files:
            with contextlib.suppress(OSError):
                children.update(int(child) for child in file.read_text().split())
        return sorted(children)
    # Kernels without CONFIG_PROC_CHILDREN: scan every process's parent pid.
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name (field 2) may hold spaces and parentheses: split after its ")".
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def pid_exists(pid: int) -> bool:
    """True if ``pid`` is a live process (zombies, which are dead but unreaped, count as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_live):
        with contextlib.suppress(Exception):
            process.stop(timeout=1)


#: The spawners of processes a test shares with others (a module's bed of workers): a failed
#: test's report shows the end of each one's log too (tests/conftest.py). Append to
#: ``item.stash.setdefault(SHARED_LOGS, [])``.
SHARED_LOGS = pytest.StashKey[list["Spawner"]]()


class Spawner:
    """Makes Worker and Beat processes that log under ``log_dir`` and remembers them all, so
    ``stop_all()`` can stop every one (what the ``spawn`` fixture does at teardown)."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self.processes: list[CeleryProcess] = []

    def worker(
        self, app_module: str, *, start: bool = True, timeout: float = 30, **options: Any
    ) -> Worker:
        """A Worker (same options), started unless ``start=False``; ``timeout`` in seconds."""
        worker = Worker(app_module, log_dir=self.log_dir, **options)
        self.processes.append(worker)
        if start:
            worker.start(timeout=timeout)
        return worker

    def beat(
        self, app_module: str, *, start: bool = True, timeout: float = 30, **options: Any
    ) -> Beat:
        """A Beat (same options), started unless ``start=False``; ``timeout`` in seconds."""
        beat = Beat(app_module, log_dir=self.log_dir, **options)
        self.processes.append(beat)
        if start:
            beat.start(timeout=timeout)
        return beat

    def stop_all(self, timeout: float = 2) -> None:
        """Stop every process: SIGTERM to all at once, SIGKILL what is left after ``timeout``
        seconds."""
        for process in self.processes:
            process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.stop(timeout=max(0.0, deadline - time.monotonic()))
