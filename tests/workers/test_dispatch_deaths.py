"""A client that dies while it dispatches a job, at each point of ``apply_async``, end to end
(docs/guarantees.md, "A job accepted is never lost at dispatch").

``apply_async`` records the job (one INSERT: its whole message, ``queued``; on PostgreSQL a
plain job's commit does not wait for its WAL flush), then publishes the message. The client is
a real process (``tests.support.dispatch_client``) SIGKILLed at each point; the moment is held
by a TCP proxy in this process (``tests.support.proxy``) in front of the client's database or
broker connection, black-holed while the call is on it, so the kill lands at a known point:

1. before its record lands: the INSERT held on its way, dropped with the connection;
2. between the record and the publish: the record landed, the publish held and dropped;
3. after the publish, the record lost (what a database crash losing an unflushed record comes
   to): the claim creates the row from the message;
4. after ``apply_async`` returned.

The workers and this process reach PostgreSQL and Redis directly; the test reads the table and
the broker's keys directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import sqlalchemy as sa

from celery_leases import get_job
from celery_leases.reaper import reap
from chaos.app import install_state_log, remove_state_log
from tests.support.proxy import TcpProxy
from tests.support.scenario import Scenario, check_unit_log, wait_for
from tests.support.worker import REPO_ROOT, TESTS_DIR

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(90),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
]

LEASE_SECONDS = 2.0
#: ``leases_queued_timeout`` of the test whose message is lost: a queued job waits this long
#: before a reaper pass re-publishes it.
QUEUED_TIMEOUT = 1.0
#: Each job: ``e2e.units(UNITS, UNIT_SECONDS)``.
UNITS = 2
UNIT_SECONDS = 0.05
#: Seconds a job has to finish once a worker can run it.
FINISH_WITHIN = 20.0


class HoldingProxy(TcpProxy):
    """A :class:`TcpProxy` that counts the bytes the client sends while black-holed (held,
    never delivered if the proxy is stopped before it heals)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.held = 0

    async def _pipe(self, reader: Any, writer: Any) -> None:
        peer = writer.transport.get_extra_info("peername")
        to_server = peer is not None and tuple(peer[:2]) == self.target
        counted: Any = _Counting(reader, self) if to_server else reader
        await super()._pipe(counted, writer)


class _Counting:
    """A stream reader that adds what it reads during a black hole to ``proxy.held``."""

    def __init__(self, reader: Any, proxy: HoldingProxy) -> None:
        self._reader = reader
        self._proxy = proxy

    async def read(self, n: int) -> bytes:
        data: bytes = await self._reader.read(n)
        if not self._proxy._flowing.is_set():
            self._proxy.held += len(data)
        return data


def proxy_for(url: str, default_port: int) -> Iterator[HoldingProxy]:
    target = urlsplit(url)
    proxy = HoldingProxy(target.hostname or "127.0.0.1", target.port or default_port)
    proxy.start()
    yield proxy
    proxy.close()


def through(url: str, proxy: TcpProxy) -> str:
    """``url`` with its server's address replaced by the proxy's."""
    target = urlsplit(url)
    proxied = url.replace(f"@{target.hostname}:{target.port}", f"@127.0.0.1:{proxy.port}", 1)
    if proxied == url:
        proxied = url.replace(f"//{target.hostname}:{target.port}", f"//127.0.0.1:{proxy.port}")
    assert proxied != url, url
    return proxied


@pytest.fixture
def db_proxy(database_url: str) -> Iterator[HoldingProxy]:
    yield from proxy_for(database_url, 5432)


@pytest.fixture
def broker_proxy(broker_url: str) -> Iterator[HoldingProxy]:
    yield from proxy_for(broker_url, 6379)


class Client:
    """A ``tests.support.dispatch_client`` process; its output lines are read as they come."""

    def __init__(self, env: dict[str, str]) -> None:
        environment = dict(os.environ)
        paths = [str(REPO_ROOT), str(TESTS_DIR), environment.get("PYTHONPATH", "")]
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        environment["PYTHONUNBUFFERED"] = "1"
        environment.update(env)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.dispatch_client"],
            cwd=REPO_ROOT,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, wanted: str, timeout: float = 30) -> None:
        """Wait for the output line ``wanted``; AssertionError with the output after
        ``timeout`` seconds, or if the process exits first."""
        while wanted not in self.seen:
            try:
                self.seen.append(self.lines.get(timeout=timeout))
            except queue.Empty:
                raise AssertionError(
                    f"the client did not say {wanted!r} within {timeout} s "
                    f"(exit status {self.process.poll()}):\n" + "\n".join(self.seen)
                ) from None

    def said(self) -> list[str]:
        """Every line the client has written so far (all of them once it is killed)."""
        with contextlib.suppress(queue.Empty):
            while True:
                self.seen.append(self.lines.get_nowait())
        return self.seen

    def send(self, job_id: str) -> None:
        """Ask for ``apply_async`` of ``e2e.units(UNITS, UNIT_SECONDS)`` under ``job_id``."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{job_id} {UNITS} {UNIT_SECONDS}\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        """SIGKILL the client, wherever it is, and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        assert self.process.wait(10) == -signal.SIGKILL
        self._reader.join(10)  # every line it wrote before it died is read


@pytest.fixture
def clients() -> Iterator[Callable[[dict[str, str]], Client]]:
    """``clients(env)``: a started client process; every one is killed at teardown."""
    made: list[Client] = []

    def start(env: dict[str, str]) -> Client:
        made.append(Client(env))
        return made[-1]

    yield start
    for client in made:
        if client.process.poll() is None:
            client.kill()
        for stream in (client.process.stdin, client.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def broker_ids(url: str) -> list[str]:
    """The ids of every task message in the Redis database ``url``: waiting in a queue or
    delivered and unacknowledged (kombu's ``unacked`` hash)."""
    client = redis.Redis.from_url(url)
    found: list[str] = []
    try:
        for key in client.scan_iter():
            kind = client.type(key)
            if kind == b"list":
                payloads = [json.loads(raw) for raw in client.lrange(key, 0, -1)]
            elif kind == b"hash" and key == b"unacked":
                payloads = [json.loads(raw)[0] for raw in client.hvals(key)]
            else:
                continue
            found += [p["headers"]["id"] for p in payloads if "id" in p.get("headers", {})]
    finally:
        client.close()
    return found


@pytest.fixture
def states(database_url: str, table_name: str) -> Iterator[Callable[[str], list[str]]]:
    """``states(job_id)``: every state the job's row was inserted or updated with, in order
    (triggers of ``chaos.app``)."""
    engine = sa.create_engine(database_url)
    log = install_state_log(engine, table_name)

    def read(job_id: str) -> list[str]:
        query = sa.select(log.c.state).where(log.c.job_id == job_id).order_by(log.c.id)
        with engine.connect() as connection:
            return [str(state) for state in connection.execute(query).scalars()]

    yield read
    remove_state_log(engine, table_name)
    engine.dispose()


def new_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def ran_once(s: Scenario, job_id: str) -> None:
    """``job_id`` ends ``done`` after one attempt, each of its units committed once, in one
    run."""
    job = s.wait_finished(job_id, timeout=FINISH_WITHIN)
    assert (job.state, job.attempts, job.result) == ("done", 1, UNITS), job
    assert len(check_unit_log(s.log.rows(job_id), UNITS, crashes=0)) == 1


def test_a_client_killed_before_its_record_lands_leaves_no_job_and_its_last_call_runs_once(
    scenario: Callable[..., Scenario],
    celery_settings: dict[str, Any],
    database_url: str,
    db_proxy: HoldingProxy,
    clients: Callable[[dict[str, str]], Client],
) -> None:
    # Given a worker, and a client whose leases database is behind the proxy, whose call of
    # job `sent` has returned (its database connection open)
    s = scenario(celery_settings, lease_seconds=LEASE_SECONDS)
    client = clients(s.env | {"E2E_DATABASE_URL": through(database_url, db_proxy)})
    s.start_workers(1)
    client.expect("ready")
    sent, lost = new_id("sent"), new_id("lost")
    client.send(sent)
    client.expect(f"sent {sent}")

    # When its database connection is black-holed while it records job `lost` (its INSERT
    # sent, held by the black hole), the client is SIGKILLed, and the held INSERT is dropped
    # with the connection
    db_proxy.blackhole()
    client.send(lost)
    client.expect(f"calling {lost}")
    wait_for(lambda: db_proxy.held > 0, timeout=10, what="the client's INSERT")
    client.kill()
    assert f"sent {lost}" not in client.said()
    db_proxy.stop()

    # Then job `lost` has no row and no message
    assert get_job(s.app, lost) is None
    assert lost not in broker_ids(celery_settings["broker_url"])
    # and job `sent`, whose client died after its call returned, runs once (point 4)
    ran_once(s, sent)
    # and nothing runs job `lost`: a job sent after it runs, and its row is still missing
    after = s.send("e2e.units", UNITS, UNIT_SECONDS)
    ran_once(s, after)
    assert get_job(s.app, lost) is None and s.log.rows(lost) == []
    assert lost not in broker_ids(celery_settings["broker_url"])


def test_a_client_killed_between_its_record_and_its_publish_leaves_a_job_the_reaper_sends(
    scenario: Callable[..., Scenario],
    celery_settings: dict[str, Any],
    broker_url: str,
    broker_proxy: HoldingProxy,
    clients: Callable[[dict[str, str]], Client],
) -> None:
    # Given leases_queued_timeout 1 s, a worker, and a client whose broker is behind the
    # proxy, whose first call has returned (its broker connection open)
    s = scenario(
        celery_settings | {"leases_queued_timeout": QUEUED_TIMEOUT}, lease_seconds=LEASE_SECONDS
    )
    client = clients(s.env | {"E2E_BROKER_URL": through(broker_url, broker_proxy)})
    s.start_workers(1)
    client.expect("ready")
    first, lost = new_id("first"), new_id("lost")
    client.send(first)
    client.expect(f"sent {first}")
    ran_once(s, first)

    # When its broker connection is black-holed while it sends job `lost`: the job is
    # recorded (the database reached directly), its publish sent and held by the black hole
    broker_proxy.blackhole()
    client.send(lost)
    client.expect(f"calling {lost}")
    wait_for(lambda: get_job(s.app, lost), timeout=10, what=f"job {lost} recorded")
    wait_for(lambda: broker_proxy.held > 0, timeout=10, what="the client's publish")
    # and the client is SIGKILLed there, and the held publish dropped with the connection
    client.kill()
    assert f"sent {lost}" not in client.said()
    broker_proxy.stop()

    # Then the job is queued, and no message of it exists
    job = s.job(lost)
    assert (job.state, job.attempts) == ("queued", 0)
    assert lost not in broker_ids(broker_url)

    # When reaper passes run: once the job has waited its queued timeout, one re-publishes it
    wait_for(
        lambda: lost in reap(s.app).republished,
        timeout=QUEUED_TIMEOUT + 10,
        interval=0.2,
        what=f"a reaper pass to re-publish {lost}",
    )

    # Then the worker runs it once, to done
    ran_once(s, lost)


def test_a_record_lost_after_its_publish_is_created_by_the_claim_and_the_job_runs_once(
    scenario: Callable[..., Scenario],
    celery_settings: dict[str, Any],
    database_url: str,
    table_name: str,
    states: Callable[[str], list[str]],
) -> None:
    # Given a job recorded and published, no worker running yet
    s = scenario(celery_settings, lease_seconds=LEASE_SECONDS)
    job_id = s.send("e2e.units", UNITS, UNIT_SECONDS)
    assert broker_ids(celery_settings["broker_url"]) == [job_id]

    recorded = states(job_id)
    assert recorded == ["queued"]

    # When its record is lost (as a database crash loses an unflushed commit)
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as connection:
            deleted = connection.execute(
                sa.text(f"DELETE FROM {table_name} WHERE id = :id"), {"id": job_id}
            )
            assert deleted.rowcount == 1
    finally:
        engine.dispose()
    assert get_job(s.app, job_id) is None

    # and a worker starts
    [worker] = s.start_workers(1)

    # Then its claim creates the job's row from the message (inserted running, not queued),
    # says so, and the job runs once, to done
    ran_once(s, job_id)
    assert states(job_id)[len(recorded) :] == ["running", "done"]
    worker.wait_for_log(f"job {job_id}: its message was recorded, but its row was missing")
