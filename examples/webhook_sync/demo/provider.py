"""A stand-in for the provider's side of the webhooks: sign a notification and deliver it.

    WEBHOOK_SYNC_SECRET=... python -m examples.webhook_sync.demo.provider URL ACCOUNT [--id ID]

prints the receiver's answer. The demo and the tests deliver through :func:`deliver` (stdlib
only), with a bad secret or an old timestamp when they mean to.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
import uuid
from typing import Any

from ..signature import sign


def notification(account: str) -> bytes:
    """The body the provider sends when ``account`` has new events."""
    return json.dumps({"type": "events.created", "account": account}).encode()


def new_delivery_id() -> str:
    return f"dlv_{uuid.uuid4().hex[:12]}"


def deliver(
    url: str,
    account: str,
    *,
    secret: str,
    delivery_id: str | None = None,
    timestamp: int | None = None,
    body: bytes | None = None,
    timeout: float = 10.0,
) -> tuple[int, Any]:
    """POST a signed notification for ``account`` (or ``body``) to ``url``: the HTTP status
    and the JSON answer. ``delivery_id`` defaults to a new one; ``timestamp`` (epoch seconds)
    to now."""
    body = notification(account) if body is None else body
    delivery_id = delivery_id or new_delivery_id()
    headers = {"Content-Type": "application/json"}
    headers |= sign(body, secret=secret, delivery_id=delivery_id, timestamp=timestamp)
    return post(url, body, headers, timeout=timeout)


def post(
    url: str, body: bytes, headers: dict[str, str], *, timeout: float = 10.0
) -> tuple[int, Any]:
    """POST ``body`` with ``headers``: the status and the JSON answer (None if not JSON)."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, _json(answer.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, _json(exc.read())


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the receiver, e.g. http://127.0.0.1:8766/webhooks")
    parser.add_argument("account")
    parser.add_argument("--id", help="delivery id (default: a new one; repeat one to retry it)")
    args = parser.parse_args(argv)
    secret = os.environ.get("WEBHOOK_SYNC_SECRET", "")
    if not secret:
        parser.exit(2, "provider: set WEBHOOK_SYNC_SECRET (the receiver's secret)\n")
    status, answer = deliver(args.url, args.account, secret=secret, delivery_id=args.id)
    print(status, json.dumps(answer))


if __name__ == "__main__":
    main()
