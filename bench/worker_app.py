"""The Celery app the worker benchmarks run: the same no-op and sleeping tasks, leased and plain.

A worker runs it as ``celery -A bench.worker_app worker``, configured by environment variables
(see :func:`worker_env`). The benchmark process builds the same app with :func:`make_app` to
publish. Every finished task is counted in Redis from ``task_postrun`` (after ``LeasedTask``
has recorded the finish), with one pipelined round trip: the count, the first and the last
completion time (epoch seconds of this machine), and the SQL statements the pool process sent
since its previous task, by kind.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

from celery import Celery, Task
from celery.signals import task_postrun, worker_ready

from celery_leases import LeasedTask

#: The Celery settings travel as JSON in this variable; the Redis counters' URL and key prefix
#: in the two after it.
CONFIG_VAR = "BENCH_CELERY_CONFIG"
COUNTER_URL_VAR = "BENCH_COUNTER_URL"
RUN_VAR = "BENCH_RUN"


def worker_env(config: dict[str, Any], *, counter_url: str, run: str) -> dict[str, str]:
    """Environment variables for a worker of this app."""
    return {CONFIG_VAR: json.dumps(config), COUNTER_URL_VAR: counter_url, RUN_VAR: run}


def make_app(config: dict[str, Any], name: str = "bench") -> Celery:
    """The benchmark app with ``config`` (Celery and ``leases_*`` settings)."""
    app = Celery(name, set_as_current=False)
    app.conf.update({"broker_connection_retry_on_startup": True, **config})

    def noop(self: Task) -> None:
        return None

    def sleep(self: Task, seconds: float) -> None:
        time.sleep(seconds)

    for name, run, base in (
        ("bench.leased_noop", noop, LeasedTask),
        ("bench.plain_noop", noop, Task),
        ("bench.leased_sleep", sleep, LeasedTask),
        ("bench.plain_sleep", sleep, Task),
    ):
        app.task(run, base=base, bind=True, shared=False, name=name)
    return app


# -- counting, in the worker's processes -------------------------------------------------------

_redis: dict[int, Any] = {}
_statements: Counter[str] = Counter()


def _client() -> Any:
    import redis

    pid = os.getpid()
    if pid not in _redis:
        _redis[pid] = redis.Redis.from_url(os.environ[COUNTER_URL_VAR])
    return _redis[pid]


def statement_kind(sql: str) -> str:
    """claim, finish, checkpoint, renew, register, or the statement's first word."""
    head = sql.lstrip()[:6].upper()
    if head == "UPDATE":
        if "attempts=" in sql:
            return "claim"
        if "finished_at=" in sql:
            return "finish"
        if "checkpoint=" in sql:
            return "checkpoint"
        if "renewed_at=" in sql:
            return "renew"
        return "update"
    if head == "INSERT":
        return "register"
    return head.lower()


def _count_sql() -> None:
    import sqlalchemy as sa

    def on_execute(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        _statements[statement_kind(statement)] += 1

    def on_checkout(*_: Any) -> None:
        _statements["checkout"] += 1

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", on_execute)
    sa.event.listen(sa.pool.Pool, "checkout", on_checkout)


def _on_task_postrun(task: Any = None, **_: Any) -> None:
    if task is None or not str(task.name).startswith("bench."):
        return
    run = os.environ[RUN_VAR]
    now = time.time()
    pipe = _client().pipeline(transaction=False)
    pipe.incr(f"{run}:done")
    pipe.setnx(f"{run}:first", now)
    pipe.set(f"{run}:last", now)
    if _statements:
        for kind, count in _statements.items():
            pipe.hincrby(f"{run}:sql", kind, count)
        _statements.clear()
    pipe.execute()


def _on_worker_ready(**_: Any) -> None:
    _client().set(f"{os.environ[RUN_VAR]}:ready", time.time())


if CONFIG_VAR in os.environ:
    app = make_app(json.loads(os.environ[CONFIG_VAR]))
    _count_sql()
    task_postrun.connect(_on_task_postrun, weak=False)
    worker_ready.connect(_on_worker_ready, weak=False)
