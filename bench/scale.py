"""Scale on PostgreSQL: a reaper pass over many jobs bound to keepers' holders, and the renew
tick of a keeper holding 1, 50 and 500 leases (each next to its floor: one raw single-row
upsert on the same connection).

1,000,000 jobs (``--quick``: 200,000) copied from rows the store wrote, each claimed as a
worker claims it: bound to its keeper's holder row (``<table>_holders``, made by
``Store.renew_holder`` on the keeper's session), so a running job's lease end is its holder's
last renewal plus its duration. 1 % running under a holder that stopped renewing two hours ago
(a frozen or cut-off worker: its session lives, its leases ran out an hour ago), 1 % running
under a live holder, 1 % past the retention, the rest recently done. The pass is the real
``celery_leases.reap`` task (it ends the stale holder's leases through the holder join, then
re-publishes them to a private Redis database, then purges); idle passes follow.

A renew tick is one upsert of the keeper's holder row whatever the number of leases bound to
it: three holders, with 1, 50 and 500 jobs claimed and bound to each.

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
from bench.operations import (
    OWNER,
    claim,
    engine,
    finish,
    keeper_session,
    open_store,
    raw_upsert,
    register,
    renew_holder,
    session_connection,
)
from celery_leases.db.schema import holders_table
from celery_leases.reaper import register_reaper
from celery_leases.settings import DEFAULTS
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, private_redis_url

#: The keepers' holder rows: the live one, the one that stopped renewing, and one per tick.
LIVE, STALE = "scale-live", "scale-stale"
HELD = (1, 50, 500)
#: Seconds the stale holder's renewals (and its jobs' own last renewal) are set back: past
#: the lease (``duration`` 3600 s) by an hour.
STALE_FOR = 7200

#: What is set by hand on the rows the store wrote (the rest is copied as it is): the stale
#: holder's jobs' own last renewal (the claim's), and the old jobs' end.
AGED = {
    "expired": f"renewed_at = renewed_at - {STALE_FOR}, claimed_at = claimed_at - {STALE_FOR}",
    "old": "finished_at = finished_at - {}",
}


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


def result(measure: str, jobs: int | None, seconds: list[float]) -> dict[str, Any]:
    """A row of the table: ``jobs`` handled per call (None: no job), median call in ms, jobs
    per second."""
    rate = jobs / statistics.median(seconds) if jobs else None
    return row("measure jobs median_ms jobs_per_s", measure, jobs, median_ms(seconds), rate)


def bound(connection: sa.Connection, table: str, holder: str) -> int:
    """How many running jobs ``holder`` keeps (bound to it, no expiry of their own)."""
    sql = (
        f"SELECT count(*) FROM {table} WHERE holder = :holder AND state = 'running'"
        " AND expires_at IS NULL"
    )
    return int(connection.execute(sa.text(sql), {"holder": holder}).scalar_one())


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    total = 200_000 if args.quick else 1_000_000
    copies = {"expired": total // 100, "live": total // 100, "old": total // 100}
    copies["done"] = total - sum(copies.values())
    rows = []
    with scratch(POSTGRES_URL, "scale") as table, private_redis_url() as broker:
        store = open_store(POSTGRES_URL, table, duration=3600.0)
        # The keepers' holders, on one keeper session of this process (so the stale one's
        # session lives: the reaper ends its jobs' leases by their end, not as orphans).
        session = keeper_session(store)
        for holder in (LIVE, STALE):
            renew_holder(store, holder, session)
        tokens = {}
        for kind in copies:
            register(store, kind)
            tokens[kind] = claim(store, kind, STALE if kind == "expired" else LIVE)
            if kind in ("old", "done"):
                finish(store, kind, tokens[kind])
        with engine(store).begin() as connection:
            sql = f"UPDATE {table}_holders SET renewed_at = renewed_at - {STALE_FOR},"
            sql += f" expires_at = expires_at - {STALE_FOR} WHERE id = :holder"
            connection.execute(sa.text(sql), {"holder": STALE})
            fill(connection, table, copies)
            held = {
                kind: bound(connection, table, h)
                for kind, h in (("expired", STALE), ("live", LIVE))
            }
        if held != {"expired": copies["expired"], "live": copies["live"]}:
            raise RuntimeError(f"running jobs bound to their holders: {held}, not {copies}")
        with engine(store).connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(sa.text(f"VACUUM ANALYZE {table}"))
            c.execute(sa.text(f"VACUUM ANALYZE {table}_holders"))
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
                if label == "reaper pass" and len(outcomes[0]["republished"]) != copies["expired"]:
                    raise RuntimeError(
                        f"the pass re-published {len(outcomes[0]['republished'])} jobs"
                    )
                outcomes.clear()
        finally:
            close_app(app)
        # A holder per tick, each keeping its jobs, claimed and bound as a worker's.
        for n in HELD:
            renew_holder(store, f"scale-held-{n}", session)
            for k in range(n):
                register(store, f"held{n}-{k}")
                claim(store, f"held{n}-{k}", f"scale-held-{n}")
        with engine(store).connect() as connection:
            for n in HELD:
                if bound(connection, table, f"scale-held-{n}") != n:
                    raise RuntimeError(f"the holder of {n} leases does not keep them all")
        # The floor: one hand-written single-row upsert of a table of the holders' shape, on
        # the keeper session's connection in autocommit; alternated with the ticks.
        floor = holders_table(sa.MetaData(), f"{table}_raw")
        floor.create(engine(store))
        upsert, raw = raw_upsert("postgresql", floor.name), session_connection(session)

        def upserted() -> None:
            now = time.time()
            raw.execute(upsert, ("raw-keeper", OWNER, now, now + 3600.0, now))

        upserted()
        for n in HELD:
            tick = functools.partial(renew_holder, store, f"scale-held-{n}", session)
            times: dict[str, list[float]] = {"tick": [], "raw": []}
            for _ in range(20 if args.quick else 100):
                times["tick"] += timed(tick, 1)
                times["raw"] += timed(upserted, 1)
            leases = "1 lease" if n == 1 else f"{n} leases"
            rows.append(result(f"renew tick, {leases} held", n, times["tick"]))
            rows.append(result("raw upsert of one holder row, next to it", None, times["raw"]))
        session.close()
        engine(store).dispose()
    title = f"Reaper and renewals over {total:,} jobs bound to holders (PostgreSQL)"
    report("scale", rows, quick=args.quick, title=title, jobs=copies)


if __name__ == "__main__":
    main()
