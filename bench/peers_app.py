"""The Celery app of ``bench.peers``: ``bench/worker_app.py``'s app, plus one LeasedTask that
times a durable progress write in a real worker's pool process.

``peers.progress(calls, block, user_table, out_path)`` times, alternating in blocks of
``block`` (``bench.common.interleaved``), ``calls`` calls of each of:

- ``checkpoint``: ``self.checkpoint({"next": i})``, on its own (one autocommit statement on the
  store's connection);
- ``user UPDATE``: what a procrastinate user writes instead, procrastinate having no
  checkpoint: ``UPDATE <user_table> SET state = %s WHERE job_id = %s`` with the same JSON text,
  on a psycopg connection of the user's own in autocommit (one statement, one commit);
- ``unit + checkpoint``, ``unit + user UPDATE``, ``unit alone``: a unit of work's transaction
  (``with engine.begin()``: one ``INSERT`` into a table of the user's), with the checkpoint
  (``connection=`` that transaction) or the user's ``UPDATE`` in it, or nothing more;
- ``unit + same statement``: the statement that checkpoint sent (its text and driver
  parameters, read once), sent by hand in that transaction: what the library's Python costs
  around its statement.

It writes the seconds of every call to ``out_path`` (JSON).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import psycopg
import sqlalchemy as sa
from celery import Celery, Task

from bench.common import interleaved, steady
from bench.worker_app import CONFIG, make_app
from celery_leases import LeasedTask
from tests.support.driver import executed


def add_progress_task(app: Celery) -> None:
    @app.task(base=LeasedTask, bind=True, shared=False, name="peers.progress")
    def progress(self: Task, calls: int, block: int, user_table: str, out_path: str) -> None:
        url = sa.engine.make_url(self.app.conf.leases_database_url)
        engine = sa.create_engine(url)
        dsn = url.set(drivername="postgresql").render_as_string(False)
        job_id = self.request.id
        user = psycopg.connect(dsn, autocommit=True)
        update = f"UPDATE {user_table} SET state = %s WHERE job_id = %s"
        user.execute(f"INSERT INTO {user_table} VALUES (%s, '{{}}')", (job_id,))
        insert = sa.text(f"INSERT INTO {user_table}_units (job_id, n) VALUES (:job, :n)")
        update_sa = sa.text(f"UPDATE {user_table} SET state = :state WHERE job_id = :job")

        def checkpoint(i: int) -> None:
            self.checkpoint({"next": i})

        def user_update(i: int) -> None:
            user.execute(update, (json.dumps({"next": i}), job_id))

        def unit_checkpoint(i: int) -> None:
            with engine.begin() as connection:
                connection.execute(insert, {"job": job_id, "n": i})
                self.checkpoint({"next": i}, connection=connection)

        def unit_update(i: int) -> None:
            with engine.begin() as connection:
                connection.execute(insert, {"job": job_id, "n": i})
                connection.execute(update_sa, {"state": json.dumps({"next": i}), "job": job_id})

        def unit_same(i: int) -> None:
            with engine.begin() as connection:
                connection.execute(insert, {"job": job_id, "n": i})
                connection.exec_driver_sql(*same)

        def unit_alone(i: int) -> None:
            with engine.begin() as connection:
                connection.execute(insert, {"job": job_id, "n": i})

        variants: dict[str, Any] = {
            "checkpoint": checkpoint,
            "user UPDATE": user_update,
            "unit + checkpoint": unit_checkpoint,
            "unit + user UPDATE": unit_update,
            "unit + same statement": unit_same,
            "unit alone": unit_alone,
        }
        try:
            same = sent_by(engine, lambda: unit_checkpoint(calls))
            for call in variants.values():  # connections, prepared statements, SQLAlchemy's cache
                for i in range(10):
                    call(i)
            blocks = {name: steady(call) for name, call in variants.items()}
            times = interleaved(blocks, calls=calls, block=block)
        finally:
            user.close()
            engine.dispose()
        with open(f"{out_path}.part", "w") as out:
            json.dump(times, out)
        os.replace(f"{out_path}.part", out_path)  # whole, or not there


def sent_by(engine: sa.engine.Engine, call: Any) -> tuple[str, Any]:
    """The checkpoint's statement as ``call`` sent it in a transaction on ``engine`` (its
    text and driver parameters, read at the driver: what the ``same statement`` variant
    sends by hand, through ``exec_driver_sql``). The store runs it on the transaction's
    DBAPI connection, not through SQLAlchemy's execution."""
    with executed() as seen:
        call()
    if len(seen) != 1:  # one statement, or this is not like for like
        raise RuntimeError(f"a checkpoint in a transaction sent {len(seen)} statements")
    _, compiled, params = seen[0]
    return compiled.parameters(params)  # type: ignore[no-any-return]


if CONFIG in os.environ:
    app = make_app(json.loads(os.environ[CONFIG]), name="peers")
    add_progress_task(app)
    for logger in ("celery.app.trace", "celery.worker.strategy", "celery_leases"):
        logging.getLogger(logger).setLevel(logging.WARNING)
