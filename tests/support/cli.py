"""The ``celery leases`` command run as a subprocess, and jobs made for it through the store.

``Cli(settings)`` runs ``python -m celery -A tests.support.apps.cli_app leases ...`` with
``settings`` (``leases_settings`` builds them); ``record`` and ``claim`` make ``cli.count`` jobs.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import uuid
from typing import Any

from celery_leases.db import migrations
from celery_leases.db.rows import Refused
from celery_leases.db.store import Store
from celery_leases.message import Message
from celery_leases.settings import DEFAULTS, validate
from tests.support.message import job_message
from tests.support.service import celery_env
from tests.support.worker import REPO_ROOT

APP = "tests.support.apps.cli_app"
#: Seconds without a checkpoint after which the test app's running jobs count as stalled.
STALL_TIMEOUT = 300.0


class Cli:
    """Runs ``python -m celery -A tests.support.apps.cli_app leases ...`` with the test's
    settings."""

    def __init__(self, settings: dict[str, Any]) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("APP", "CELERY_APP", "NO_COLOR")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["COLUMNS"] = "100"
        env.update(celery_env(settings))
        self.env = env

    def command(self, args: tuple[str, ...], app: str | None) -> list[str]:
        return [sys.executable, "-m", "celery", *(["-A", app] if app else []), "leases", *args]

    def __call__(self, *args: str, app: str | None = APP) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(args, app),
            cwd=REPO_ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

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
