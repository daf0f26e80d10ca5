"""Publishing a recorded job again: the reaper, the hand-off, the redelivery and the CLI.

A job sent again goes straight to ``app.send_task`` with its recorded id, so it is published
without being recorded a second time.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

ROUTING_OPTIONS = ("queue", "exchange", "routing_key", "priority")
#: Header counting the deliveries sent again while the leases database was down.
DB_RETRY_HEADER = "leases_db_retries"


def dumps(value: Any) -> str:
    """JSON text of ``value``; NaN and Infinity are refused (they are not JSON)."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def safe_dumps(value: Any) -> str | None:
    """JSON text of ``value``, or None when it is not JSON."""
    try:
        return dumps(value)
    except (TypeError, ValueError):
        return None


def routing(request: Any) -> dict[str, Any]:
    """The routing the current message came with, to publish it (or its job) there again."""
    info = request.delivery_info or {}
    found = {
        "queue": info.get("routing_key"),
        "exchange": info.get("exchange"),
        "priority": info.get("priority"),
    }
    return {k: v for k, v in found.items() if v not in (None, "")}


def countdown(options: dict[str, Any]) -> float | None:
    """Seconds until an ``apply_async`` call's ``countdown`` or ``eta``; None for neither."""
    seconds = options.get("countdown")
    if seconds:
        return float(seconds)
    eta = options.get("eta")
    if eta is not None:
        moment = eta if eta.tzinfo else eta.replace(tzinfo=timezone.utc)
        return float(max(0.0, (moment - datetime.now(timezone.utc)).total_seconds()))
    return None


def send(
    app: Any,
    task: str,
    job_id: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    **extra: Any,
) -> None:
    """Publish job ``job_id`` of ``task`` again, with its routing ``options``."""
    chosen = {k: v for k, v in (options or {}).items() if k in ROUTING_OPTIONS}
    app.send_task(task, args=args, kwargs=kwargs, task_id=job_id, **chosen, **extra)


def republish(app: Any, job: Any) -> None:
    """Publish a recorded job again, with its id, arguments and routing (no new row)."""
    send(app, job.task, job.id, job.args, job.kwargs, job.options)
