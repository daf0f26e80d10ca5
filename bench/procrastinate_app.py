"""The procrastinate side of ``bench.peers``: the same jobs as the Celery side, and a worker.

Tasks (synchronous functions, as a Celery team's tasks are; procrastinate runs each in a
thread of its worker's event loop):

- ``peers.noop()`` and ``peers.sleep(seconds)``: each ends with the Redis completion count the
  Celery tasks of ``bench/worker_app.py`` make from ``task_postrun`` (``BENCH_COUNTER_URL``,
  ``BENCH_RUN``), so both sides pay the same for being counted.
- ``peers.units(count, unit_seconds, log_table)``: the 16-unit job of ``bench/recovery.py``
  (the unit log of ``tests/support/unit_log.py``). procrastinate has no checkpoint, so the task
  keeps what a user would write: its own progress row (``<log_table>_progress``, keyed by the
  job's id, which a retry keeps), read at the start and upserted in the transaction that
  commits each unit, as ``self.checkpoint(..., connection=...)`` is on the leased side.
- ``peers.retry_stalled_jobs``, registered when ``BENCH_PROCRASTINATE_RETRY_EVERY`` is set:
  the periodic task of procrastinate's "Retry stalled jobs" how-to, every that many seconds
  (cron's sixth column), with ``seconds_since_heartbeat`` from
  ``BENCH_PROCRASTINATE_STALLED``.

The worker (one process, ``--concurrency`` jobs at a time, heartbeat every ``--heartbeat`` s,
workers silent for ``--stalled`` s pruned at start) logs a ready line once it is registered:

    python -m bench.procrastinate_app --name NAME [--concurrency N] [--heartbeat S] [--stalled S]

``BENCH_PROCRASTINATE_DSN`` is the database (libpq conninfo).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import procrastinate
import redis
import sqlalchemy as sa
from procrastinate.job_context import JobContext
from procrastinate.worker import Worker
from psycopg.conninfo import make_conninfo

from tests.support.unit_log import UnitLog

DSN, COUNTER, RUN = "BENCH_PROCRASTINATE_DSN", "BENCH_COUNTER_URL", "BENCH_RUN"
RETRY_EVERY, STALLED = "BENCH_PROCRASTINATE_RETRY_EVERY", "BENCH_PROCRASTINATE_STALLED"
#: Where ``peers.units`` logs its units: a SQLAlchemy URL of the same database.
UNITS_URL = "BENCH_UNITS_URL"

_clients: dict[int, redis.Redis] = {}
_logs: dict[str, UnitLog] = {}


def count() -> None:
    """Count one finished job of ``BENCH_RUN`` in Redis, as ``bench.worker_app._count``."""
    client = _clients.get(os.getpid())
    if client is None:
        client = _clients[os.getpid()] = redis.Redis.from_url(os.environ[COUNTER])
    run, now = os.environ[RUN], time.time()
    pipe = client.pipeline(transaction=False)
    pipe.incr(f"{run}:done")
    pipe.setnx(f"{run}:first", now)
    pipe.set(f"{run}:last", now)
    pipe.execute()


def unit_log(table: str) -> UnitLog:
    if table not in _logs:
        _logs[table] = UnitLog(os.environ[UNITS_URL], table)
    return _logs[table]


def make_app(dsn: str, **pool: Any) -> procrastinate.App:
    """The app on the database ``dsn`` (libpq conninfo), its connector procrastinate's
    psycopg one with its default pool (``pool``: other arguments of the pool)."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn, **pool))

    @app.task(name="peers.noop")
    def noop() -> None:
        count()

    @app.task(name="peers.sleep")
    def sleep(seconds: float) -> None:
        time.sleep(seconds)
        count()

    @app.task(name="peers.units", pass_context=True)
    def units(context: JobContext, count: int, unit_seconds: float, log_table: str) -> int:
        log = unit_log(log_table)
        job_id = str(context.job.id)
        progress = f"{log_table}_progress"
        with log.engine.connect() as connection:  # the user's own row: where the last run got to
            read = sa.text(f"SELECT next_unit FROM {progress} WHERE job_id = :job")
            first = connection.execute(read, {"job": job_id}).scalar() or 0
        run = uuid.uuid4().hex
        save = sa.text(
            f"INSERT INTO {progress} (job_id, next_unit) VALUES (:job, :next) "
            "ON CONFLICT (job_id) DO UPDATE SET next_unit = excluded.next_unit"
        )
        for unit in range(first, count):
            row = log.start(
                job_id,
                unit,
                run=run,
                token=None,
                attempt=context.job.attempts,
                host=context.worker_name or "",
            )
            time.sleep(unit_seconds)
            with log.engine.begin() as connection:
                log.end(connection, row)
                connection.execute(save, {"job": job_id, "next": unit + 1})
        return count

    if RETRY_EVERY in os.environ:
        every = int(float(os.environ[RETRY_EVERY]))
        stalled = float(os.environ[STALLED])

        # procrastinate's how-to "Retry stalled jobs", at a cron of every ``every`` seconds.
        @app.periodic(cron=f"* * * * * */{every}")
        @app.task(name="peers.retry_stalled_jobs", queueing_lock="retry_stalled_jobs")
        async def retry_stalled_jobs(timestamp: int) -> None:
            stalled_jobs = await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=stalled)
            for job in stalled_jobs:
                await app.job_manager.retry_job(job)

    return app


def progress_table(name: str) -> sa.Table:
    """The user's progress rows of ``peers.units``."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("next_unit", sa.Integer, nullable=False),
    )


async def run_worker(app: procrastinate.App, options: dict[str, Any]) -> None:
    async with app.open_async():
        worker = Worker(app, **options)
        running = asyncio.create_task(worker.run())
        while worker.worker_id is None and not running.done():
            await asyncio.sleep(0.01)
        print(f"procrastinate worker {worker.worker_id} ready.", flush=True)
        await running


def main(argv: Sequence[str] | None = None) -> None:
    command = argparse.ArgumentParser(description="A procrastinate worker of bench.peers.")
    command.add_argument("--name", required=True)
    command.add_argument("--concurrency", type=int, default=1)
    command.add_argument("--heartbeat", type=float, default=10.0, help="seconds (10)")
    command.add_argument("--stalled", type=float, default=30.0, help="seconds (30)")
    args = command.parse_args(argv)
    # Per-job lines off, as on the Celery side; warnings and errors still show.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    options = {
        "name": args.name,
        "concurrency": args.concurrency,
        "update_heartbeat_interval": args.heartbeat,
        "stalled_worker_timeout": args.stalled,
    }
    # Named in pg_stat_activity, where bench.peers sees it listen.
    app = make_app(make_conninfo(os.environ[DSN], application_name=args.name))
    asyncio.run(run_worker(app, options))


if __name__ == "__main__":
    main()
