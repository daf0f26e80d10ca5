"""The webhook receiver: ``POST /webhooks/<account>`` enqueues a sync of that account.

This is the "webhook job" of the example: the provider calls it when an account has new
events, and it answers at once (202, with the job id) while a worker does the sync.
``sync_account.delay()`` records the job in the leases table before it publishes, so a lost
message is still a recorded job that the reaper can publish again.

Run it alone: ``python -m examples.webhook_sync.receiver --port 8766``.
"""

from __future__ import annotations

import argparse
import json
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .app import make_data_folder, sync_account
from .upstream import serve

ROUTE = re.compile(r"^/webhooks/(?P<account>[A-Za-z0-9_-]{1,64})$")


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        # The body (the provider's notification) is not needed: the sync reads the events API.
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        match = ROUTE.match(self.path)
        if match is None:
            self._send(404, {"error": f"no route {self.path}"})
            return
        account = match["account"]
        result = sync_account.delay(account)
        self._send(202, {"account": account, "job": result.id})

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    args = parser.parse_args(argv)
    make_data_folder()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    host, port = server.socket.getsockname()[:2]
    serve(server, f"webhook receiver listening on http://{host}:{port}")


if __name__ == "__main__":
    main()
