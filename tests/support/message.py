"""Task messages for tests that call the store directly, as a client would publish them."""

from __future__ import annotations

import uuid
from typing import Any

from celery_leases.message import Message


def job_message(
    job_id: str,
    task: str = "tests.job",
    *,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    recorded: bool = True,
    routing_key: str = "celery",
    **headers: Any,
) -> Message:
    """The protocol-2 message of ``task`` with id ``job_id`` on the default exchange.

    ``recorded``: it carries a version id, as every message celery-leases records does;
    False gives a message sent by name from elsewhere (no version).
    """
    found: dict[str, Any] = {
        "lang": "py",
        "task": task,
        "id": job_id,
        "root_id": job_id,
        "parent_id": None,
        "retries": 0,
        "replaced_task_nesting": 0,
        **headers,
    }
    message = Message(
        headers=found,
        args=list(args),
        kwargs=dict(kwargs or {}),
        properties={"correlation_id": job_id},
        exchange="",
        routing_key=routing_key,
    )
    if recorded and "leases_message_id" not in headers:
        message = message.with_headers(leases_message_id=uuid.uuid4().hex)
    return message
