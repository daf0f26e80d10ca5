"""A local stand-in for a provider's events API: the upstream the sync pages through.

``GET /events?account=<id>&after=<cursor>&limit=N`` returns an account's events oldest first,
with cursor pagination like the events APIs of payment and SaaS providers::

    {"data": [{"id": "evt_...", "type": "charge.succeeded", "created": 1700000042,
               "data": {"object": {...}}}, ...],
     "has_more": true, "next_cursor": "evt_...", "total_count": 3000}

The cursor is the id of the last event already seen (no ``after`` for the first page). The
events come from a seed, so every run serves the same ones. ``POST /events/grow?account=<id>&n=N``
adds the account's next N events, as if they happened now (the first ones stay the same, so a
cursor stays valid). Every answer waits ``latency`` seconds, and an ``error_rate`` share of
requests get a 429 or a 500 (picked by the seed; never more than twice in a row for one page).
``GET /stats`` tells how many events each account has and how many times each page was
served: the demo's count of pages fetched again after a crash.

Run it alone: ``python -m examples.webhook_sync.demo.upstream --port 8765``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

EVENT_TYPES = (
    ("customer.created", "cus"),
    ("invoice.created", "in"),
    ("invoice.paid", "in"),
    ("charge.succeeded", "ch"),
    ("charge.refunded", "ch"),
    ("customer.subscription.updated", "sub"),
)
#: ``created`` of the first event, in epoch seconds.
EPOCH = 1_700_000_000
#: A page never fails more often than this in a row, so a client's retries get through.
MAX_FAILURES_IN_A_ROW = 2
MAX_LIMIT = 1000


def _digest(*parts: object) -> bytes:
    return hashlib.sha256(":".join(map(str, parts)).encode()).digest()


def _fraction(*parts: object) -> float:
    """A number in [0, 1) fixed by ``parts``."""
    return int.from_bytes(_digest(*parts)[:8], "big") / 2**64


def generate_events(seed: str, account: str, count: int) -> list[dict[str, Any]]:
    """The ``count`` events of ``account``, oldest first; the same for the same seed."""
    events = []
    created = EPOCH
    for index in range(count):
        d = _digest(seed, account, index)
        created += 1 + d[0] % 60
        kind, prefix = EVENT_TYPES[d[1] % len(EVENT_TYPES)]
        customer = _digest(seed, account, "customer", d[2] % 40)[:7].hex()
        events.append(
            {
                "id": f"evt_{d[3:15].hex()}",
                "type": kind,
                "created": created,
                "data": {
                    "object": {
                        "id": f"{prefix}_{d[15:22].hex()}",
                        "customer": f"cus_{customer}",
                        "amount": 100 + int.from_bytes(d[22:24], "big") % 50_000,
                        "currency": "usd",
                    }
                },
            }
        )
    return events


@dataclass
class PageStats:
    """How often one page (account, cursor, limit) was asked for, and when it was served."""

    account: str
    page: int
    after: str | None
    served: int = 0
    errors: int = 0
    failures_in_a_row: int = 0
    #: Wall-clock times (epoch seconds) at which the requests that got an answer arrived.
    fetched_at: list[float] = field(default_factory=list)


class Upstream:
    """The events of every account, and the counters behind ``/stats``. Thread-safe."""

    def __init__(
        self,
        *,
        seed: str = "webhook",
        events: int = 3000,
        latency: float = 0.1,
        error_rate: float = 0.1,
    ) -> None:
        self.seed = seed
        self.count = events
        self.latency = latency
        self.error_rate = error_rate
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._positions: dict[str, dict[str, int]] = {}
        self._pages: dict[tuple[str, str | None, int], PageStats] = {}
        self._statuses: Counter[int] = Counter()

    def events_for(self, account: str) -> list[dict[str, Any]]:
        with self._lock:
            count = self._counts.setdefault(account, self.count)
            if len(self._events.get(account, ())) != count:
                events = generate_events(self.seed, account, count)
                self._events[account] = events
                self._positions[account] = {e["id"]: i for i, e in enumerate(events)}
            return self._events[account]

    def grow(self, account: str, added: int) -> int:
        """Add the next ``added`` events of ``account`` (``generate_events`` gives the same
        first ones for a larger count); how many it has now."""
        with self._lock:
            self._counts[account] = self._counts.get(account, self.count) + added
            return self._counts[account]

    def page(self, account: str, after: str | None, limit: int) -> tuple[int, dict[str, Any]]:
        """Answer one ``GET /events``: (HTTP status, JSON body)."""
        events = self.events_for(account)
        with self._lock:
            positions = self._positions[account]
        if after is None:
            start = 0
        elif after in positions:
            start = positions[after] + 1
        else:
            return 400, _error("invalid_request_error", f"no event {after!r} for {account!r}")
        key = (account, after, limit)
        arrived = time.time()
        with self._lock:
            stats = self._pages.setdefault(key, PageStats(account, start // limit + 1, after))
            attempt = stats.served + stats.errors
            fail = stats.failures_in_a_row < MAX_FAILURES_IN_A_ROW and (
                _fraction(self.seed, account, start, attempt) < self.error_rate
            )
        time.sleep(self.latency)
        if fail:
            status = 429 if _fraction(self.seed, account, start, attempt, "status") < 0.5 else 500
            kind = "rate_limit_error" if status == 429 else "api_error"
            with self._lock:
                stats.errors += 1
                stats.failures_in_a_row += 1
                self._statuses[status] += 1
            return status, _error(kind, "try again later")
        data = events[start : start + limit]
        more = start + limit < len(events)
        with self._lock:
            stats.served += 1
            stats.failures_in_a_row = 0
            stats.fetched_at.append(arrived)
            self._statuses[200] += 1
        return 200, {
            "data": data,
            "has_more": more,
            "next_cursor": data[-1]["id"] if data else after,
            "total_count": len(events),
        }

    def stats(self) -> dict[str, Any]:
        """Counters for ``GET /stats``: requests by status, and every page asked for."""
        with self._lock:
            pages = [asdict(p) for p in self._pages.values()]
            statuses = {str(k): v for k, v in sorted(self._statuses.items())}
            accounts = dict(sorted(self._counts.items()))
        pages.sort(key=lambda p: (p["account"], p["page"]))
        return {
            "accounts": accounts,
            "statuses": statuses,
            "pages": pages,
            "pages_served_more_than_once": [p for p in pages if p["served"] > 1],
        }


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message}}


class Handler(BaseHTTPRequestHandler):
    server: UpstreamServer

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if url.path == "/stats":
            self._send(200, self.server.upstream.stats())
        elif url.path == "/events":
            try:
                limit = int(query.get("limit", "100"))
            except ValueError:
                limit = 0
            if not query.get("account") or not 1 <= limit <= MAX_LIMIT:
                self._send(400, _error("invalid_request_error", "need account= and limit=1..1000"))
                return
            self._send(*self.server.upstream.page(query["account"], query.get("after"), limit))
        else:
            self._send(404, _error("invalid_request_error", f"no route {url.path}"))

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if url.path != "/events/grow":
            self._send(404, _error("invalid_request_error", f"no route {url.path}"))
            return
        added = query.get("n", "")
        if not query.get("account") or not added.isdigit():
            self._send(400, _error("invalid_request_error", "need account= and n=<events>"))
            return
        count = self.server.upstream.grow(query["account"], int(added))
        self._send(200, {"account": query["account"], "added": int(added), "total_count": count})

    def _send(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            self.log_message("client gone before the answer (killed?)")


class UpstreamServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: Upstream, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), Handler)
        self.upstream = upstream

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{host}:{port}"


def serve(server: ThreadingHTTPServer, banner: str) -> None:
    """Print ``banner`` (the line the demo waits for), then serve until SIGTERM or Ctrl-C."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print(banner, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    parser.add_argument("--seed", default="webhook")
    parser.add_argument("--events", type=int, default=3000, help="events per account")
    parser.add_argument("--latency", type=float, default=0.1, help="seconds per answer")
    parser.add_argument("--error-rate", type=float, default=0.1, help="share of 429/500 answers")
    args = parser.parse_args(argv)
    upstream = Upstream(
        seed=args.seed, events=args.events, latency=args.latency, error_rate=args.error_rate
    )
    server = UpstreamServer(upstream, args.host, args.port)
    serve(server, f"upstream listening on {server.url}")


if __name__ == "__main__":
    main()
