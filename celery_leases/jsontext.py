"""JSON text as the leases table stores it: UTF-8, with non-ASCII characters as they are, or
escaped when the value holds what UTF-8 cannot (a lone surrogate, ``"\\ud800"``: JSON escapes
it, and Celery's serializer sends it so). Either text reads back as the same value."""

from __future__ import annotations

from typing import Any

from kombu.utils import json as kombu_json

#: The separators of every JSON text the table stores (no spaces).
SEPARATORS = (",", ":")


def storable(text: str) -> bool:
    """Whether ``text`` can be stored as UTF-8 (not when it holds a lone surrogate)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def celery_json(value: Any) -> str:
    """Celery's JSON of ``value`` (kombu's: datetimes, UUIDs, Decimals, bytes, NaN as Celery
    sends them), as stored."""
    text = str(kombu_json.dumps(value, separators=SEPARATORS, ensure_ascii=False))
    return text if storable(text) else str(kombu_json.dumps(value, separators=SEPARATORS))
