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
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import leases_settings, migrate_table
from tests.support.service import (
    delete_rabbitmq_entities,
    drop_tables,
    private_redis_url,
    require,
)
from tests.support.worker import CeleryProcess, Spawner

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
        exchanges=[queue_name, f"{control}.pidbox", f"reply.{control}.pidbox"],
    )


def _control_exchange(queue_name: str) -> str:
    return f"{queue_name}_control"


@pytest.fixture
def celery_settings(broker_url: str, queue_name: str) -> dict[str, Any]:
    """Celery settings for a test on ``broker_url``: its own queue and its own remote-control
    exchange (so ``inspect``/``control`` never reach another test run's workers). Pass them
    to subprocesses with ``tests.support.service.celery_env``."""
    return {
        "broker_url": broker_url,
        "task_default_queue": queue_name,
        "control_exchange": _control_exchange(queue_name),
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    spawner = item.stash.get(_spawners, None)
    if spawner is not None and report.failed:
        for process in spawner.processes:
            report.sections.append((_log_title(process), process.log_tail(60)))
    return report


def _log_title(process: CeleryProcess) -> str:
    return f"{process.name} log (last lines of {process.log_path})"
