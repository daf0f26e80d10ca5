"""pytest fixtures for testing your own leased tasks: a leased worker and a crash helper.

Loaded by pytest through the ``pytest11`` entry point once celery-leases is installed (or
``pytest_plugins = ["celery_leases.pytest_plugin"]`` in your ``conftest.py``). Point it at your
app, then ask for the fixtures::

    @pytest.fixture
    def leases_app():
        from proj.celery import app
        return app

    def test_import_survives_a_crash(leased_worker, leases_crash):
        leases_crash.after_checkpoint(import_rows, 2)  # the next attempt dies after 2
        result = import_rows.delay(list(range(5)))
        assert result.get(timeout=30) == 5             # resumed from its checkpoint
        assert leases_crash.job(result.id).attempts == 2

Fixtures (override any of them in your ``conftest.py``):

- ``leases_app``: your Celery app (default: an empty app, for tasks defined in the test);
- ``leases_database_url``: the leases database (default: Django's test database in a Django
  project with ``celery_leases.contrib.django`` installed, pytest-django's; elsewhere an
  SQLite file of the test's own);
- ``leases_config``: the settings the test runs with (default: that database, an in-memory
  broker and result backend, 5 s leases);
- ``leased_app``: ``leases_app`` with ``leases_config`` applied, put back as it was after the
  test (settings are re-read when the configuration changes, so a task used before sees the
  test's database; the app's result backend and broker connections, which Celery builds once
  and keeps, are built again from the test's configuration, and from yours after it);
- ``leased_worker``: a real Celery worker running in this process (a thread: Celery's
  ``celery.contrib.testing.worker.start_worker``, threads pool, 2 processes' worth of slots);
- ``leases_crash``: a :class:`Crash` helper: make the next attempt of a task die after its Nth
  checkpoint (as a killed process would: it keeps its lease) and, by default, resume it at
  once through the reaper; expire leases, run the reaper, read jobs; and
  ``run``/``assert_resumable`` from :mod:`celery_leases.testing`, without a worker.

Celery's own in-process worker is used directly: pytest-celery 1.x replaces the classic
``celery_worker`` fixture with one that starts Docker containers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import lifecycle
from .config import reread_settings, settings_for
from .control import migrate
from .db import Store, store_for
from .db.rows import Job
from .lease import Lease
from .reaper import ReapReport, reap
from .signals import checkpoint_saved
from .testing import CrashRun, SimulatedCrash, assert_resumable, run_with_crashes

__all__ = ["Crash"]


class Crash:
    """Crash leased tasks in a test, and watch them resume (the ``leases_crash`` fixture)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._armed: list[tuple[str, int, bool]] = []  # (task name, after N, resume)
        self._saved: dict[tuple[str, int], int] = {}
        self._resumers: list[threading.Thread] = []
        checkpoint_saved.connect(self._on_checkpoint, weak=False)

    @property
    def store(self) -> Store:
        return store_for(settings_for(self.app))

    def after_checkpoint(self, task: Any, checkpoints: int = 1, *, resume: bool = True) -> None:
        """The next attempt of ``task`` to save its ``checkpoints``-th checkpoint dies right
        after it (:class:`~celery_leases.testing.SimulatedCrash`), keeping its lease as a
        killed process would. With ``resume`` the lease then ends and one reaper pass runs,
        as when the holder's process is gone: the job is published again and resumes from
        that checkpoint on the worker. Without, it waits for :meth:`expire` and :meth:`reap`.
        Call it again to crash later attempts too."""
        self._armed.append((task.name, checkpoints, resume))

    def _on_checkpoint(self, sender: Any, lease: Lease, **_: Any) -> None:
        key = (lease.job_id, lease.token)
        saved = self._saved[key] = self._saved.get(key, 0) + 1
        for index, (name, after, resume) in enumerate(self._armed):
            if name == getattr(sender, "name", None) and saved == after:
                del self._armed[index]
                if resume and lease.joined_write:
                    # The checkpoint is in the task's transaction (Django's atomic()), which
                    # holds the job's row until the crash rolls it back: end the lease once
                    # it has, from another thread.
                    resumer = threading.Thread(target=self._resume, args=(lease.job_id,))
                    resumer.start()
                    self._resumers.append(resumer)
                elif resume:
                    # The new attempt may start before this one has unwound: the token fences
                    # this one off, as it would a process that is slow to die.
                    self._resume(lease.job_id)
                raise SimulatedCrash(f"simulated crash after checkpoint {saved}")

    def _resume(self, job_id: str) -> None:
        """End the job's lease and run one reaper pass, as after its holder's death."""
        self.expire(job_id)
        self.reap()

    def expire(self, job_id: str) -> bool:
        """End the job's lease now, as when its holder is gone; False if no lease held it."""
        return lifecycle.end_lease(self.store, job_id)

    def reap(self) -> ReapReport:
        """One reaper pass: expired jobs are published again, to resume on a worker."""
        return reap(self.app)

    def job(self, job_id: str) -> Job:
        """The job as recorded (``AssertionError`` if there is none)."""
        job = self.store.get(job_id)
        assert job is not None, f"no job {job_id} in the leases table"
        return job

    def run(self, task: Any, *args: Any, crash_after: Any = (1,), **kwargs: Any) -> CrashRun:
        """:func:`~celery_leases.testing.run_with_crashes`, in this process, no worker."""
        return run_with_crashes(task, args, kwargs, crash_after=crash_after)

    def assert_resumable(self, task: Any, *args: Any, **options: Any) -> CrashRun:
        """:func:`~celery_leases.testing.assert_resumable`."""
        return assert_resumable(task, args, **options)

    def close(self) -> None:
        checkpoint_saved.disconnect(self._on_checkpoint)
        for resumer in self._resumers:
            resumer.join()


@pytest.fixture
def leases_app() -> Any:
    """The app under test: override it to return yours."""
    from celery import Celery

    return Celery("celery_leases_test", set_as_current=False)


@pytest.fixture
def leases_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The leases database of the test: under pytest-django, in a project with
    ``celery_leases.contrib.django`` installed, Django's test database (set up first), where the
    leases table is migrated and a checkpoint joins the task's ``atomic()`` blocks; elsewhere
    (without pytest-django, or when ``CELERY_LEASES_DATABASE_URL`` keeps the leases out of
    Django's databases) an SQLite file of the test's own, never the project's own database."""
    url = _django_test_database(request)
    return url if url is not None else f"sqlite:///{tmp_path}/leases.sqlite3"


def _django_test_database(request: pytest.FixtureRequest) -> str | None:
    """The URL of Django's test database of the leases, or None without the Django app."""
    try:
        from .contrib.django import database
    except ImportError:  # no Django here
        return None
    try:
        if not database.installed():
            return None
    except Exception:  # Django's settings cannot load: not a Django test run
        return None
    from django.conf import settings

    if getattr(settings, database.django_key("database_url"), None):
        return None  # the leases live outside Django's databases: not in a test database
    if not request.config.pluginmanager.hasplugin("django"):
        return None  # no test database without pytest-django: never the project's own
    request.getfixturevalue("django_db_setup")  # pytest-django's test databases
    return database.url_for(database.alias())


@pytest.fixture
def leases_config(leases_database_url: str) -> dict[str, Any]:
    """Settings applied to the app for the test (override it to use your broker, say)."""
    return {
        "leases_database_url": leases_database_url,
        "leases_duration": 5.0,
        "broker_url": "memory://",
        # kombu's in-memory transport looks for messages once a second by default: a job the
        # reaper sends again after a crash would wait for it.
        "broker_transport_options": {"polling_interval": 0.01},
        "result_backend": "cache+memory://",
        "task_always_eager": False,
    }


@pytest.fixture
def leased_app(leases_app: Any, leases_config: dict[str, Any]) -> Iterator[Any]:
    """``leases_app`` configured with ``leases_config``; its configuration is put back after."""
    conf = leases_app.conf
    before = {key: conf.changes[key] for key in leases_config if key in conf.changes}
    conf.update(leases_config)
    reread_settings(leases_app)
    _rebuild_connections(leases_app)
    migrate(leases_app)  # the table, as `celery -A proj leases init-db` makes it
    try:
        yield leases_app
    finally:
        store = store_for(settings_for(leases_app))
        for key in leases_config:
            conf.changes.pop(key, None)
        conf.changes.update(before)
        reread_settings(leases_app)
        _rebuild_connections(leases_app)
        store.engine.dispose()


def _rebuild_connections(app: Any) -> None:
    """Make ``app`` build its result backend and broker connection pools again, from its
    configuration as it is now. Celery builds them at first use and keeps them: a test that
    used the app before (``task.apply``, or a publish to your real broker) would otherwise
    leave ``result.get()`` on the old backend (``DisabledBackend``: "No result backend is
    configured") and ``delay()`` on the old broker.

    The pools are only let go of, as Celery does after a fork: kombu keeps them in its cache,
    by broker, for whoever uses that broker next (closing one would make the next test using
    the same broker fail with "Acquire on closed pool")."""
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    app._backend_cache = None
    app._local = threading.local()  # the per-thread backend (and thread_oid)


@pytest.fixture
def leased_worker(leased_app: Any) -> Iterator[Any]:
    """A Celery worker running ``leased_app``'s tasks in this process (threads pool)."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(
        leased_app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=10
    ) as worker:
        yield worker
        _stop_soon(leased_app, worker)


def _stop_soon(app: Any, worker: Any) -> None:
    """Stop ``worker`` now rather than in up to 4 s: its loop (Celery's ``synloop``, for a
    broker with no event loop such as the in-memory one) waits 2 s for a message before it
    looks at the stop request, then once more before it stops. Two remote-control pings end
    both waits; without remote control (or with the broker gone) it stops as before."""
    from celery.worker import state

    state.should_terminate = 0
    try:
        for _ in range(2):
            app.control.broadcast("ping", destination=[worker.hostname], reply=False)
    except Exception:  # the worker stops all the same, only later
        return


@pytest.fixture
def leases_crash(leased_app: Any) -> Iterator[Crash]:
    """A :class:`Crash` helper for ``leased_app``."""
    crash = Crash(leased_app)
    try:
        yield crash
    finally:
        crash.close()
