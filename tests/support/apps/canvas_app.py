"""``tests.support.apps.leased_app`` plus the tasks of the canvas crash tests, configured from env.

Configured like ``leased_app`` (see its ``app_env``; set ``result_backend``, a Redis URL: the
records below live there too), plus:

=================  =============================================================================
``CANVAS_TOPIC``   name of a topic exchange and of a queue bound to it with ``media.#``; both
                   join ``task_queues``, next to the default queue (unset: no topic route)
``CANVAS_GATE``    a file's path: unit ``GATE_UNIT`` of every leased task, once started, waits
                   until that file exists (unset: no gate), so a test can crash the workflows
                   while every leased task is in flight, however slow the machine
=================  =============================================================================

Records (Redis lists in the result backend's database, JSON items, see :class:`Records`):

- ``canvas:<tag>:calls``: one item per run of a plain callback or errback given ``tag``;
- ``canvas:<tag>:attempts``: one item per attempt of a leased task given ``tag``: what that
  attempt's request says (:func:`identity`) plus its job id, attempt number, host and pid.

Plain tasks: ``canvas.add(x, y)``, ``canvas.record(value, tag)`` (records and returns
``value``), ``canvas.sum_and_record(values, tag)`` (records and returns the sum) and
``canvas.errback(task_id, tag)`` (an old-style errback: records the failed task's id).

Leased tasks (each attempt records itself, then runs ``count`` units of ``unit_seconds`` from
its checkpoint, each unit committed in the transaction of its checkpoint, like ``e2e.units``):

- ``canvas.units(base, count, unit_seconds, tag=)`` returns ``base + count``;
- ``canvas.body(results, count, unit_seconds, tag=)`` returns ``sum(results) + count``;
- ``canvas.fails(count, unit_seconds, tag=)`` raises RuntimeError after its last unit;
- ``canvas.context(count, unit_seconds, tag=)`` returns what its request said (``identity``);
- ``canvas.replacer(count, unit_seconds, add, tag=)`` replaces itself with
  ``canvas.units(0, count, unit_seconds, tag=<tag>:replacement) | canvas.add(add)``.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import redis
from celery import Celery, Task, chain
from kombu import Exchange, Queue

from celery_leases import LeasedTask
from celery_leases.message import TRANSPORT_HEADERS
from tests.support.apps.leased_app import make_app as make_leased_app
from tests.support.apps.leased_app import unit_log_for
from tests.support.unit_log import UnitLog

TOPIC_ENV = "CANVAS_TOPIC"
GATE_ENV = "CANVAS_GATE"
#: The unit that waits for the gate (see ``CANVAS_GATE``), and for how long at most (seconds).
GATE_UNIT = 2
GATE_TIMEOUT = 120.0
#: The routing key the topic queue is bound with.
TOPIC_BINDING = "media.#"
#: Custom headers whose names start with this are the library's own (message version, retries
#: while the database was down): they may change from one delivery to the next.
LIBRARY_HEADERS = "leases_"


class Records:
    """Redis lists of what tasks saw, in the database at ``url`` (one client per process)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: redis.Redis | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def client(self) -> redis.Redis:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = redis.Redis.from_url(self.url, socket_timeout=10)
                self._pid = os.getpid()
            return self._client

    @staticmethod
    def key(tag: str, kind: str) -> str:
        return f"canvas:{tag}:{kind}"

    def add(self, tag: str, kind: str, item: Any) -> None:
        self.client.rpush(self.key(tag, kind), json.dumps(item, sort_keys=True, default=str))

    def read(self, tag: str, kind: str) -> list[Any]:
        return [json.loads(raw) for raw in self.client.lrange(self.key(tag, kind), 0, -1)]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def records_for(app: Celery) -> Records:
    """The records of ``app``, in its result backend's Redis database."""
    found: Records | None = app.__dict__.get("_canvas_records")
    if found is None:
        backend = str(app.conf.result_backend or "")
        if not backend.startswith("redis"):
            raise RuntimeError(f"canvas_app needs a Redis result_backend, not {backend!r}")
        found = app.__dict__["_canvas_records"] = Records(backend)
    return found


def identity(task: Task) -> dict[str, Any]:
    """What the running task's request says about its job: everything that must be the same in
    every delivery of one Celery job (custom headers but the library's own, stamps, ids,
    canvas links, reply-to, route), JSON-normalised."""
    request = task.request
    info = request.delivery_info or {}
    headers = {
        k: v
        for k, v in (request.headers or {}).items()
        if not k.startswith(LIBRARY_HEADERS) and k not in TRANSPORT_HEADERS
    }
    seen = {
        "id": request.id,
        "task": task.name,
        "args": request.args,
        "kwargs": request.kwargs,
        "headers": headers,
        "stamped_headers": request.stamped_headers,
        "stamps": request.stamps,
        "parent_id": request.parent_id,
        "root_id": request.root_id,
        "retries": request.retries,
        "group": request.group,
        "group_index": request.group_index,
        "chord": request.chord,
        "chain": request.chain,
        "callbacks": request.callbacks,
        "errbacks": request.errbacks,
        "reply_to": request.reply_to,
        "correlation_id": request.correlation_id,
        "replaced_task_nesting": request.replaced_task_nesting,
        "origin": request.origin,
        "ignore_result": request.ignore_result,
        "expires": request.expires,
        "eta": request.eta,
        "exchange": info.get("exchange"),
        "routing_key": info.get("routing_key"),
        "priority": info.get("priority"),
    }
    normalised: dict[str, Any] = json.loads(json.dumps(seen, sort_keys=True, default=str))
    return normalised


def run_units(task: Task, log: UnitLog, count: int, unit_seconds: float) -> None:
    """``e2e.units``' loop: units from the checkpoint on, each committed with its checkpoint."""
    lease = task.lease
    run = uuid.uuid4().hex
    for unit in range((lease.checkpoint or {}).get("next", 0), count):
        row = log.start(
            lease.job_id,
            unit,
            run=run,
            token=lease.token,
            attempt=lease.attempt,
            host=task.request.hostname or "",
        )
        if unit == GATE_UNIT:
            wait_for_gate()
        time.sleep(unit_seconds)
        with log.engine.begin() as connection:
            log.end(connection, row)
            task.checkpoint({"next": unit + 1}, connection=connection)
        task.stop_point()


def wait_for_gate() -> None:
    """Wait until the ``CANVAS_GATE`` file exists (at most ``GATE_TIMEOUT`` seconds)."""
    gate = os.environ.get(GATE_ENV)
    deadline = time.monotonic() + GATE_TIMEOUT
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)


def topic_queues(app: Celery, topic: str) -> list[Queue]:
    """The default queue (as Celery would declare it) and ``topic``'s queue, bound with
    ``media.#`` to the topic exchange ``topic``."""
    default = app.conf.task_default_queue
    return [
        Queue(default, Exchange(default, type="direct"), routing_key=default),
        Queue(topic, Exchange(topic, type="topic"), routing_key=TOPIC_BINDING),
    ]


def add_canvas_tasks(app: Celery, environ: Mapping[str, str] | None = None) -> Celery:
    """Add the canvas tasks to ``app`` and the topic route ``environ`` names, if any."""
    environ = os.environ if environ is None else environ
    topic = environ.get(TOPIC_ENV)
    if topic:
        app.conf.task_queues = topic_queues(app, topic)
    log = unit_log_for(app)

    def record(tag: str, task: Task, value: Any) -> None:
        item = {"task": task.name, "id": task.request.id, "value": value}
        records_for(app).add(tag, "calls", item)

    def attempt(task: Task, tag: str) -> dict[str, Any]:
        seen = identity(task)
        lease = task.lease
        records_for(app).add(
            tag,
            "attempts",
            {
                "job_id": lease.job_id,
                "attempt": lease.attempt,
                "host": task.request.hostname,
                "pid": os.getpid(),
                "identity": seen,
            },
        )
        return seen

    @app.task(shared=False, name="canvas.add")
    def plain_add(x: int, y: int) -> int:
        return x + y

    @app.task(bind=True, shared=False, name="canvas.record")
    def plain_record(self: Task, value: Any, tag: str) -> Any:
        record(tag, self, value)
        return value

    @app.task(bind=True, shared=False, name="canvas.sum_and_record")
    def plain_sum_and_record(self: Task, values: list[int], tag: str) -> int:
        total = sum(values)
        record(tag, self, total)
        return total

    @app.task(bind=True, shared=False, name="canvas.errback")
    def plain_errback(self: Task, task_id: str, tag: str) -> str:
        record(tag, self, task_id)
        return task_id

    @app.task(base=LeasedTask, bind=True, shared=False, name="canvas.units")
    def leased_units(self: Task, base: int, count: int, unit_seconds: float, *, tag: str) -> int:
        attempt(self, tag)
        run_units(self, log, count, unit_seconds)
        return base + count

    @app.task(base=LeasedTask, bind=True, shared=False, name="canvas.body")
    def leased_body(
        self: Task, results: list[int], count: int, unit_seconds: float, *, tag: str
    ) -> int:
        attempt(self, tag)
        run_units(self, log, count, unit_seconds)
        return sum(results) + count

    @app.task(base=LeasedTask, bind=True, shared=False, name="canvas.fails")
    def leased_fails(self: Task, count: int, unit_seconds: float, *, tag: str) -> None:
        attempt(self, tag)
        run_units(self, log, count, unit_seconds)
        raise RuntimeError(f"{tag} fails after its {count} units (attempt {self.lease.attempt})")

    @app.task(base=LeasedTask, bind=True, shared=False, name="canvas.context")
    def leased_context(self: Task, count: int, unit_seconds: float, *, tag: str) -> dict[str, Any]:
        seen = attempt(self, tag)
        run_units(self, log, count, unit_seconds)
        return seen

    @app.task(base=LeasedTask, bind=True, shared=False, name="canvas.replacer")
    def leased_replacer(self: Task, count: int, unit_seconds: float, add: int, *, tag: str) -> Any:
        attempt(self, tag)
        replacement = leased_units.s(0, count, unit_seconds, tag=f"{tag}:replacement")
        raise self.replace(chain(replacement, plain_add.s(add)))

    return app


def make_app(environ: Mapping[str, str] | None = None, *, name: str = "canvas_app") -> Celery:
    environ = os.environ if environ is None else environ
    return add_canvas_tasks(make_leased_app(environ, name=name, current=True), environ)


app = make_app(os.environ)
