"""Apps for tests that run in this process: broker and result backend in memory."""

from __future__ import annotations

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
