"""What a real worker and beat say, or refuse, at start: where the leases live, and the
defaults that bite (``celery_leases.worker.startup``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.apps.factory import app_env
from tests.support.worker import Spawner

pytestmark = pytest.mark.e2e

LEASED_APP = "tests.support.apps.leased_app"


def test_a_worker_with_a_mistyped_setting_does_not_start_and_says_which(
    spawn: Spawner, filesystem_broker: dict[str, Any], tmp_path: Path
) -> None:
    env = app_env(
        broker_url="filesystem://",
        extra={**filesystem_broker, "leases_databse_url": f"sqlite:///{tmp_path}/meant.sqlite3"},
    )
    worker = spawn.worker(LEASED_APP, env=env, start=False, cwd=tmp_path)

    with pytest.raises(RuntimeError, match="exited with status 1"):
        worker.start(timeout=60)

    assert (
        "does not start: unknown setting leases_databse_url (did you mean leases_database_url?)"
        in worker.log_text()
    )
    assert not (tmp_path / "celery_leases.sqlite3").exists()


def test_a_worker_says_where_the_leases_live(
    spawn: Spawner, filesystem_broker: dict[str, Any], database_url: str, table_name: str
) -> None:
    env = app_env(database_url=database_url, table=table_name, extra=filesystem_broker)

    worker = spawn.worker(LEASED_APP, env=env)

    found = worker.wait_for_log(r"celery-leases: worker \S+: leases live in (.*)")
    place = found.group(1)
    assert place.endswith(f", table {table_name}")
    if database_url.startswith("sqlite"):
        assert place.startswith(f"the SQLite file {database_url.removeprefix('sqlite:///')}")
    else:
        assert place.startswith(database_url.split("://")[0] + "://")
    assert "WARNING" not in worker.log_text().split("leases live in")[1].split("\n")[0]


def test_the_default_sqlite_file_with_a_network_broker_is_warned_about_naming_its_path(
    spawn: Spawner, celery_settings: dict[str, Any], tmp_path: Path
) -> None:
    env = app_env(extra=celery_settings)  # no leases_database_url: the default file

    worker = spawn.worker(LEASED_APP, env=env, cwd=tmp_path)
    beat = spawn.beat(LEASED_APP, env=env | {"E2E_REAPER_EVERY": "5"}, cwd=tmp_path)

    default = os.path.join(tmp_path, "celery_leases.sqlite3")
    for process in (worker, beat):
        process.wait_for_log(
            re.escape(
                f"leases_database_url is not set, so the leases live in the default "
                f"SQLite file {default}"
            )
        )
    assert f"celery-leases: beat: leases live in the SQLite file {default}" in beat.log_text()


def test_a_worker_on_the_filesystem_broker_and_the_default_file_gives_no_warning(
    spawn: Spawner, filesystem_broker: dict[str, Any], tmp_path: Path
) -> None:
    worker = spawn.worker(LEASED_APP, env=app_env(extra=filesystem_broker), cwd=tmp_path)

    worker.wait_for_log(r"celery-leases: worker \S+: leases live in the SQLite file")
    assert "leases_database_url is not set" not in worker.log_text()
