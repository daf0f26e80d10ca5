"""Scale on PostgreSQL: a reaper pass over many jobs, and renew ticks of 1, 50 and 500 leases
(each next to its floor: one raw UPDATE of the same rows on the same connection).

1,000,000 jobs (``--quick``: 200,000) copied from rows the store wrote: 1 % with an expired
lease, 1 % live, 1 % past the retention, the rest recently done. The pass is the real
``celery_leases.reap`` task, re-publishing to a private Redis database; idle passes follow.

    python -m bench.scale [--quick]
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from celery import Celery

from bench.common import median_ms, parser, report, row, scratch
from bench.operations import claim, engine, finish, open_store, register, renew
from celery_leases.reaper import register_reaper
from celery_leases.settings import DEFAULTS
from tests.support.driver import direct_connection
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, private_redis_url

#: The renew tick's floor: an UPDATE of the same rows' two lease columns, nothing else.
RAW_RENEW = (
    "UPDATE {table} SET expires_at = expires_at + 0.001,"
    " renewed_at = extract(epoch from clock_timestamp()) WHERE id = ANY(%s)"
)

#: What is set by hand on the rows the store wrote (the rest is copied as it is).
AGED = {"expired": "expires_at = expires_at - 7200", "old": "finished_at = finished_at - {}"}


def fill(connection: sa.Connection, table: str, copies: dict[str, int]) -> None:
    """Replace each row ``kind`` by ``copies[kind]`` copies of it, ids ``<kind>-<n>``."""
    names = [f'"{c["name"]}"' for c in sa.inspect(connection).get_columns(table)]
    retention = float(DEFAULTS["retention"]) + 3600
    for kind, count in copies.items():
        if kind in AGED:
            sql = f"UPDATE {table} SET {AGED[kind].format(retention)} WHERE id = :kind"
            connection.execute(sa.text(sql), {"kind": kind})
        values = ", ".join(f"'{kind}-' || g" if name == '"id"' else name for name in names)
        sql = f"INSERT INTO {table} ({', '.join(names)}) SELECT {values} FROM {table}"
        sql += f", generate_series(1, {count}) AS g WHERE id = :kind"
        connection.execute(sa.text(sql), {"kind": kind})
        connection.execute(sa.text(f"DELETE FROM {table} WHERE id = :kind"), {"kind": kind})


def timed(call: Callable[[], Any], times: int) -> list[float]:
    """Seconds of each of ``times`` calls of ``call``."""
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return seconds


def result(measure: str, jobs: int, seconds: list[float]) -> dict[str, Any]:
    """A row of the table: ``jobs`` handled per call, median call in ms, jobs per second."""
    rate = jobs / statistics.median(seconds) if jobs else None
    return row("measure jobs median_ms jobs_per_s", measure, jobs, median_ms(seconds), rate)


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    total = 200_000 if args.quick else 1_000_000
    copies = {"expired": total // 100, "live": total // 100, "old": total // 100}
    copies["done"] = total - sum(copies.values())
    rows = []
    with scratch(POSTGRES_URL, "scale") as table, private_redis_url() as broker:
        store = open_store(POSTGRES_URL, table, duration=3600.0)
        tokens = {}
        for kind in copies:
            register(store, kind)
            tokens[kind] = claim(store, kind)
            if kind in ("old", "done"):
                finish(store, kind, tokens[kind])
        with engine(store).begin() as connection:
            fill(connection, table, copies)
        with engine(store).connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(sa.text(f"VACUUM ANALYZE {table}"))
        app = Celery("bench-scale", set_as_current=False)
        app.conf.update(broker_url=broker, leases_database_url=POSTGRES_URL, leases_table=table)
        register_reaper(app)
        reap, outcomes = app.tasks["celery_leases.reap"], []
        try:
            for label, passes in (("reaper pass", 1), ("idle reaper pass", 5)):
                seconds = timed(lambda: outcomes.append(reap.apply().get()), passes)
                jobs = sum(
                    len(o["republished"]) + len(o["gave_up"]) + o["purged"] for o in outcomes
                )
                rows.append(result(f"{label}, median of {passes}", jobs // passes, seconds))
                outcomes.clear()
        finally:
            close_app(app)
        raw = direct_connection(store)
        for held in (1, 50, 500):
            leases = [(f"live-{n}", tokens["live"]) for n in range(1, held + 1)]
            ids = [job_id for job_id, _ in leases]
            # The floor: one statement writing the same rows, found by primary key, on the
            # same connection in autocommit; alternated with the ticks.
            same_rows = functools.partial(raw.execute, RAW_RENEW.format(table=table), (ids,))
            times: dict[str, list[float]] = {"tick": [], "raw": []}
            for _ in range(20 if args.quick else 100):
                times["tick"] += timed(functools.partial(renew, store, leases), 1)
                times["raw"] += timed(same_rows, 1)
            rows.append(result(f"renew tick, {held} leases held", held, times["tick"]))
            rows.append(result(f"raw UPDATE of the same {held} rows", held, times["raw"]))
        engine(store).dispose()
    title = f"Reaper and renewals over {total:,} jobs (PostgreSQL)"
    report("scale", rows, quick=args.quick, title=title, jobs=copies)


if __name__ == "__main__":
    main()
