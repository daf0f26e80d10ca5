"""A crash-resumed leased job is the same Celery job inside real canvases.

Each test starts real ``celery worker`` processes of ``tests.support.apps.canvas_app`` (a PostgreSQL
leases table, a Redis result backend, a 2 s lease renewed every 0.5 s, ``celery beat`` reaping
every second) and launches eight workflows at once, so that all ten of their leased tasks run on
one worker (``-c 12``) when the crash comes:

1. ``chain(add, leased units, record)``;
2. ``chord([leased units, add], sum_and_record)``;
3. ``chord([add, add], leased body) | record``;
4. ``group(leased units, leased units)``;
5. leased units with ``link=record``, and a leased task that fails after its units with
   ``link_error=errback``;
6. a leased task that replaces itself with ``chain(leased units, add)``;
7. a leased task sent with a custom header and a stamp, returning what its request says;
8. leased units sent to a topic exchange with routing key ``media.video``.

A second worker waits on a queue nobody uses and is told to consume the real queues
(``add_consumer``) when the crash comes. The crash kinds: the whole first worker SIGKILLed, each
pool process running a leased task SIGKILLed, a SIGTERM (warm shutdown: the jobs hand back at
their next checkpoint), and the leases database down when the messages arrive (the workers reach
it through a stopped TCP proxy, started a few seconds later).

Every workflow must complete once with the right result, every callback and errback must run
once, every leased job must commit each unit once and end in the right state, and every delivery
of a leased job must carry what its first one did and what its recorded message says (ids,
custom headers, stamps, canvas links, reply-to, route, priority). Every failed check of every
workflow is reported together.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery import Celery, chain, chord, group
from celery.result import AsyncResult, GroupResult

from celery_leases import Job, get_job
from celery_leases import message as message_module
from tests.support.apps.canvas_app import (
    GATE_ENV,
    GATE_UNIT,
    LIBRARY_HEADERS,
    TOPIC_ENV,
    Records,
    add_canvas_tasks,
    records_for,
)
from tests.support.proxy import TcpProxy
from tests.support.scenario import Scenario, check_unit_log, kill_all, runs_of, start_all, wait_for
from tests.support.service import delete_rabbitmq_entities
from tests.support.worker import Beat, Worker

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(150),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
    # One at a time in a parallel run: each test's two workers of 12 pool processes hold ~25
    # PostgreSQL connections, and four at once would pass the server's max_connections (100).
    pytest.mark.xdist_group("canvas_crash"),
]

CANVAS_APP = "tests.support.apps.canvas_app"
MakeScenario = Callable[..., Scenario]

#: Units of each leased task: a few after GATE_UNIT, where the crash lands (the gate holds
#: every task there until the test has crashed the worker, so none needs to be long).
UNITS = 6
UNIT_SECONDS = 0.3
#: Pool processes of the first worker: the ten leased tasks in flight, and room for the plain
#: tasks and the reaper around them.
CONCURRENCY = 12
#: Seconds every workflow has, after the crash, to complete.
COMPLETE_WITHIN = 20.0
#: Seconds to wait after every workflow completed for callbacks that should not exist.
SETTLE = 1.5
#: Seconds the leases database stays down in the outage test.
OUTAGE = 4.0
ROUTING_KEY = "media.video"
#: Celery's own protocol-2 headers; the others are custom ones (``request.headers``).
CELERY_HEADERS = {*message_module.HEADERS, "compression"}
#: Headers an attempt's request shows as fields of its own.
HEADER_FIELDS = (
    "stamped_headers", "stamps", "parent_id", "root_id", "retries", "group", "group_index",
    "replaced_task_nesting", "origin", "ignore_result", "expires",
)  # fmt: skip


# -- the workflows -------------------------------------------------------------------------------


@dataclass
class Flow:
    """One launched workflow and what it must end with.

    ``expected``: its result (None: checked otherwise); ``calls``: the values its callbacks and
    errbacks must record, each once; ``leased``: the tag of each leased task in it and the state
    its job must end in; ``fails``: its result is the leased task's exception.
    """

    name: str
    tag: str
    result: AsyncResult | GroupResult
    expected: Any
    calls: list[Any]
    leased: dict[str, str]
    fails: bool = False


def launch(app: Celery, *, topic: str, run: str) -> list[Flow]:
    """Send the eight workflows; return them."""
    t = app.tasks
    add, record, sum_and_record, errback = (
        t["canvas.add"],
        t["canvas.record"],
        t["canvas.sum_and_record"],
        t["canvas.errback"],
    )
    units, body, fails, context, replacer = (
        t["canvas.units"],
        t["canvas.body"],
        t["canvas.fails"],
        t["canvas.context"],
        t["canvas.replacer"],
    )
    n, secs = UNITS, UNIT_SECONDS
    flows: list[Flow] = []

    def tag(name: str) -> str:
        return f"{name}-{run}"

    name = "chain"
    T = tag(name)
    result = chain(add.s(1, 2), units.s(n, secs, tag=T), record.s(T)).apply_async()
    flows.append(Flow(name, T, result, 3 + n, [3 + n], {T: "done"}))

    name = "chord-leased-header"
    T = tag(name)
    result = chord([units.s(100, n, secs, tag=T), add.s(20, 22)], sum_and_record.s(T))()
    flows.append(Flow(name, T, result, 142 + n, [142 + n], {T: "done"}))

    name = "chord-leased-body"
    T = tag(name)
    result = (chord([add.s(1, 1), add.s(2, 2)], body.s(n, secs, tag=T)) | record.s(T))()
    flows.append(Flow(name, T, result, 6 + n, [6 + n], {T: "done"}))

    name = "group"
    T = tag(name)
    result = group(
        units.s(1000, n, secs, tag=f"{T}:0"), units.s(2000, n, secs, tag=f"{T}:1")
    ).apply_async()
    flows.append(
        Flow(name, T, result, [1000 + n, 2000 + n], [], {f"{T}:0": "done", f"{T}:1": "done"})
    )

    name = "link"
    T = tag(name)
    result = units.apply_async((7, n, secs), {"tag": T}, link=record.s(T))
    flows.append(Flow(name, T, result, 7 + n, [7 + n], {T: "done"}))

    name = "link-error"
    T = tag(name)
    result = fails.apply_async((n, secs), {"tag": T}, link_error=errback.s(T))
    flows.append(Flow(name, T, result, None, [result.id], {T: "failed"}, fails=True))

    name = "replaced"
    T = tag(name)
    result = replacer.apply_async((n, secs, 50), {"tag": T})
    flows.append(Flow(name, T, result, n + 50, [], {T: "replaced", f"{T}:replacement": "done"}))

    name = "custom-headers"
    T = tag(name)
    stamped = context.s(n, secs, tag=T)
    stamped.stamp(tier="gold")
    result = stamped.apply_async(headers={"x-tenant": "acme"})
    flows.append(Flow(name, T, result, None, [], {T: "done"}))

    name = "topic-route"
    T = tag(name)
    result = units.apply_async(
        (5, n, secs), {"tag": T}, queue=topic, exchange=topic, routing_key=ROUTING_KEY
    )
    flows.append(Flow(name, T, result, 5 + n, [], {T: "done"}))
    return flows


def unit_tags(flows: list[Flow]) -> list[str]:
    """Tags of the leased tasks that run units (all but the replaced one)."""
    return [tag for f in flows for tag, state in f.leased.items() if state != "replaced"]


# -- the test bed --------------------------------------------------------------------------------


@dataclass
class Bed:
    """A Scenario of ``canvas_app`` (client app with the canvas tasks), the topic and standby
    queue names, and what the workers record."""

    s: Scenario
    topic: str
    standby: str
    records: Records
    #: The file whose existence lets every leased task past unit GATE_UNIT (see canvas_app).
    gate: Path
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:6])

    def open_gate(self) -> None:
        self.gate.touch()

    @property
    def app(self) -> Celery:
        return self.s.app

    def worker(self, *, queues: list[str], env: dict[str, str] | None = None) -> Worker:
        worker = self.s.spawn.worker(
            CANVAS_APP,
            env=env or self.s.env,
            start=False,
            queues=queues,
            concurrency=CONCURRENCY,
        )
        self.s.workers.append(worker)
        return worker

    def beat(self) -> Beat:
        return self.s.spawn.beat(CANVAS_APP, env=self.s.env, start=False, max_interval=1)

    def attempts(self, tag: str) -> list[dict[str, Any]]:
        return self.records.read(tag, "attempts")

    def calls(self, tag: str) -> list[dict[str, Any]]:
        return self.records.read(tag, "calls")

    def job_of(self, tag: str) -> str | None:
        seen = self.attempts(tag)
        return seen[0]["job_id"] if seen else None

    def job(self, job_id: str) -> Job | None:
        return get_job(self.app, job_id)

    def consume_on(self, worker: Worker) -> None:
        """Have ``worker`` consume the real queues (it waited on the standby queue)."""
        queues = [self.app.conf.task_default_queue, self.topic]
        for queue in queues:
            self.app.control.add_consumer(queue, reply=False)
        for queue in queues:
            worker.wait_for_log(rf"Started consuming from {re.escape(queue)}\b", timeout=15)

    def in_flight(self, flows: list[Flow], *, unit: int, timeout: float) -> dict[str, str]:
        """Wait until every leased task running units has started ``unit`` (at most
        ``GATE_UNIT``: they wait there until the test opens the gate, so none can end first,
        however slow the machine) and none has ended; return {tag: job id}."""
        assert unit <= GATE_UNIT
        tags = unit_tags(flows)

        def probe() -> dict[str, str] | None:
            found: dict[str, str] = {}
            for tag in tags:
                job_id = self.job_of(tag)
                if job_id is None or not any(r.unit >= unit for r in self.s.log.rows(job_id)):
                    return None
                found[tag] = job_id
            return found

        started = time.monotonic()
        jobs = wait_for(probe, timeout=timeout, interval=0.1, what=f"every leased unit {unit}")
        print(f"every leased task in flight after {time.monotonic() - started:.1f} s")
        ended = {
            tag: j.state
            for tag, j_id in jobs.items()
            if (j := self.job(j_id)) and j.state != "running"
        }
        assert not ended, f"leased jobs ended before the crash (a machine too slow?): {ended}"
        return jobs

    def dump(self, flows: list[Flow]) -> str:
        """The table rows, attempts and calls of every workflow, for a failure report."""
        lines = []
        for flow in flows:
            lines.append(f"{flow.name}: calls {[c['value'] for c in self.calls(flow.tag)]}")
            for tag in flow.leased:
                seen = self.attempts(tag)
                job_id = seen[0]["job_id"] if seen else None
                job = self.job(job_id) if job_id else None
                row = (
                    "no attempt"
                    if job is None
                    else f"job {job.id} {job.state} attempts {job.attempts} token {job.token} "
                    f"owner {job.owner} error {job.error}"
                )
                hosts = [(a["attempt"], a["host"]) for a in seen]
                lines.append(f"  {tag}: {row}; attempts seen {hosts}")
        return "\n".join(lines)


@pytest.fixture
def bed(
    scenario: MakeScenario,
    celery_settings: dict[str, Any],
    result_backend: str,
    queue_name: str,
    tmp_path: Path,
) -> Iterator[Bed]:
    topic, standby = f"{queue_name}_media", f"{queue_name}_standby"
    settings = {**celery_settings, "leases_db_retry_max_delay": 2.0}
    s = scenario(
        settings,
        lease_seconds=2.0,
        renew_seconds=0.5,
        reaper_every=1.0,
        result_backend=result_backend,
    )
    s.env[TOPIC_ENV] = topic
    s.env[GATE_ENV] = str(tmp_path / "gate")
    add_canvas_tasks(s.app, s.env)
    made = Bed(s, topic, standby, records_for(s.app), tmp_path / "gate")
    yield made
    made.records.close()
    broker = celery_settings["broker_url"]
    if broker.startswith("amqp"):
        kill_all(s.spawn)
        delete_rabbitmq_entities(broker, queues=[topic, standby], exchanges=[topic, standby])


# -- the checks ----------------------------------------------------------------------------------


def complete(bed: Bed, flows: list[Flow], *, crashes: int, attempts: int) -> None:
    """Wait for every workflow, then check all of them; fail once with every problem found.

    ``crashes``: units each leased job may have redone; ``attempts``: how many attempts each
    leased job running units must have had (2: it resumed once; 1: it ran once).
    """
    started = time.monotonic()
    deadline = started + COMPLETE_WITHIN
    problems: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    for flow in flows:
        left = max(deadline - time.monotonic(), 1.0)
        try:
            if flow.fails:
                flow.result.get(timeout=left, propagate=False)
                values[flow.name] = flow.result.result
            else:
                values[flow.name] = flow.result.get(timeout=left)
        except Exception as exc:
            problems.setdefault(flow.name, []).append(f"did not complete: {exc!r}")
    print(f"workflows completed or gave up {time.monotonic() - started:.1f} s after the crash")
    finished = ("done", "failed", "replaced", "cancelled")

    def settled() -> bool:
        for flow in flows:
            for tag in flow.leased:
                job_id = bed.job_of(tag)
                job = bed.job(job_id) if job_id else None
                if job is None or job.state not in finished:
                    return False
        return True

    try:
        wait_for(
            settled,
            timeout=max(deadline - time.monotonic(), 1.0),
            interval=0.2,
            what="every leased job to end",
        )
    except AssertionError as exc:
        problems.setdefault("(all)", []).append(str(exc))
    time.sleep(SETTLE)
    for flow in flows:
        found = problems.setdefault(flow.name, [])
        found += check_flow(bed, flow, values.get(flow.name), crashes=crashes, attempts=attempts)
    failed = {name: found for name, found in problems.items() if found}
    report = "\n".join(f"{name}:\n  - " + "\n  - ".join(found) for name, found in failed.items())
    assert not failed, f"{len(failed)} workflow(s) went wrong:\n{report}\n\n{bed.dump(flows)}"


def check_flow(bed: Bed, flow: Flow, value: Any, *, crashes: int, attempts: int) -> list[str]:
    problems: list[str] = []
    if flow.fails:
        if flow.result.state != "FAILURE" or not isinstance(value, RuntimeError):
            problems.append(f"state {flow.result.state}, result {value!r}: expected FAILURE")
        elif f"{flow.tag} fails after its {UNITS} units" not in str(value):
            problems.append(f"failed with {value!r}")
    elif flow.expected is not None and value != flow.expected:
        problems.append(f"result {value!r}, expected {flow.expected!r}")
    calls = sorted(c["value"] for c in bed.calls(flow.tag))
    if calls != sorted(flow.calls):
        problems.append(f"callbacks recorded {calls}, expected each of {flow.calls} once")
    for tag, state in flow.leased.items():
        problems += [f"{tag}: {p}" for p in check_leased(bed, tag, state, crashes, attempts)]
    first = bed.attempts(flow.tag)
    if flow.name == "custom-headers" and first:
        seen = first[0]["identity"]
        if value != seen:
            problems.append(f"returned {value!r}, but its first attempt saw {seen!r}")
        if seen["headers"].get("x-tenant") != "acme":
            problems.append(f"first attempt saw headers {seen['headers']!r}")
        if (seen["stamped_headers"], seen["stamps"]) != (["tier"], {"tier": "gold"}):
            problems.append(f"first attempt saw stamps {seen['stamps']!r}")
    if flow.name == "topic-route":
        routes = {(a["identity"]["exchange"], a["identity"]["routing_key"]) for a in first}
        if routes != {(bed.topic, ROUTING_KEY)}:
            problems.append(f"delivered through {routes}, expected {(bed.topic, ROUTING_KEY)}")
    return problems


def check_leased(bed: Bed, tag: str, state: str, crashes: int, attempts: int) -> list[str]:
    seen = bed.attempts(tag)
    if not seen:
        return ["never ran"]
    problems: list[str] = []
    job_ids = {a["job_id"] for a in seen}
    if len(job_ids) != 1:
        problems.append(f"ran as several jobs: {job_ids}")
    job_id = seen[0]["job_id"]
    first = seen[0]["identity"]
    for later in seen[1:]:
        changed = {
            key: (first.get(key), later["identity"].get(key))
            for key in first.keys() | later["identity"].keys()
            if first.get(key) != later["identity"].get(key)
        }
        if changed:
            problems.append(f"attempt {later['attempt']} is not the same job: {changed}")
    job = bed.job(job_id)
    if job is None:
        return [*problems, f"job {job_id} is not recorded"]
    for seen_attempt in seen:
        differs = against_recorded(job, seen_attempt["identity"])
        if differs:
            problems.append(
                f"attempt {seen_attempt['attempt']} got another message than the recorded one: "
                f"{differs}"
            )
    if job.state != state:
        problems.append(f"job {job_id} ended {job.state} (error {job.error}), expected {state}")
    if state == "replaced":
        return problems
    if job.attempts != attempts or len(seen) != attempts:
        problems.append(
            f"job {job_id}: {job.attempts} attempts recorded, {len(seen)} ran, expected {attempts}"
        )
    rows = bed.s.log.rows(job_id)
    try:
        check_unit_log(rows, UNITS, crashes=crashes)
    except AssertionError as exc:
        problems.append(f"unit log: {exc}")
    else:
        runs = len(runs_of(rows))
        if runs != attempts:
            problems.append(f"{runs} runs of its units, expected {attempts}")
    return problems


def against_recorded(job: Job, seen: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """What an attempt's request says that the job's recorded message does not, as
    {field: (recorded, seen)}. Not compared: the ETA (a redelivery while the database is down
    is sent with a countdown) and the priority (kombu publishes a missing one as 0; attempts are
    compared with each other for it)."""
    message = job.message
    headers = message.headers
    recorded = {
        "id": headers.get("id"),
        "task": headers.get("task"),
        "args": message.args,
        "kwargs": message.kwargs,
        "headers": {
            k: v
            for k, v in headers.items()
            if k not in CELERY_HEADERS and not k.startswith(LIBRARY_HEADERS)
        },
        **{key: headers.get(key) for key in HEADER_FIELDS},
        **{key: message.embed.get(key) for key in ("chord", "chain")},
        "callbacks": message.embed.get("callbacks"),
        "errbacks": message.embed.get("errbacks"),
        "reply_to": message.properties.get("reply_to"),
        "correlation_id": message.properties.get("correlation_id"),
        "exchange": message.exchange,
        "routing_key": message.routing_key,
    }
    normalised = json.loads(json.dumps(recorded, sort_keys=True, default=str))
    return {
        key: (value, seen.get(key))
        for key, value in normalised.items()
        if value != seen.get(key) and not (value in (None, [], {}) and not seen.get(key))
    }


# -- the tests -----------------------------------------------------------------------------------


def start(bed: Bed) -> tuple[Worker, Worker]:
    """The first worker on the real queues, the second on standby, and beat."""
    first = bed.worker(queues=[bed.app.conf.task_default_queue, bed.topic])
    second = bed.worker(queues=[bed.standby])
    start_all([first, second, bed.beat()])
    return first, second


def test_every_workflow_completes_once_as_the_same_jobs_after_its_whole_worker_is_sigkilled(
    bed: Bed,
) -> None:
    # Given every leased task of the eight workflows running on the first worker
    first, second = start(bed)
    flows = launch(bed.app, topic=bed.topic, run=bed.run)
    bed.in_flight(flows, unit=GATE_UNIT, timeout=40)

    # When that whole worker (main process and pool) is SIGKILLed, and the second takes over
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    bed.open_gate()
    bed.consume_on(second)

    # Then every workflow completes once, each leased job resumed once from its checkpoint
    complete(bed, flows, crashes=1, attempts=2)


def test_every_workflow_completes_once_as_the_same_jobs_after_each_leased_pool_process_is_killed(
    bed: Bed,
) -> None:
    # Given every leased task of the eight workflows running on the first worker
    first, second = start(bed)
    flows = launch(bed.app, topic=bed.topic, run=bed.run)
    jobs = bed.in_flight(flows, unit=GATE_UNIT, timeout=40)

    # When each pool process running a leased task is SIGKILLed (the worker lives on)
    pids = {bed.s.log.rows(job_id)[-1].pid for job_id in jobs.values()}
    assert len(pids) == len(jobs) and pids <= set(first.children()), (pids, first.children())
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    bed.open_gate()
    bed.consume_on(second)

    # Then every workflow completes once, each leased job resumed once from its checkpoint
    complete(bed, flows, crashes=1, attempts=2)
    assert first.is_alive()


def test_every_workflow_completes_once_as_the_same_jobs_after_a_sigterm_hands_them_off(
    bed: Bed,
) -> None:
    # Given every leased task of the eight workflows running on the first worker, and the
    # second worker consuming the same queues
    first, second = start(bed)
    flows = launch(bed.app, topic=bed.topic, run=bed.run)
    bed.in_flight(flows, unit=GATE_UNIT, timeout=40)
    bed.consume_on(second)

    # When the first worker gets SIGTERM (warm shutdown)
    first.signal(signal.SIGTERM)
    bed.open_gate()

    # Then it exits soon: its jobs handed back at their next checkpoint
    first.wait(timeout=30)
    # and every workflow completes once, each leased job in a second attempt redoing no unit
    complete(bed, flows, crashes=0, attempts=2)
    assert "handed back at its checkpoint" in first.log_text()


def test_every_workflow_completes_once_as_the_same_jobs_when_the_database_is_down_at_the_claim(
    bed: Bed, database_url: str
) -> None:
    # Given a worker whose leases database is behind a stopped proxy (client and beat reach
    # it directly)
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    try:
        proxied = database_url.replace(
            f"@{target.hostname}:{target.port or 5432}", f"@127.0.0.1:{proxy.port}"
        )
        assert proxied != database_url
        worker = bed.worker(
            queues=[bed.app.conf.task_default_queue, bed.topic],
            env={**bed.s.env, "E2E_DATABASE_URL": proxied},
        )
        start_all([worker, bed.beat()])

        # When the eight workflows are sent, and the database comes back a few seconds later
        bed.open_gate()
        flows = launch(bed.app, topic=bed.topic, run=bed.run)
        worker.wait_for_log("leases database unreachable, delivering again", timeout=20)
        time.sleep(OUTAGE)
        ran = {tag: bed.attempts(tag) for f in flows for tag in f.leased}
        proxy.start()

        # Then nothing ran while it was down,
        assert not any(ran.values()), ran
        # and every workflow completes once, each leased job in one attempt
        complete(bed, flows, crashes=0, attempts=1)
    finally:
        kill_all(bed.s.spawn)
        proxy.close()
