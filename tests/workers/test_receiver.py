"""The webhook-sync example's receiver, as a subprocess on a real database and broker: signed
deliveries only, within the tolerance, each delivery id acted on once, answered before any
sync runs.

No worker runs here: a job the receiver starts stays queued, with its message in the broker.
Both stacks: the embedded default (SQLite + the ``atomicfs://`` broker) and Redis + PostgreSQL.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from kombu import Connection

from celery_leases.db import migrations
from celery_leases.db.rows import Job
from celery_leases.db.store import Store
from celery_leases.settings import DEFAULTS, validate
from examples.webhook_sync import deliveries
from examples.webhook_sync.demo import fs_transport
from examples.webhook_sync.demo.provider import deliver, new_delivery_id, notification, post
from examples.webhook_sync.signature import sign
from tests.support.service import drop_tables, private_redis_url, require

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO_ROOT = Path(__file__).resolve().parents[2]
SECRET = "whsec_test_" + uuid.uuid4().hex


@dataclass
class Receiver:
    """A running receiver, and what a test reads behind it."""

    url: str
    name: str
    database: str
    broker: str
    data: Path
    store: Store
    engine: sa.engine.Engine
    process: subprocess.Popen[bytes]
    log: Path

    def jobs(self, account: str) -> list[Job]:
        """The jobs of ``account``'s lease key, oldest first."""
        found = [j for j in self.store.list_jobs(limit=500) if j.lease_key == f"account:{account}"]
        return sorted(found, key=lambda j: j.created_at)

    def waiting_trigger(self, account: str) -> str | None:
        """The id the callers of a trigger waiting on ``account``'s lease key were given (the
        key's first waiting trigger: no job row until it is served or run for)."""
        keys = self.store.keys
        with self.store.engine.connect() as connection:
            found = connection.scalar(
                sa.select(keys.c.pending_id).where(keys.c.lease_key == f"account:{account}")
            )
        return None if found is None else str(found)

    def recorded(self, delivery_id: str) -> int:
        return deliveries.count(self.engine, self.deliveries, delivery_id)

    @property
    def deliveries(self) -> sa.Table:
        return deliveries.deliveries_table(f"{self.name}_deliveries")

    def queued_messages(self) -> int:
        """Messages waiting in the example's queue on the broker."""
        options = fs_transport.options(self.data / "broker") if "atomicfs" in self.broker else {}
        with Connection(self.broker, transport_options=options) as connection:
            declared = connection.default_channel.queue_declare(queue=self.name)
            return int(declared.message_count)


def start_receiver(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start the receiver with ``env``; its process and URL, once it listens."""
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "examples.webhook_sync.receiver"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    assert process.stdout is not None
    banner = process.stdout.readline().decode()
    found = re.search(r"listening on (http://\S+)", banner)
    if found is None:
        process.kill()
        process.wait()
        process.stdout.close()
        raise AssertionError(f"no banner ({banner!r}); log:\n{log.read_text()}")
    return process, found[1]


def receiver_env(data: Path, name: str, **settings: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "WEBHOOK_SYNC_DATA": str(data),
        "WEBHOOK_SYNC_NAME": name,
        **settings,
    }


@pytest.fixture(scope="module", params=["embedded", "redis-postgresql"])
def receiver(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Receiver]:
    data = tmp_path_factory.mktemp("receiver")
    name = f"leases_t_{uuid.uuid4().hex[:8]}"
    redis = private_redis_url() if request.param != "embedded" else contextlib.nullcontext("")
    with redis as redis_url:
        if request.param == "embedded":
            database, broker = f"sqlite:///{data / 'webhook_sync.sqlite3'}", "atomicfs://"
        else:
            database, broker = require("postgres"), str(redis_url)
        env = receiver_env(
            data,
            name,
            WEBHOOK_SYNC_SECRET=SECRET,
            WEBHOOK_SYNC_DATABASE=database,
            WEBHOOK_SYNC_BROKER=broker,
        )
        log = data / "receiver.log"
        settings = validate(DEFAULTS | {"database_url": database, "table": f"{name}_leases"})
        store, engine = Store(settings), sa.create_engine(database)
        migrations.upgrade(store)  # what `celery -A examples.webhook_sync.app leases init-db` does
        process, url = start_receiver(env, log)
        fs_transport.register()
        try:
            yield Receiver(url, name, database, broker, data, store, engine, process, log)
        finally:
            process.terminate()
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()
            store.engine.dispose()
            engine.dispose()
            if not database.startswith("sqlite"):
                drop_tables(database, name)


def new_account() -> str:
    return f"acct_{uuid.uuid4().hex[:10]}"


def signed_post(
    r: Receiver, body: bytes, *, delivery_id: str | None = None, secret: str = SECRET, **kw: Any
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    headers |= sign(body, secret=secret, delivery_id=delivery_id or new_delivery_id(), **kw)
    return post(r.url, body, headers)


# -- signatures ---------------------------------------------------------------------------------


def test_a_delivery_without_a_signature_is_refused_with_401_and_starts_nothing(
    receiver: Receiver,
) -> None:
    account, delivery_id = new_account(), new_delivery_id()

    status, answer = post(receiver.url, notification(account), {"Webhook-Id": delivery_id})

    assert (status, answer) == (401, {"error": "no Webhook-Signature header"})
    assert receiver.jobs(account) == []
    assert receiver.recorded(delivery_id) == 0


@pytest.mark.parametrize(
    "tamper",
    ["body changed", "delivery id changed", "signature changed", "no v1", "no timestamp"],
)
def test_a_delivery_whose_signature_does_not_match_is_refused_with_401(
    receiver: Receiver, tamper: str
) -> None:
    account, delivery_id = new_account(), new_delivery_id()
    body = notification(account)
    headers = {"Content-Type": "application/json"} | sign(
        body, secret=SECRET, delivery_id=delivery_id
    )
    t, v1 = headers["Webhook-Signature"].split(",")
    if tamper == "body changed":
        body = body.replace(b"events.created", b"events.deleted")
    elif tamper == "delivery id changed":
        delivery_id = new_delivery_id()
        headers["Webhook-Id"] = delivery_id
    elif tamper == "signature changed":
        headers["Webhook-Signature"] = f"{t},v1={'0' * 64}"
    elif tamper == "no v1":
        headers["Webhook-Signature"] = t
    else:
        headers["Webhook-Signature"] = v1

    status, answer = post(receiver.url, body, headers)

    assert status == 401, answer
    assert receiver.jobs(account) == []
    assert receiver.recorded(delivery_id) == 0


def test_a_delivery_signed_with_another_secret_is_refused_with_401(receiver: Receiver) -> None:
    account, delivery_id = new_account(), new_delivery_id()

    status, answer = deliver(
        receiver.url, account, secret="whsec_someone_else", delivery_id=delivery_id
    )

    assert (status, answer) == (401, {"error": "signature does not match"})
    assert receiver.jobs(account) == []
    assert receiver.recorded(delivery_id) == 0


@pytest.mark.parametrize("skew", [-301, 3600])
def test_a_replayed_or_future_signature_beyond_five_minutes_is_refused_with_401(
    receiver: Receiver, skew: int
) -> None:
    # Given a delivery correctly signed, but 301 s ago (replayed) or an hour ahead
    account, delivery_id = new_account(), new_delivery_id()
    signed_at = int(time.time()) + skew

    status, answer = deliver(
        receiver.url, account, secret=SECRET, delivery_id=delivery_id, timestamp=signed_at
    )

    assert status == 401, answer
    assert "beyond the 300 s tolerance" in answer["error"], answer
    assert receiver.jobs(account) == []
    assert receiver.recorded(delivery_id) == 0


# -- deliveries -----------------------------------------------------------------------------------


def test_a_valid_delivery_is_answered_202_with_its_job_recorded_and_queued(
    receiver: Receiver,
) -> None:
    account, delivery_id = new_account(), new_delivery_id()
    queued_before = receiver.queued_messages()

    status, answer = deliver(receiver.url, account, secret=SECRET, delivery_id=delivery_id)

    # Answered at once (no worker runs): the job is recorded, queued, and its message published
    assert status == 202, answer
    assert answer == {"account": account, "delivery": delivery_id, "job": answer["job"]}
    (job,) = receiver.jobs(account)
    assert (job.id, job.state, job.args, job.attempts) == (answer["job"], "queued", [account], 0)
    assert receiver.recorded(delivery_id) == 1
    assert receiver.queued_messages() == queued_before + 1


def test_a_retried_delivery_is_answered_200_and_starts_nothing(receiver: Receiver) -> None:
    # Given a delivery acted on, whose job has ended since (so the account is idle: any
    # trigger now would start a new job)
    account, delivery_id = new_account(), new_delivery_id()
    status, first = deliver(receiver.url, account, secret=SECRET, delivery_id=delivery_id)
    assert status == 202, first
    assert receiver.store.cancel_queued(first["job"])
    queued_before = receiver.queued_messages()

    # When the provider retries it (signed again, a new timestamp), twice
    retries = [
        deliver(receiver.url, account, secret=SECRET, delivery_id=delivery_id) for _ in range(2)
    ]

    # Then each retry is answered 200 with the job that served the delivery, and starts nothing
    assert retries == [(200, first | {"duplicate": True})] * 2
    assert [j.id for j in receiver.jobs(account)] == [first["job"]]
    assert receiver.recorded(delivery_id) == 1
    assert receiver.queued_messages() == queued_before
    # while a new delivery for that account does start a job
    status, other = deliver(receiver.url, account, secret=SECRET)
    assert status == 202 and other["job"] != first["job"], other
    assert [j.id for j in receiver.jobs(account)] == [first["job"], other["job"]]


def test_the_same_delivery_twice_at_once_is_recorded_once_and_starts_one_job(
    receiver: Receiver,
) -> None:
    account, delivery_id = new_account(), new_delivery_id()
    answers: list[tuple[int, Any]] = []

    threads = [
        threading.Thread(
            target=lambda: answers.append(
                deliver(receiver.url, account, secret=SECRET, delivery_id=delivery_id)
            )
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert sorted({status for status, _ in answers}) in ([202], [200, 202]), answers
    (job,) = receiver.jobs(account)
    # Those that came while the first one's job was queued wait on its key as one trigger,
    # which that job serves when it starts
    named = {answer["job"] for _, answer in answers}
    assert job.id in named and named <= {job.id, receiver.waiting_trigger(account)}, named
    assert receiver.recorded(delivery_id) == 1


def test_deliveries_for_an_account_whose_sync_is_queued_wait_on_its_key_as_one_trigger(
    receiver: Receiver,
) -> None:
    account = new_account()

    answers = [deliver(receiver.url, account, secret=SECRET) for _ in range(3)]

    # The first starts the sync; the later ones start no job: they wait on the account's key
    # as one trigger (its id is theirs), which the queued sync serves when it starts
    (job,) = receiver.jobs(account)
    trigger = receiver.waiting_trigger(account)
    assert trigger is not None and trigger != job.id
    assert answers == [
        (202, {"account": account, "delivery": a["delivery"], "job": served})
        for (_, a), served in zip(answers, [job.id, trigger, trigger], strict=True)
    ]


# -- bad requests -------------------------------------------------------------------------------


def test_a_body_over_64_kib_is_refused_with_413_before_it_is_read(receiver: Receiver) -> None:
    account, delivery_id = new_account(), new_delivery_id()
    body = json.dumps({"account": account, "padding": "x" * 70_000}).encode()

    status, answer = signed_post(receiver, body, delivery_id=delivery_id)

    assert (status, answer) == (413, {"error": "body over 65536 bytes"})
    assert receiver.jobs(account) == []
    assert receiver.recorded(delivery_id) == 0


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe garbage", b"[1, 2]", b'{"type": "events.created"}', b'{"account": "../etc"}'],
    ids=["not JSON", "not an object", "no account", "bad account"],
)
def test_a_signed_body_that_names_no_account_is_refused_with_400(
    receiver: Receiver, body: bytes
) -> None:
    delivery_id = new_delivery_id()

    status, answer = signed_post(receiver, body, delivery_id=delivery_id)

    assert status == 400, answer
    assert "account" in answer["error"]
    assert receiver.recorded(delivery_id) == 0


def test_garbage_unsigned_is_refused_with_401_and_no_delivery_id_with_400(
    receiver: Receiver,
) -> None:
    garbage = os.urandom(512)

    assert post(receiver.url, garbage, {"Webhook-Id": new_delivery_id()})[0] == 401
    assert post(receiver.url, garbage, {"Webhook-Signature": "t=1,v1=00"})[0] == 400
    assert post(receiver.url, garbage, {"Webhook-Id": "x" * 200})[0] == 400


def test_a_delivery_without_a_content_length_is_refused_with_411(receiver: Receiver) -> None:
    url = urlsplit(receiver.url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        connection.putrequest("POST", url.path)
        connection.putheader("Transfer-Encoding", "chunked")
        connection.endheaders()
        connection.send(b"5\r\nhello\r\n0\r\n\r\n")
        answer = connection.getresponse()
        assert (answer.status, json.loads(answer.read())) == (
            411,
            {"error": "need a Content-Length"},
        )
    finally:
        connection.close()


def test_the_receiver_refuses_to_start_without_a_secret(tmp_path: Path) -> None:
    env = receiver_env(tmp_path, "leases_t_nosecret")
    env.pop("WEBHOOK_SYNC_SECRET", None)

    done = subprocess.run(
        [sys.executable, "-m", "examples.webhook_sync.receiver"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 2, done
    assert "WEBHOOK_SYNC_SECRET is not set" in done.stderr, done.stderr
    assert "listening" not in done.stdout
