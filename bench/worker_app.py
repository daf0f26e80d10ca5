"""The Celery app the worker benchmarks run (no-op and sleeping tasks, leased and plain).

Started by ``tests.support.worker`` with its settings in ``BENCH_CELERY_CONFIG``; every finished
task is counted in Redis from ``task_postrun``, after a LeasedTask recorded its finish.

``bench.floor_noop`` / ``bench.floor_sleep``: plain tasks that make the two writes a leased
task makes (before and after the body), as raw single-row autocommit ``UPDATE``s through
psycopg on a connection of the pool process's own (as the store connects), each process on a
row of its own of ``BENCH_FLOOR_TABLE``: what two durable writes per task cost a worker with
no library at all.

``BENCH_TIMELINE=<dir>`` (``bench.timeline``): each pool process stamps its jobs' moments on
the machine's monotonic clock (``task_prerun``, the body's start and end, each statement's
start and end: a LeasedTask's claim and finish, a floor task's writes, ``task_postrun``) and
writes them to ``<dir>/<pid>.json`` when it exits.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import task_postrun

from celery_leases import LeasedTask
from tests.support.worker import CeleryProcess, Spawner, Worker

CONFIG, COUNTER, RUN = "BENCH_CELERY_CONFIG", "BENCH_COUNTER_URL", "BENCH_RUN"
FLOOR_TABLE, TIMELINE = "BENCH_FLOOR_TABLE", "BENCH_TIMELINE"

#: This process's stamps, ``(monotonic seconds, moment)``, when ``BENCH_TIMELINE`` is set.
_stamps: list[tuple[float, str]] | None = [] if os.environ.get(TIMELINE) else None


def mark(moment: str) -> None:
    """Stamp ``moment`` now (``BENCH_TIMELINE``); nothing otherwise."""
    if _stamps is not None:
        _stamps.append((time.monotonic(), moment))


_writers: dict[int, Any] = {}


def raw_write(url: str) -> None:
    """One single-row autocommit UPDATE of this process's row of ``BENCH_FLOOR_TABLE``."""
    connection = _writers.get(os.getpid())
    if connection is None:  # one per pool process, made after the fork
        import psycopg
        import sqlalchemy as sa

        dsn = sa.engine.make_url(url).set(drivername="postgresql").render_as_string(False)
        connection = _writers[os.getpid()] = psycopg.connect(dsn, autocommit=True)
        connection.execute(
            f"INSERT INTO {os.environ[FLOOR_TABLE]} VALUES (%s, 0) ON CONFLICT DO NOTHING",
            (os.getpid(),),
        )
    mark("statement<")
    connection.execute(
        f"UPDATE {os.environ[FLOOR_TABLE]} SET v = v + 1 WHERE id = %s", (os.getpid(),)
    )
    mark("statement>")


def make_app(config: dict[str, Any], name: str = "bench") -> Celery:
    """The benchmark app with ``config`` (Celery and ``leases_*`` settings)."""
    app = Celery(name, set_as_current=False)
    app.conf.update({"broker_connection_retry_on_startup": True, **config})

    def noop(self: Task) -> None:
        mark("body<")
        mark("body>")

    def sleep(self: Task, seconds: float) -> None:
        mark("body<")
        time.sleep(seconds)
        mark("body>")

    def floor_noop(self: Task) -> None:
        raw_write(self.app.conf.leases_database_url)
        noop(self)
        raw_write(self.app.conf.leases_database_url)

    def floor_sleep(self: Task, seconds: float) -> None:
        raw_write(self.app.conf.leases_database_url)
        sleep(self, seconds)
        raw_write(self.app.conf.leases_database_url)

    for kind, body in (("noop", noop), ("sleep", sleep)):
        app.task(body, base=LeasedTask, bind=True, shared=False, name=f"bench.leased_{kind}")
        app.task(body, bind=True, shared=False, name=f"bench.plain_{kind}")
    app.task(floor_noop, bind=True, shared=False, name="bench.floor_noop")
    app.task(floor_sleep, bind=True, shared=False, name="bench.floor_sleep")
    return app


def start_worker(
    spawner: Spawner,
    config: dict[str, Any],
    *,
    counter_url: str,
    run: str,
    concurrency: int = 1,
    floor_table: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> Worker:
    """A ready ``celery worker -P prefork -c <concurrency>`` of this app, counting as ``run``
    (``floor_table``: the table of the ``bench.floor_*`` tasks' writes; ``extra_env``: more of
    its environment)."""
    env = {CONFIG: json.dumps(config), COUNTER: counter_url, RUN: run, **(extra_env or {})}
    if floor_table is not None:
        env[FLOOR_TABLE] = floor_table
    return spawner.worker(__name__, env=env, concurrency=concurrency, timeout=60)


def publish(app: Celery, task: str, count: int, args: tuple[Any, ...] = ()) -> None:
    """Send ``count`` messages of ``task`` on one producer."""
    with app.producer_or_acquire() as producer:
        for _ in range(count):
            app.tasks[task].apply_async(args, producer=producer)


def wait_done(
    counter_url: str, run: str, total: int, *, worker: CeleryProcess, timeout: float
) -> tuple[float, float]:
    """Wait until ``total`` tasks of ``run`` finished; their first and last completion times."""
    client = redis.Redis.from_url(counter_url)
    deadline = time.monotonic() + timeout
    try:
        while (done := int(client.get(f"{run}:done") or 0)) < total:
            if not worker.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{done}/{total} tasks done; {worker.log_tail()}")
            time.sleep(0.02)
        return float(client.get(f"{run}:first") or 0), float(client.get(f"{run}:last") or 0)
    finally:
        client.close()


_clients: dict[int, redis.Redis] = {}


def _count(task: Any = None, **_: Any) -> None:
    if task is None or not task.name.startswith("bench."):
        return
    if os.getpid() not in _clients:  # one client per pool process, made after the fork
        _clients[os.getpid()] = redis.Redis.from_url(os.environ[COUNTER])
    client = _clients[os.getpid()]
    run, now = os.environ[RUN], time.time()
    pipe = client.pipeline(transaction=False)
    pipe.incr(f"{run}:done")
    pipe.setnx(f"{run}:first", now)
    pipe.set(f"{run}:last", now)
    pipe.execute()


def _stamp_statements() -> None:
    """Stamp the start and end of a LeasedTask's claim and finish statements (``mark``), and
    each job's ``task_prerun`` and ``task_postrun`` (before the counter's own write)."""
    from celery.signals import task_prerun, worker_process_shutdown

    from celery_leases.db.store.worker import AttemptOps

    def stamped(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            mark("statement<")
            try:
                return method(*args, **kwargs)
            finally:
                mark("statement>")

        return call

    AttemptOps.claim = stamped(AttemptOps.claim)  # type: ignore[method-assign]
    AttemptOps.finish = stamped(AttemptOps.finish)  # type: ignore[method-assign]
    task_prerun.connect(lambda **_: mark("prerun"), weak=False)
    task_postrun.connect(lambda **_: mark("postrun"), weak=False)

    def write(**_: Any) -> None:
        path = os.path.join(os.environ[TIMELINE], f"{os.getpid()}.json")
        with open(path, "w") as file:
            json.dump(_stamps, file)

    worker_process_shutdown.connect(write, weak=False)


if CONFIG in os.environ:
    app = make_app(json.loads(os.environ[CONFIG]))
    if _stamps is not None:
        _stamp_statements()
    task_postrun.connect(_count, weak=False)
    # The worker logs at INFO so that tests.support.worker sees it ready; a line per task would cost
    # both variants a write each, so the per-task loggers are quieter.
    for logger in ("celery.app.trace", "celery.worker.strategy", "celery_leases"):
        logging.getLogger(logger).setLevel(logging.WARNING)

if os.environ.get("BENCH_PROFILE"):
    # cProfile of each pool process, written to $BENCH_PROFILE/<pid>.prof on its exit, and of
    # the worker's main process from when its pool is up, to main-<pid>.prof.
    import cProfile

    from celery.signals import (
        worker_process_init,
        worker_process_shutdown,
        worker_ready,
        worker_shutdown,
    )

    def _profile_between(start: Any, stop: Any, prefix: str) -> None:
        profile = cProfile.Profile()
        start.connect(lambda **_: profile.enable(), weak=False)

        def write(**_: Any) -> None:
            profile.disable()
            name = f"{prefix}{os.getpid()}.prof"
            profile.dump_stats(os.path.join(os.environ["BENCH_PROFILE"], name))

        stop.connect(write, weak=False)

    _profile_between(worker_process_init, worker_process_shutdown, "")
    _profile_between(worker_ready, worker_shutdown, "main-")
