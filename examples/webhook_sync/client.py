"""The sync's HTTP client for the upstream events API (stdlib only).

A 429 or a 5xx is retried here a few times with a short backoff, the way provider SDKs do;
when the upstream is still busy after that, :class:`UpstreamBusy` goes up to the task, whose
Celery retry waits longer (seconds to minutes) and resumes from the checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

logger = logging.getLogger(__name__)


class UpstreamBusy(Exception):
    """The upstream kept answering 429 or 5xx (or did not answer); try again later."""


@dataclass(frozen=True)
class Page:
    events: list[dict[str, Any]]
    has_more: bool
    next_cursor: str | None
    total: int | None


class EventsClient:
    """``GET {base_url}/events`` with cursor pagination.

    ``tries`` requests per page at most, ``backoff`` seconds before the first retry (doubled
    each time), ``timeout`` seconds per request.
    """

    def __init__(
        self, base_url: str, *, tries: int = 4, backoff: float = 0.05, timeout: float = 10.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.tries = tries
        self.backoff = backoff
        self.timeout = timeout

    def page(self, account: str, *, after: str | None, limit: int) -> Page:
        """The ``limit`` events of ``account`` that follow the cursor ``after``."""
        query = {"account": account, "limit": limit} | ({"after": after} if after else {})
        url = f"{self.base_url}/events?{urlencode(query)}"
        problem = ""
        for attempt in range(self.tries):
            if attempt:
                delay = self.backoff * 2 ** (attempt - 1)
                logger.info("upstream answered %s; retrying in %.2f s", problem, delay)
                time.sleep(delay)
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as answer:
                    body = json.load(answer)
            except urllib.error.HTTPError as exc:
                if exc.code != 429 and exc.code < 500:
                    raise
                problem = f"{exc.code} {exc.reason}"
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                problem = f"no answer ({exc})"
                continue
            return Page(
                body["data"], body["has_more"], body["next_cursor"], body.get("total_count")
            )
        raise UpstreamBusy(f"{url}: {problem} after {self.tries} tries")
