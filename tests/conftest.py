"""Shared fixtures: real databases, real brokers, real worker processes.

- ``database_url`` (sqlite | postgres | mariadb) and ``table_name`` (pass it as the
  ``leases_table`` setting): the jobs table, created by the migrations before the test
  (nothing creates it at first use) and dropped at teardown; ``fresh_table_name`` is a
  name of the test's own with no table yet.
- ``broker_url`` (redis | rabbitmq), ``queue_name`` (pass it as ``task_default_queue``),
  ``celery_settings`` (both of those plus a private remote-control exchange), and
  ``filesystem_broker`` (settings for kombu's ``filesystem://`` transport, no server needed).
- ``spawn``: start real ``celery worker`` / ``celery beat`` subprocesses, all killed at teardown.
- ``sqlite_settings``: settings of the ``celery leases`` command on a fresh SQLite file and the
  ``filesystem://`` broker (``tests.support.cli``).

An unreachable PostgreSQL, MariaDB, Redis or RabbitMQ skips the test, or fails it when CI=true.

Parallel runs (``make test``: pytest-xdist, ``--dist loadgroup``): every fixture above is private
to its test (uuid-named tables and queues, a claimed Redis database, ``tmp_path``), so tests
run in any worker. Tests that share a module- or session-scoped fixture of this suite (a bed of
workers, the Django project) are kept together on one xdist worker, one group per instance of
that fixture (:func:`pytest_collection_modifyitems`), so each instance is made once. A test
marked ``exclusive`` (it restarts a shared service) runs after the others, alone.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.cli import leases_settings, migrate_table
from tests.support.service import (
    delete_rabbitmq_entities,
    drop_tables,
    private_redis_url,
    require,
)
from tests.support.worker import SHARED_LOGS, CeleryProcess, Spawner

_spawners = pytest.StashKey[Spawner]()


def _stop_spawned(node: pytest.Item) -> None:
    """Stop the test's worker/beat processes before cleaning up what they use."""
    spawner = node.stash.get(_spawners, None)
    if spawner is not None:
        spawner.stop_all()


# -- databases -----------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres", "mariadb"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLAlchemy URL of an empty-enough database: a fresh SQLite file, or the shared servers'
    ``test`` databases (use ``table_name`` so tests never collide there)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/leases.sqlite3"
    return require(request.param)


@pytest.fixture
def fresh_table_name(request: pytest.FixtureRequest, database_url: str) -> Iterator[str]:
    """A table name of this test's own (``leases_t_<8 hex>``), no table made yet; that table,
    and any table, view or function whose name starts with it plus ``_``, is dropped at
    teardown."""
    name = f"leases_t_{uuid.uuid4().hex[:8]}"
    yield name
    _stop_spawned(request.node)
    if database_url.startswith("sqlite"):
        return
    drop_tables(database_url, name)


@pytest.fixture
def table_name(database_url: str, fresh_table_name: str) -> str:
    """The name of this test's jobs table, created by the migrations (as
    ``celery -A proj leases init-db`` would) and dropped at teardown."""
    migrate_table(database_url, fresh_table_name)
    return fresh_table_name


# -- brokers -------------------------------------------------------------------------------------


@pytest.fixture
def queue_name() -> str:
    """A queue name of this test's own (``leases_q_<8 hex>``): set ``task_default_queue`` to it."""
    return f"leases_q_{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest, queue_name: str) -> Iterator[str]:
    """Broker URL. Redis: a database number no other test uses, flushed before and after.
    RabbitMQ: the shared vhost; ``queue_name`` and the exchanges named after it are deleted."""
    if request.param == "redis":
        with private_redis_url() as url:
            yield url
            _stop_spawned(request.node)
        return
    url = require("rabbitmq")
    yield url
    _stop_spawned(request.node)
    control = _control_exchange(queue_name)
    delete_rabbitmq_entities(
        url,
        queues=[queue_name],
        exchanges=[
            queue_name,
            f"{control}.pidbox",
            f"reply.{control}.pidbox",
            _event_exchange(queue_name),
        ],
    )


def _control_exchange(queue_name: str) -> str:
    return f"{queue_name}_control"


def _event_exchange(queue_name: str) -> str:
    return f"{queue_name}_events"


@pytest.fixture
def celery_settings(broker_url: str, queue_name: str) -> dict[str, Any]:
    """Celery settings for a test on ``broker_url``: its own queue, its own remote-control
    exchange (so ``inspect``/``control`` never reach another test's workers) and its own event
    exchange (so a monitor never sees another test's events: on RabbitMQ ``celeryev`` is the
    whole vhost's). Pass them to subprocesses with ``tests.support.service.celery_env``."""
    return {
        "broker_url": broker_url,
        "task_default_queue": queue_name,
        "control_exchange": _control_exchange(queue_name),
        "event_exchange": _event_exchange(queue_name),
        "broker_connection_retry_on_startup": True,
    }


@pytest.fixture
def filesystem_broker(tmp_path: Path) -> dict[str, Any]:
    """Celery settings for kombu's ``filesystem://`` transport in a folder under ``tmp_path``.

    ``data_folder_in == data_folder_out`` and every folder is on one filesystem, so kombu's
    moves are atomic renames. ``control_folder`` is set too: kombu's default is relative to the
    working directory.
    """
    root = tmp_path / "broker"
    folders = {name: root / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    return {
        "broker_url": "filesystem://",
        "broker_transport_options": {
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "store_processed": True,
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
        },
        "broker_connection_retry_on_startup": True,
    }


# -- the leases CLI ------------------------------------------------------------------------------


@pytest.fixture
def sqlite_settings(tmp_path: Path, filesystem_broker: dict[str, Any]) -> dict[str, Any]:
    url = f"sqlite:///{tmp_path}/leases.sqlite3"
    migrate_table(url, "leases_cli")
    return leases_settings(url, "leases_cli", filesystem_broker)


# -- processes -----------------------------------------------------------------------------------


@pytest.fixture
def spawn(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Spawner]:
    """Start real worker/beat subprocesses: ``spawn.worker(app_module, env=..., ...)``,
    ``spawn.beat(app_module, env=..., ...)``. Logs go under ``tmp_path/logs``; every process is
    stopped at teardown, and a failed test's report shows the end of each log."""
    spawner = Spawner(log_dir=tmp_path / "logs")
    request.node.stash[_spawners] = spawner
    yield spawner
    spawner.stop_all()


# -- the version matrix --------------------------------------------------------------------------

#: The distributions whose versions scripts/matrix.sh changes (pyproject.toml's floors, then the
#: newest releases), by import name.
VERSIONED = (
    "celery",
    "kombu",
    "billiard",
    "sqlalchemy",
    "alembic",
    "click",
    "django",
    "prometheus_client",
    "psycopg",
    "pymysql",
)
#: The fixtures through which a test reaches one of them: a database through SQLAlchemy,
#: Alembic and the database's driver; a broker through kombu and a Celery app; the Django
#: project; a fresh pytest loading celery-leases' plugin (``pytester``).
VERSIONED_FIXTURES = frozenset(
    {
        "database_url",
        "broker_url",
        "celery_settings",
        "filesystem_broker",
        "sqlite_settings",
        "shop",
        "pytester",
    }
)
#: Folders whose every test drives one: tests/django runs Django (in the example project's or
#: a fresh project's processes).
VERSIONED_FOLDERS = ("tests/django/",)


def touches_versioned(item: pytest.Item) -> bool:
    """Whether ``item`` can pass on one version of the dependencies and fail on another: it
    lives in one of ``VERSIONED_FOLDERS``, uses one of ``VERSIONED_FIXTURES``, or its module
    imports celery_leases (which drives them all) or one of ``VERSIONED``, or it is marked
    ``versions`` by hand (a test that imports what it checks inside its body). Such a test
    gets the marker ``versions``, which scripts/matrix.sh selects (with ``not e2e``); the
    others check the suite's own tools (the chaos checker, the services' check, the docs'
    samples) and run once, in ``make test``."""
    if item.get_closest_marker("versions") is not None:
        return True
    if item.nodeid.startswith(VERSIONED_FOLDERS):
        return True
    if VERSIONED_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return module is not None and imports_versioned(module)


@functools.cache
def imports_versioned(module: ModuleType) -> bool:
    """Whether ``module`` imported a module, class or function of celery_leases or of a
    ``VERSIONED`` distribution (at its top level)."""
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
        if isinstance(name, str) and name.partition(".")[0] in (*VERSIONED, "celery_leases"):
            return True
    return False


# -- parallel runs -------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test that uses a module- or session-scoped fixture of this suite with
    ``xdist_group``: one group per instance of that fixture (its module, its name, its
    parameter), so that under ``--dist loadgroup`` every instance is made in one xdist worker
    only and its tests run one after another there. Runs before xdist reads the marks."""
    for item in items:
        group = shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if touches_versioned(item) and item.get_closest_marker("versions") is None:
            item.add_marker(pytest.mark.versions)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker: write each grouped test's group (``xdist_group`` marks, joined) to
    a file beside the worker's temporary folder, for :class:`GroupScheduling` to read."""
    config = session.config
    if not hasattr(config, "workerinput") or config.getvalue("loadgroup") is not True:
        return
    groups = {
        item.nodeid: "_".join(sorted({str(m.args[0]) for m in item.iter_markers("xdist_group")}))
        for item in session.items
        if item.get_closest_marker("xdist_group") is not None
    }
    root = config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]
    worker = config.workerinput["workerid"]  # type: ignore[attr-defined]
    (root / f"xdist-groups-{worker}.json").write_text(json.dumps(groups))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by the groups the workers wrote (:class:`GroupScheduling`)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return GroupScheduling.make(config, log)


class GroupScheduling:
    """xdist's ``loadgroup`` scheduling, with each test's group read from the files the
    workers wrote at collection (:func:`pytest_collection_finish`) instead of a suffix of its
    node id: xdist 3.8 writes that suffix to a node attribute pytest 9.2 no longer reads, so
    its own grouping silently does nothing there (pytest-xdist issue 1386)."""

    @staticmethod
    def make(config: pytest.Config, log: Any) -> Any:
        from xdist.scheduler import LoadGroupScheduling

        root = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]

        class Scheduling(LoadGroupScheduling):  # type: ignore[misc]
            groups: dict[str, str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self.groups is None:
                    self.groups = {}
                    for path in sorted(root.glob("xdist-groups-*.json")):
                        self.groups.update(json.loads(path.read_text()))
                group = self.groups.get(nodeid)
                return f"group:{group}" if group else str(super()._split_scope(nodeid))

        return Scheduling(config, log)


def shared_fixture_group(item: pytest.Item) -> str | None:
    """``<module>:<fixture>:<param>`` (module scope) or ``<fixture>:<param>`` (session scope)
    for the first such fixture of this suite that ``item`` uses, else None. (No brackets:
    xdist reads a group name after the last ``@`` of a node id only when no ``]`` follows.)"""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name in item.fixturenames:  # type: ignore[attr-defined]
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.scope not in ("module", "package", "session"):
                continue
            if not getattr(fixturedef.func, "__module__", "").startswith("tests."):
                continue  # pytest's own (tmp_path_factory) or a plugin's
            param = f":{params[name]}" if name in params else ""
            owner = f"{item.module.__name__}:" if fixturedef.scope == "module" else ""  # type: ignore[attr-defined]
            return f"{owner}{name}{param}"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    spawners = [item.stash.get(_spawners, None), *item.stash.get(SHARED_LOGS, [])]
    if report.failed:
        for spawner in filter(None, spawners):
            for process in spawner.processes:
                report.sections.append((_log_title(process), process.log_tail(60)))
    return report


def _log_title(process: CeleryProcess) -> str:
    return f"{process.name} log (last lines of {process.log_path})"
