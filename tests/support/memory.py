"""Apps for tests that run in this process: broker and result backend in memory."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from celery import Celery


def memory_app(name: str, database_url: str, table_name: str, **conf: Any) -> Celery:
    """An app whose broker and result backend live in this process (``memory://``,
    ``cache+memory://``), its leases in ``table_name`` of ``database_url``, and its default
    queue named for the table (memory:// queues live as long as this process); ``conf`` is
    set over that."""
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        leases_database_url=database_url,
        leases_table=table_name,
        task_default_queue=table_name,
        **conf,
    )
    return app


@contextlib.contextmanager
def three_databases(tmp_path: Path, prefix: str) -> Iterator[dict[str, str]]:
    """A leases table named ``<prefix><hex>`` (key ``table``), migrated in an SQLite file of
    ``tmp_path`` (``default``), the test PostgreSQL (``pg``) and MariaDB (``maria``): the
    databases of a routed app; the server ones dropped after."""
    from tests.support.cli import migrate_table
    from tests.support.service import drop_tables, require

    table = f"{prefix}{uuid.uuid4().hex[:8]}"
    urls = {
        "default": f"sqlite:///{tmp_path}/leases.sqlite3",
        "pg": require("postgres"),
        "maria": require("mariadb"),
    }
    for url in urls.values():
        migrate_table(url, table)
    try:
        yield {"table": table, **urls}
    finally:
        for name in ("pg", "maria"):
            drop_tables(urls[name], table)


def close_routed(app: Celery) -> None:
    """Stop the keepers of every leases database of ``app``, dispose of their engines and
    close the app."""
    from celery_leases import routes
    from celery_leases.config import settings_for
    from celery_leases.worker.keeper import all_keepers

    stores = [store for _, store in routes.stores(settings_for(app))]
    for keeper in all_keepers():
        if keeper.store in stores:
            keeper.stop()
            keeper.join(timeout=5)
    for store in stores:
        store.engine.dispose()
    app.close()
