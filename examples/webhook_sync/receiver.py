"""The webhook receiver: ``POST /webhooks`` triggers a sync of the account a signed delivery names.

The provider calls it when an account has new events, with a JSON body naming the account
(``{"type": "events.created", "account": "acct_1"}``), a delivery id and a signature
(``signature.py``). What the receiver does with a delivery, in order:

1. 411 without a ``Content-Length``, 413 when it is over ``MAX_BODY_BYTES`` (nothing read);
2. 400 without a well-formed ``Webhook-Id`` (the provider's delivery id);
3. 401 unless the raw body is signed with ``WEBHOOK_SYNC_SECRET``, at most 5 minutes ago;
4. 400 unless the body is a JSON object naming an account;
5. 200 when that delivery id was recorded already: the provider retries a delivery whose
   answer it did not get, and the retry starts nothing;
6. otherwise ``sync_account.delay(account)``, then the delivery is recorded
   (``deliveries.py`` says why in that order), and 202 with the id of the job that serves it.

It answers at once: the sync runs on a worker. ``delay()`` records the job in the leases table
before it publishes, so a lost message is still a recorded job that the reaper publishes again.
A delivery for an account whose sync is queued or running waits on the account's lease key
(``lease_key``) as one trigger with every other delivery meanwhile: the job that starts after
the latest of them serves them (the queued sync, when it had not started yet), or one
follow-up run when the sync ends; the 202 names the id they wait under.

Run it alone: ``WEBHOOK_SYNC_SECRET=... python -m examples.webhook_sync.receiver --port 8766``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sqlalchemy.engine import Engine

from . import deliveries, sink
from .app import DATABASE, DELIVERIES, make_data_folder, sync_account
from .signature import DELIVERY_ID, ID_HEADER, SIGNATURE_HEADER, BadSignature, verify

SECRET_VARIABLE = "WEBHOOK_SYNC_SECRET"
ROUTE = "/webhooks"
#: Largest body accepted, in bytes: a notification names an account, it carries no data.
MAX_BODY_BYTES = 64 * 1024
ACCOUNT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any] = field(default_factory=dict)


def refused(status: int, error: str) -> Answer:
    return Answer(status, {"error": error})


class Receiver:
    """What a delivery gets, HTTP aside: its signature checked with ``secret``, its id
    deduplicated in ``table`` (on ``engine``), its account's sync triggered."""

    def __init__(self, secret: str, *, engine: Engine, table: Any = DELIVERIES) -> None:
        self.secret = secret
        self.engine = engine
        self.table = table

    def deliver(self, delivery_id: str | None, signed: str | None, body: bytes) -> Answer:
        if delivery_id is None or not DELIVERY_ID.match(delivery_id):
            return refused(400, f"need a {ID_HEADER} header (1-128 of A-Za-z0-9_.:-)")
        try:
            verify(signed, body, secret=self.secret, delivery_id=delivery_id)
        except BadSignature as exc:
            logger.warning("delivery %s refused: %s", delivery_id, exc)
            return refused(401, str(exc))
        try:
            notification = json.loads(body)
        except ValueError:
            notification = None
        account = notification.get("account") if isinstance(notification, dict) else None
        if not isinstance(account, str) or not ACCOUNT.match(account):
            return refused(400, 'need a JSON object with an "account" (1-64 of A-Za-z0-9_-)')
        answer = {"account": account, "delivery": delivery_id}
        try:
            served = deliveries.served_by(self.engine, self.table, delivery_id)
            if served is not None:
                logger.info("delivery %s: a retry of a recorded one (job %s)", delivery_id, served)
                return Answer(200, answer | {"job": served, "duplicate": True})
            job_id = str(sync_account.delay(account).id)
        except Exception as exc:  # the provider retries a 5xx later
            logger.exception("delivery %s: could not trigger the sync of %s", delivery_id, account)
            return refused(
                503, f"could not trigger the sync, try again later ({type(exc).__name__})"
            )
        try:
            deliveries.record(self.engine, self.table, delivery_id, account, job_id)
        except Exception:
            # The sync is triggered: a retry of this delivery would only trigger it again.
            logger.exception("delivery %s: triggered job %s, not recorded", delivery_id, job_id)
        return Answer(202, answer | {"job": job_id})


class Handler(BaseHTTPRequestHandler):
    server: ReceiverServer
    #: Seconds a client may take to send its request.
    timeout = 10

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != ROUTE:
            self._send(refused(404, f"no route {self.path}; deliveries go to POST {ROUTE}"))
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._send(refused(411, "need a Content-Length"))
            return
        if int(length) > MAX_BODY_BYTES:
            self._send(refused(413, f"body over {MAX_BODY_BYTES} bytes"))
            return
        body = self.rfile.read(int(length))
        answer = self.server.receiver.deliver(
            self.headers.get(ID_HEADER), self.headers.get(SIGNATURE_HEADER), body
        )
        self._send(answer)

    def _send(self, answer: Answer) -> None:
        payload = json.dumps(answer.body).encode()
        if answer.status >= 400:
            # The body of a refused request is not read (all of it): close after the answer.
            self.close_connection = True
        try:
            self.send_response(answer.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            self.log_message("client gone before the answer (killed?)")


class ReceiverServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, receiver: Receiver, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), Handler)
        self.receiver = receiver

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{host}:{port}{ROUTE}"


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
    args = parser.parse_args(argv)
    secret = os.environ.get(SECRET_VARIABLE, "")
    if not secret.strip():
        parser.exit(
            2,
            f"webhook receiver: {SECRET_VARIABLE} is not set. Set it to the signing secret your "
            "provider gave you; without it anyone could start syncs, so the receiver does not "
            "start.\n",
        )
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    make_data_folder()
    engine = sink.engine(DATABASE)
    sink.create(engine, DELIVERIES)
    server = ReceiverServer(Receiver(secret, engine=engine), args.host, args.port)
    serve(server, f"webhook receiver listening on {server.url}")


if __name__ == "__main__":
    main()
