"""How a webhook delivery is signed, and checked: HMAC-SHA256 with a shared secret.

The provider sends two headers with the raw body (the scheme of Stripe's ``Stripe-Signature``,
with the delivery id signed too, as Standard Webhooks does)::

    Webhook-Id: dlv_5f3c9a0e2b7d4c11
    Webhook-Signature: t=1700000000,v1=<hex HMAC-SHA256 of "{t}.{id}." + body>

``t`` is the provider's clock (epoch seconds) when it signed. A receiver accepts a delivery
when one ``v1`` matches (compared in constant time; a provider rotating its secret sends one
per secret) and ``t`` is within ``tolerance`` seconds of its own clock, so a captured delivery
cannot be replayed later. The delivery id is signed because the receiver deduplicates by it:
unsigned, a replayer inside the tolerance could change it to get past the deduplication.

Stdlib only: the provider simulator (``provider.py``) and the receiver share this module.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time

ID_HEADER = "Webhook-Id"
SIGNATURE_HEADER = "Webhook-Signature"
#: Seconds a signature's timestamp may differ from the receiver's clock (5 minutes).
TOLERANCE_SECONDS = 300
#: What a delivery id may look like (the provider's; it is also a primary key here).
DELIVERY_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class BadSignature(Exception):
    """The delivery is not signed with the secret, or its signature is too old or too new."""


def signature(secret: str, timestamp: int, delivery_id: str, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``"{timestamp}.{delivery_id}." + body`` with ``secret``."""
    signed = f"{timestamp}.{delivery_id}.".encode() + body
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def sign(
    body: bytes, *, secret: str, delivery_id: str, timestamp: int | None = None
) -> dict[str, str]:
    """The headers a provider sends with ``body``: the delivery id and its signature, made at
    ``timestamp`` (epoch seconds; default now)."""
    t = int(time.time()) if timestamp is None else timestamp
    return {
        ID_HEADER: delivery_id,
        SIGNATURE_HEADER: f"t={t},v1={signature(secret, t, delivery_id, body)}",
    }


def verify(
    header: str | None,
    body: bytes,
    *,
    secret: str,
    delivery_id: str,
    tolerance: float = TOLERANCE_SECONDS,
    now: float | None = None,
) -> int:
    """Check the ``Webhook-Signature`` header of a delivery of ``body``: its timestamp, or
    :class:`BadSignature` saying why not (missing, malformed, no matching ``v1``, timestamp
    further than ``tolerance`` seconds from ``now``, default the clock)."""
    if not header:
        raise BadSignature(f"no {SIGNATURE_HEADER} header")
    timestamps, candidates = [], []
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        if name == "t":
            timestamps.append(value)
        elif name == "v1":
            candidates.append(value)
    if len(timestamps) != 1 or not timestamps[0].isdigit() or len(timestamps[0]) > 12:
        raise BadSignature(f"{SIGNATURE_HEADER} has no timestamp t=<epoch seconds>")
    if not candidates:
        raise BadSignature(f"{SIGNATURE_HEADER} has no v1= signature")
    timestamp = int(timestamps[0])
    expected = signature(secret, timestamp, delivery_id, body).encode()
    # Every candidate is compared, each in constant time (as bytes: compare_digest refuses
    # a str that is not ASCII, and a header may hold anything).
    matched = [
        hmac.compare_digest(expected, candidate.encode("utf-8", "surrogatepass"))
        for candidate in candidates
    ]
    if not any(matched):
        raise BadSignature("signature does not match")
    skew = (time.time() if now is None else now) - timestamp
    if abs(skew) > tolerance:
        when = "old" if skew > 0 else "in the future"
        raise BadSignature(
            f"signature timestamp is {abs(skew):.0f} s {when}, beyond the {tolerance:g} s "
            "tolerance (a replay?)"
        )
    return timestamp
