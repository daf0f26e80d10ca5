"""The example Django project (examples/django_project) on a database of its own.

``shop`` is that project migrated (``manage.py migrate``) on a fresh database of each kind
(SQLite, PostgreSQL, MariaDB), once per test session: tests keep apart by their own batch names
and job ids. ``Shop.run(name, **args)`` runs a scenario of ``tests.django.scenario`` inside the
project (a Django process of its own, since a process can set Django up once) and returns what
it reports; ``Shop.manage(...)`` runs ``manage.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases.db.store import Store
from tests.support.cli import store_of
from tests.support.service import require
from tests.support.worker import REPO_ROOT

PROJECT = REPO_ROOT / "examples" / "django_project"
TABLE = "shop_leases"


@dataclass
class Shop:
    """The example project on one database."""

    kind: str
    env: dict[str, str]
    #: SQLAlchemy URL of the project's database (where the leases live too).
    url: str
    _store: Store | None = field(default=None, repr=False)

    def environment(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "SHOP_"))}
        paths = [str(PROJECT), str(REPO_ROOT)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["DJANGO_SETTINGS_MODULE"] = "shop.settings"
        return env | self.env | extra

    def manage(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        done = self.try_manage(*args, **extra)
        assert done.returncode == 0, f"manage.py {' '.join(args)}: {done.stderr}"
        return done

    def try_manage(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        """``manage.py args``, whatever its exit code (``extra``: environment variables)."""
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=PROJECT,
            env=self.environment(**extra),
            capture_output=True,
            text=True,
            timeout=180,
        )

    def run(
        self,
        scenario: str,
        *,
        env: dict[str, str] | None = None,
        timeout: float = 180,
        **args: Any,
    ) -> Any:
        """Run ``tests.django.scenario.<scenario>(**args)`` in the project (with the
        environment variables ``env`` added, in ``timeout`` seconds at most); what it
        returns."""
        done = subprocess.run(
            [sys.executable, "-m", "tests.django.scenario", scenario, json.dumps(args)],
            cwd=PROJECT,
            env=self.environment(CELERY_BROKER_URL="memory://", **(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"scenario {scenario}: {done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    @property
    def store(self) -> Store:
        """The leases store, as the test process reaches it (SQLAlchemy, not Django)."""
        if self._store is None:
            self._store = store_of({"leases_database_url": self.url, "leases_table": TABLE})
        return self._store

    def invoices(self, batch: str) -> list[tuple[int, int, int]]:
        """(number, attempt, token) of every invoice of ``batch``, by id."""
        with self.store.engine.connect() as connection:
            rows = connection.execute(
                sa.text(
                    "SELECT number, attempt, token FROM billing_invoice "
                    "WHERE batch = :b ORDER BY id"
                ),
                {"b": batch},
            ).all()
        return [tuple(r) for r in rows]  # type: ignore[misc]


def sqlite_shop(tmp_path: Path, **env: str) -> Shop:
    """The example project on a fresh SQLite file of ``tmp_path`` (not migrated), with the
    environment variables ``env`` added."""
    path = tmp_path / "shop.sqlite3"
    base = {"SHOP_DATABASE": "sqlite", "SHOP_DB_NAME": str(path)}
    return Shop(
        "sqlite", base | {"SHOP_LEASES_TABLE": TABLE, "SHOP_DEBUG": "0"} | env, f"sqlite:///{path}"
    )


@pytest.fixture(scope="session", params=["sqlite", "postgres", "mariadb"])
def shop(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Shop]:
    """The example project, migrated, on a fresh database of this kind."""
    kind = request.param
    name = f"shop_{uuid.uuid4().hex[:8]}"
    env = {"SHOP_DATABASE": kind, "SHOP_LEASES_TABLE": TABLE, "SHOP_DEBUG": "0"}
    server: str | None = None
    if kind == "sqlite":
        path = tmp_path_factory.mktemp("shop") / "shop.sqlite3"
        env["SHOP_DB_NAME"] = str(path)
        url = f"sqlite:///{path}"
    else:
        server = require(kind)
        _create_database(server, name)
        env["SHOP_DB_NAME"] = name
        url = sa.engine.make_url(server).set(database=name).render_as_string(False)
    shop = Shop(kind, env, url)
    try:
        shop.manage("migrate", "--verbosity", "0")
        yield shop
    finally:
        if shop._store is not None:
            shop._store.engine.dispose()
        if server is not None:
            _drop_database(server, name)


def _create_database(server: str, name: str) -> None:
    engine = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(sa.text(f"CREATE DATABASE {name}"))
    finally:
        engine.dispose()


def _drop_database(server: str, name: str) -> None:
    engine = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            force = " WITH (FORCE)" if engine.dialect.name == "postgresql" else ""
            connection.execute(sa.text(f"DROP DATABASE IF EXISTS {name}{force}"))
    finally:
        engine.dispose()
