"""What a checkpoint's statement costs beyond a bare UPDATE, without the library's Python.

On one raw psycopg connection in autocommit, statements prepared, each variant on a job row of
its own (recorded and claimed through the store, bound to a holder, as a worker's claim is),
in interleaved blocks of 50 with the same busy pause (50 us, spinning) before every call, so
that the round trip after a pause (section 17) weighs the same on every side:

- ``bare``: ``UPDATE t SET checkpoint = %s WHERE id = %s``: a user's own;
- ``bare + fence``: the same, also fenced by token and state;
- ``library``: the library's checkpoint statement, as it sends it (its text and its
  parameters read at the driver from a real ``Store.checkpoint`` call): fenced, skipping a row
  with a stop request, returning nothing;
- ``library + returning``: the same returning ``stop_requested``, as it sent it before it
  skipped a row with a stop request (it sends that form only after skipping one);
- ``checkpoint only``: fenced, setting ``checkpoint`` and ``checkpoint_at`` only (no renewal
  columns), returning nothing: what a lease kept by its holder row strictly needs.

Each call saves a checkpoint of its own (~100 B). Medians in microseconds and the ratio to the
bare UPDATE.

    python -m bench.checkpoint_sql [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from bench.common import parser, report, row, scratch
from bench.operations import claim, keeper_session, open_store, register, renew_holder
from tests.support.driver import executed
from tests.support.service import POSTGRES_URL

COLUMNS = "variant median_us p90_us ratio"
PAUSE = 50e-6
HOLDER = "bench-sql"


def variants(table: str, library: str) -> dict[str, str]:
    fence = "id = %(b_id)s AND token = %(b_token)s AND state = 'running'"
    now = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
    return {
        "bare": f"UPDATE {table} SET checkpoint = %(b_checkpoint)s WHERE id = %(b_id)s",
        "bare + fence": f"UPDATE {table} SET checkpoint = %(b_checkpoint)s WHERE {fence}",
        "library": library,
        "library + returning": f"{library} RETURNING {table}.stop_requested",
        "checkpoint only": (
            f"UPDATE {table} SET checkpoint = %(b_checkpoint)s, checkpoint_at = {now} WHERE {fence}"
        ),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    rounds = 6 if args.quick else 40
    with scratch(POSTGRES_URL, "ckptsql") as table:
        store = open_store(POSTGRES_URL, table)
        session = keeper_session(store)
        renew_holder(store, HOLDER, session)
        register(store, "probe")
        token = claim(store, "probe", HOLDER)
        with executed() as seen:
            store.checkpoint("probe", token, '{"probe": 1}')
        ((_, compiled, params),) = seen
        library, base = compiled.parameters(params)
        sqls = variants(table, library)
        rows: dict[str, tuple[str, int]] = {}
        for name in sqls:
            job_id = f"row-{name.replace(' ', '-')}"
            register(store, job_id)
            rows[name] = (job_id, claim(store, job_id, HOLDER))
        url = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
        connection = psycopg.connect(url, autocommit=True)
        times: dict[str, list[float]] = {name: [] for name in sqls}
        n = 0
        clock = time.perf_counter
        try:
            for round_number in range(rounds):
                names = list(sqls)
                shift = round_number % len(names)
                for name in names[shift:] + names[:shift]:
                    job_id, job_token = rows[name]
                    for _ in range(50):
                        n += 1
                        state = json.dumps({"done": f"{n:08d}", "cursor": os.urandom(30).hex()})
                        values: dict[str, Any] = base | {
                            "b_id": job_id, "b_token": job_token, "b_checkpoint": state,
                        }  # fmt: skip
                        until = clock() + PAUSE
                        while clock() < until:
                            pass
                        started = clock()
                        cursor = connection.execute(sqls[name], values, prepare=True)
                        if cursor.description:
                            cursor.fetchall()
                        times[name].append(clock() - started)
        finally:
            connection.close()
            session.close()
            store.engine.dispose()
    bare = statistics.median(times["bare"])
    result = [
        row(
            COLUMNS,
            name,
            statistics.median(seconds) * 1e6,
            statistics.quantiles(seconds, n=10)[-1] * 1e6,
            statistics.median(seconds) / bare,
        )
        for name, seconds in times.items()
    ]
    title = f"A checkpoint statement vs a bare UPDATE, raw psycopg ({rounds * 50} calls each)"
    report("checkpoint_sql", result, quick=args.quick, title=title, library_sql=library)


if __name__ == "__main__":
    main()
