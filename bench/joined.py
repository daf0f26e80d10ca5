"""A checkpoint in the caller's transaction against the user's own UPDATE in it (PostgreSQL).

A unit of work is a transaction of the user's on an SQLAlchemy connection (``with
engine.begin()``: an ``INSERT`` into a table of theirs), with one more write in it, or none:

- ``user UPDATE``: ``UPDATE <their table> SET state = :s WHERE job_id = :j`` (a progress row of
  their own, primary key; what a user writes without the library; it fences nothing);
- ``checkpoint``: ``store.checkpoint(..., connection=c)``, as ``self.checkpoint(state,
  connection=c)`` calls it: the statement runs on the transaction's DBAPI connection;
- ``checkpoint through SQLAlchemy``: the same, its statement executed by the SQLAlchemy
  connection (``Guarded``: the path of a connection with no transaction begun or of another
  driver, and every SQLAlchemy caller's until 2026-12-03);
- ``same statement``: the checkpoint's statement (text and driver parameters, read once at the
  driver) sent by hand in the transaction: the floor of the library's own work;
- ``unit alone``: nothing more.

Each variant's figure is its unit minus the unit alone (``added_ms``), alternating in blocks,
the order rotating. The job is held by a keeper's holder, as a worker's is.

    python -m bench.joined [--quick]
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from bench.common import interleaved, median_ms, p90_ms, parser, report, row, scratch, steady
from bench.operations import claim, keeper_session, open_store, register, renew_holder
from celery_leases.db.engine import Guarded
from celery_leases.db.joined import Joined
from tests.support.driver import executed
from tests.support.service import POSTGRES_URL

COLUMNS = "variant median_ms p90_ms added_ms added/user_update"


def units(
    url: str, table: str, checkpoint: Callable[[Any, int], Any]
) -> dict[str, Callable[[int], None]]:
    """The variants, each a unit of work with its write (``checkpoint(connection, i)``)."""
    engine = sa.create_engine(url)
    job = uuid.uuid4().hex
    with engine.begin() as c:
        c.exec_driver_sql(f"CREATE TABLE {table}_units (n text PRIMARY KEY)")
        c.exec_driver_sql(f"CREATE TABLE {table}_progress (job_id text PRIMARY KEY, state text)")
        c.exec_driver_sql(f"INSERT INTO {table}_progress VALUES ('{job}', '{{}}')")
    insert = sa.text(f"INSERT INTO {table}_units VALUES (:n)")
    update = sa.text(f"UPDATE {table}_progress SET state = :s WHERE job_id = :j")
    run = uuid.uuid4().hex[:8]

    def unit(write: Callable[[Any, int], Any]) -> Callable[[int], None]:
        def call(i: int) -> None:
            with engine.begin() as c:
                c.execute(insert, {"n": f"{run}-{write.__name__}-{i}"})
                write(c, i)

        return call

    def nothing(c: Any, i: int) -> None:
        return None

    def user_update(c: Any, i: int) -> None:
        c.execute(update, {"s": f'{{"next": {i}}}', "j": job})

    def through_sqlalchemy(c: Any, i: int) -> None:
        checkpoint(Joined(Guarded(c), c.info, pool=c.engine.pool), i)

    with executed() as seen, engine.begin() as c:
        checkpoint(c, 0)
    ((_, compiled, params),) = seen  # one statement, or this is not like for like
    sql, parameters = compiled.parameters(params)

    def same_statement(c: Any, i: int) -> None:
        c.exec_driver_sql(sql, parameters).all()

    return {
        "unit alone": unit(nothing),
        "user UPDATE": unit(user_update),
        "checkpoint": unit(checkpoint),
        "checkpoint through SQLAlchemy": unit(through_sqlalchemy),
        "same statement": unit(same_statement),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    calls, block = (1000, 50) if args.quick else (4000, 100)
    with scratch(POSTGRES_URL, "joined") as table:
        store = open_store(POSTGRES_URL, table)
        session = keeper_session(store)
        holder = uuid.uuid4().hex
        renew_holder(store, holder, session)
        job = f"joined-{uuid.uuid4().hex}"
        register(store, job)
        token = claim(store, job, holder)

        def checkpoint(connection: Any, i: int) -> None:
            if not store.checkpoint(job, token, f'{{"next": {i}}}', connection=connection)[0]:
                raise RuntimeError("checkpoint refused")

        try:
            variants = units(POSTGRES_URL, table, checkpoint)
            for call in variants.values():  # connections, prepared statements, caches
                for i in range(20):
                    call(-1 - i)
            times = interleaved(
                {name: steady(call) for name, call in variants.items()}, calls=calls, block=block
            )
        finally:
            session.close()
            with store.engine.begin() as c:
                for suffix in ("units", "progress"):
                    c.exec_driver_sql(f"DROP TABLE IF EXISTS {table}_{suffix}")
            store.engine.dispose()
    alone = median_ms(times["unit alone"])
    user = median_ms(times["user UPDATE"]) - alone
    rows = []
    for name, seconds in times.items():
        added = median_ms(seconds) - alone
        ratio = None if name == "unit alone" else added / user
        rows.append(row(COLUMNS, name, median_ms(seconds), p90_ms(seconds), added, ratio))
    title = f"a write in the caller's transaction, PostgreSQL ({calls} units each, ms)"
    report("joined", rows, quick=args.quick, title=title, block=block)


if __name__ == "__main__":
    main()
