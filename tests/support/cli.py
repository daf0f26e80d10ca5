"""The ``celery leases`` command, and jobs made for it through the store.

``Cli(settings)`` runs ``celery -A tests.support.apps.cli_app leases ...`` with ``settings``
(``leases_settings`` builds them): Celery's own ``celery`` command, in this process (click's
runner: the exit code, stdout and stderr as a process would give them, ~0.02 s a call instead
of a fresh interpreter's ~1 s of CPU), or as a real subprocess (``process=True``; always on a
terminal and without ``-A``). ``record`` and ``claim`` make ``cli.count`` jobs.
"""

from __future__ import annotations

import logging
import os
import pty
import subprocess
import sys
import traceback
import uuid
from typing import Any

from celery_leases.db import migrations
from celery_leases.db.rows import Refused
from celery_leases.db.store import Store
from celery_leases.message import Message
from celery_leases.settings import DEFAULTS, validate
from tests.support.message import job_message
from tests.support.service import celery_env, close_app
from tests.support.worker import REPO_ROOT

APP = "tests.support.apps.cli_app"
#: Seconds without a checkpoint after which the test app's running jobs count as stalled.
STALL_TIMEOUT = 300.0


#: Variables the command must not see from the test run's environment.
_UNSET = ("APP", "CELERY_APP", "NO_COLOR")


class Cli:
    """Runs ``celery -A tests.support.apps.cli_app leases ...`` with the test's settings: in
    this process, or as a subprocess when ``process`` is true (or ``app`` is not the test app).
    """

    def __init__(self, settings: dict[str, Any], *, process: bool = False) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _UNSET}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["COLUMNS"] = "100"
        env.update(celery_env(settings))
        self.env = env
        self.changes = {"COLUMNS": "100", **celery_env(settings)}
        self.process = process

    def command(self, args: tuple[str, ...], app: str | None) -> list[str]:
        return [sys.executable, "-m", "celery", *(["-A", app] if app else []), "leases", *args]

    def __call__(self, *args: str, app: str | None = APP) -> subprocess.CompletedProcess[str]:
        if not self.process and app == APP:
            return self.here(args)
        return subprocess.run(
            self.command(args, app),
            cwd=REPO_ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def here(self, args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        """``celery -A <APP> leases <args>`` through Celery's own click command in this
        process. The app module is imported anew with this test's settings; what the command
        logs at WARNING or above goes to its stderr, as Python's last-resort handler writes it
        in a process of its own; the app and the stores it opened are closed after."""
        from celery import _state
        from celery.bin.celery import celery as celery_command
        from click.testing import CliRunner

        from celery_leases.db import store as store_module

        _forget_app_module()
        current = _state._tls.current_app
        stores_before = set(store_module._stores)
        runner = CliRunner()
        handler = _StderrHandler()
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            result = runner.invoke(
                celery_command,
                ["-A", APP, "leases", *args],
                env={**dict.fromkeys(_UNSET), **self.changes},
                prog_name="celery",
            )
        finally:
            root.removeHandler(handler)
            module = _forget_app_module()
            if module is not None:
                close_app(module.app)
            _state._set_current_app(current)
            for key in set(store_module._stores) - stores_before:
                store_module._stores.pop(key).engine.dispose()
        stderr = result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            stderr += "".join(traceback.format_exception(result.exception))
        command = ["celery", "-A", APP, "leases", *args]
        return subprocess.CompletedProcess(command, result.exit_code, result.stdout, stderr)

    def on_a_terminal(self, *args: str) -> str:
        """What the command writes to stdout when stdout is a terminal (a pseudo-terminal)."""
        main, child = pty.openpty()
        try:
            process = subprocess.Popen(
                self.command(args, APP), cwd=REPO_ROOT, env=self.env, stdout=child
            )
        finally:
            os.close(child)
        chunks = []
        try:
            while data := os.read(main, 65536):
                chunks.append(data)
        except OSError:  # Linux: EIO once the child closed the terminal
            pass
        finally:
            os.close(main)
        assert process.wait(timeout=60) == 0
        return b"".join(chunks).decode()

    def ok(self, *args: str) -> str:
        result = self(*args)
        assert result.returncode == 0, f"{args} exited {result.returncode}: {result.stderr}"
        return result.stdout


def _forget_app_module() -> Any:
    """Remove the app module from ``sys.modules`` and from its package (Celery's ``-A`` finds
    it as the package's attribute first), so the next import builds its app anew from the
    environment of the moment; the module removed, if it was there."""
    package, _, name = APP.rpartition(".")
    parent = sys.modules.get(package)
    if parent is not None and hasattr(parent, name):
        delattr(parent, name)
    return sys.modules.pop(APP, None)


class _StderrHandler(logging.Handler):
    """Python's last-resort handler (WARNING and above, the message alone, to the stderr of
    the moment): what a ``celery leases`` process writes for a record it logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(self.format(record) + "\n")


def leases_settings(url: str, table: str, broker: dict[str, Any]) -> dict[str, Any]:
    return {
        **broker,
        "leases_database_url": url,
        "leases_table": table,
        "leases_stall_timeout": STALL_TIMEOUT,
    }


def store_of(settings: dict[str, Any]) -> Store:
    raw = {**DEFAULTS, **{k.removeprefix("leases_"): v for k, v in settings.items()}}
    return Store(validate({k: raw[k] for k in DEFAULTS}))


def migrate_table(url: str, table: str) -> None:
    """Create (or upgrade) the jobs table ``table`` in ``url`` with the migrations, as
    ``celery -A proj leases init-db`` does."""
    store = store_of({"leases_database_url": url, "leases_table": table})
    try:
        migrations.upgrade(store)
    finally:
        store.engine.dispose()


def record(store: Store, *, task: str = "cli.count", n: int = 5) -> str:
    job_id = str(uuid.uuid4())
    store.register(job_message(job_id, task, args=[n], kwargs={"pause": 0.0}))
    return job_id


def claim(store: Store, job_id: str, owner: str = "celery@w1/100") -> int:
    claimed = store.claim(recorded(store, job_id), owner=owner, duration=300.0)
    assert not isinstance(claimed, Refused)
    return claimed.token


def recorded(store: Store, job_id: str) -> Message:
    """The job's recorded message: what a worker receives for it."""
    job = store.get(job_id)
    assert job is not None
    return job.message
