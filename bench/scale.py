"""Scale on PostgreSQL: a reaper pass over 1,000,000 jobs, 32 concurrent claimers, renew ticks.

1. A table of 1,000,000 jobs (``INSERT ... SELECT generate_series`` into a table of this run's
   own, dropped afterwards): 10,000 running with an expired lease, 10,000 running with a live
   one, 10,000 queued, 10,000 finished more than the retention ago (purgeable), the rest done.
   A reaper pass is timed at the store level as ``celery_leases.reaper.reap`` runs it
   (``Store.reap`` in batches of ``leases_reap_batch`` until a short batch, then ``Store.purge``
   the same way; publishing left out), also with one batch of 10,000, and idle (nothing to do:
   what every pass costs between crashes). ``EXPLAIN (ANALYZE, BUFFERS)`` of the statements
   shows which index each one uses.
2. Claims per second with 32 concurrent claimers (processes, one connection each) over distinct
   queued jobs, next to 1 claimer and to 32 processes doing a raw single-row UPDATE + COMMIT.
3. Renew ticks of a process holding 1, 50 and 500 leases: seconds per tick (one statement).

    python -m bench.scale [--quick]
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from bench.common import (
    POSTGRES_URL,
    StatementCounter,
    arguments,
    drop_tables,
    print_table,
    reachable,
    scratch_name,
    settings,
    summary,
    write_result,
)
from celery_leases.config import DEFAULTS
from celery_leases.reaper import MAX_BATCHES
from celery_leases.store import Store

RETENTION = float(DEFAULTS["retention"])


def fill(store: Store, *, total: int, expired: int, live: int, queued: int, old: int) -> float:
    """Insert ``total`` jobs with ``INSERT ... SELECT generate_series``; the seconds it took.

    Rows 1..expired run with an expired lease (half with a checkpoint), then ``live`` running
    with a live lease, ``queued`` queued, ``old`` done before the retention, the rest done.
    """
    t = store.table.name
    a, b, c, d = expired, expired + live, expired + live + queued, expired + live + queued + old
    sql = f"""
    INSERT INTO {t} (id, task, args, kwargs, options, state, owner, token, duration, expires_at,
        attempts, stalled_attempts, checkpoint, created_at, claimed_at, renewed_at,
        checkpoint_at, finished_at, schema_version)
    SELECT 'job-' || lpad(g::text, 8, '0'), 'bench.noop', '[1, 2]', '{{}}', '{{}}',
        CASE WHEN g <= {b} THEN 'running' WHEN g <= {c} THEN 'queued' ELSE 'done' END,
        CASE WHEN g <= {b} THEN 'host' || (g % 64) || '/1' END,
        1, 30.0,
        CASE WHEN g <= {a} THEN now_s - 5 - (g % 600)
             WHEN g <= {b} THEN now_s + 3600 END,
        1, 0,
        CASE WHEN g <= {a} AND g % 2 = 0 THEN '{{"next": 5}}' END,
        now_s - 86400 * 10 + g * 0.5,
        CASE WHEN g <= {b} THEN now_s - 900 END,
        CASE WHEN g <= {b} THEN now_s - 700 END,
        CASE WHEN g <= {a} AND g % 2 = 0 THEN now_s - 800 END,
        CASE WHEN g > {c} AND g <= {d} THEN now_s - {RETENTION} - 3600 - g
             WHEN g > {d} THEN now_s - (g % 86400) END,
        1
    FROM generate_series(1, {total}) AS g,
         (SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8 AS now_s) AS clock
    """
    started = time.perf_counter()
    with store.engine.begin() as connection:
        connection.execute(sa.text(sql))
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(sa.text(f"VACUUM ANALYZE {t}"))
    return time.perf_counter() - started


def reset_expired(store: Store, expired: int) -> None:
    """Put rows 1..expired back to running with an expired lease (after a pass reaped them)."""
    t = store.table.name
    with store.engine.begin() as connection:
        connection.execute(
            sa.text(f"""
            UPDATE {t} SET state = 'running', owner = 'host/1', stalled_attempts = 0,
                expires_at = EXTRACT(EPOCH FROM clock_timestamp())::float8 - 5
            WHERE id <= 'job-' || lpad('{expired}', 8, '0')
        """)
        )


def reaper_pass(store: Store, *, batch: int, purge: bool = True) -> dict[str, Any]:
    """One pass as ``celery_leases.reaper.reap`` runs it, without publishing; seconds taken."""
    s = store.settings
    started = time.perf_counter()
    reaped = batches = 0
    for _ in range(MAX_BATCHES):
        outcome = store.reap(
            batch=batch,
            grace=s.reap_grace,
            max_stalled=s.max_attempts_without_progress,
            max_attempts=s.max_attempts,
        )
        batches += 1
        reaped += len(outcome.republish) + len(outcome.gave_up)
        if len(outcome.republish) + len(outcome.gave_up) < batch:
            break
    reap_seconds = time.perf_counter() - started
    purged = 0
    started = time.perf_counter()
    if purge:
        for _ in range(MAX_BATCHES):
            count = store.purge(older_than=s.retention, batch=batch)
            purged += count
            if count < batch:
                break
    purge_seconds = time.perf_counter() - started
    return {
        "batch": batch,
        "reaped": reaped,
        "batches": batches,
        "reap_seconds": reap_seconds,
        "purged": purged,
        "purge_seconds": purge_seconds,
        "total_seconds": reap_seconds + purge_seconds,
    }


def explain(
    store: Store, call: Callable[[], Any], *, only: int | None = None
) -> list[dict[str, Any]]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of each statement ``call`` sends, run again with the same
    parameters inside a transaction that is rolled back (``call``'s own effects stay)."""
    counter = StatementCounter(store.engine)
    try:
        call()
        statements = list(counter.last)
    finally:
        counter.close()
    if only is not None:
        statements = statements[:only]
    plans = []
    fairy = store.engine.raw_connection()
    try:
        for sql, params in statements:
            cursor = fairy.cursor()
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
            plan = [_clip(row[0], 300) for row in cursor.fetchall()]
            cursor.close()
            fairy.rollback()
            plans.append({"sql": sql.split("\n")[0][:160], "plan": plan})
    finally:
        fairy.close()
    return plans


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 5] + " ..."


def _print_plan(lines: list[str], limit: int = 24) -> None:
    shown = [line for line in lines if "Index Cond: ((id)::text =" not in line]
    for line in shown[:limit]:
        print("    " + _clip(line, 150))
    if len(shown) > limit:
        print(f"    ... ({len(shown) - limit} more lines)")


# -- concurrent claimers --------------------------------------------------------------------------


def _claimer(url: str, table: str, ids: list[str], raw: bool, barrier: Any, out: Any) -> None:
    store = Store(settings(url, table))
    store._schema_ready = True
    if raw:
        fairy = store.engine.raw_connection()
        sql = f"UPDATE {table} SET renewed_at = %s WHERE id = %s"
    else:
        store.now()  # connect before the start line
    barrier.wait()
    started = time.time()
    cpu_started = time.process_time()
    for job_id in ids:
        if raw:
            cursor = fairy.cursor()
            cursor.execute(sql, (time.time(), job_id))
            cursor.close()
            fairy.commit()
        else:
            store.claim(
                job_id, owner="bench/1", duration=30.0, task="bench.noop", args="[]", kwargs="{}"
            )
    out.put((started, time.time(), len(ids), time.process_time() - cpu_started))
    store.engine.dispose()


def claimers(
    store: Store, *, processes: int, per_process: int, raw: bool, tag: str
) -> dict[str, Any]:
    """``processes`` claimers, each over ``per_process`` queued jobs of its own; claims/s."""
    t = store.table.name
    with store.engine.begin() as connection:
        connection.execute(
            sa.text(f"""
            INSERT INTO {t} (id, task, args, kwargs, options, state, token, attempts,
                stalled_attempts, created_at, schema_version)
            SELECT '{tag}-' || p || '-' || i, 'bench.noop', '[]', '{{}}', '{{}}', 'queued', 0, 0,
                0, EXTRACT(EPOCH FROM clock_timestamp())::float8, 1
            FROM generate_series(1, {processes}) AS p, generate_series(1, {per_process}) AS i
        """)
        )
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes)
    out = context.Queue()
    workers = [
        context.Process(
            target=_claimer,
            args=(
                store.settings.database_url,
                t,
                [f"{tag}-{p}-{i}" for i in range(1, per_process + 1)],
                raw,
                barrier,
                out,
            ),
        )
        for p in range(1, processes + 1)
    ]
    for w in workers:
        w.start()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    total = sum(r[2] for r in results)
    cpu = sum(r[3] for r in results)
    return {
        "processes": processes,
        "operations": total,
        "seconds": end - start,
        "per_s": total / (end - start),
        "raw": raw,
        "client_cpu_ms_per_op": cpu / total * 1000,
    }


# -- renew ticks ----------------------------------------------------------------------------------


def renew_ticks(store: Store, *, expired: int, held: int, ticks: int) -> dict[str, Any]:
    """Time ``ticks`` renew ticks of a process holding ``held`` of the live leases."""
    leases = [(f"job-{n:08d}", 1) for n in range(expired + 1, expired + held + 1)]
    renewal = store.renew(leases)
    assert len(renewal.held) == held, (len(renewal.held), held)
    counter = StatementCounter(store.engine)
    store.renew(leases)
    statements = counter.statements
    counter.close()
    times = []
    for _ in range(ticks):
        started = time.perf_counter()
        store.renew(leases)
        times.append(time.perf_counter() - started)
    per_tick = statistics.median(times)
    interval = store.settings.renew_interval
    return {
        "leases": held,
        "statements_per_tick": statements,
        "tick": summary(times),
        "ticks_per_s": 1 / per_tick,
        "leases_renewed_per_s": held / per_tick,
        "default_interval_s": interval,
        "statements_per_s_at_default_interval": statements / interval,
        "connection_busy_at_default_interval": per_tick / interval,
        "plan": explain(store, lambda: store.renew(leases))[0]["plan"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv)
    quick = args.quick
    total = 200_000 if quick else 1_000_000
    expired = 2_000 if quick else 10_000
    counts = {
        "total": total,
        "expired": expired,
        "live": expired,
        "queued": expired,
        "old": expired,
    }
    per_claimer = 40 if quick else 200
    problem = reachable(POSTGRES_URL)
    if problem:
        print(f"PostgreSQL unreachable: {problem}")
        return
    table = scratch_name("scale")
    store = Store(settings(POSTGRES_URL, table))
    data: dict[str, Any] = {"rows": counts}
    try:
        store.ensure_schema()
        print(f"filling {table} with {total:,} jobs...", flush=True)
        data["fill_seconds"] = fill(store, **counts)
        print(f"  {data['fill_seconds']:.1f} s", flush=True)
        batch = store.settings.reap_batch
        # Plans first, on the state the pass will meet (EXPLAIN ANALYZE of a locking SELECT and
        # of the UPDATE run inside a rolled-back transaction).
        s = store.settings
        data["explain_reap"] = explain(
            store,
            lambda: store.reap(
                batch=batch,
                grace=s.reap_grace,
                max_stalled=s.max_attempts_without_progress,
                max_attempts=s.max_attempts,
            ),
            only=3,
        )
        reset_expired(store, expired)
        data["explain_purge"] = explain(
            store, lambda: store.purge(older_than=s.retention, batch=batch), only=1
        )
        print("reaper passes...", flush=True)
        reset_expired(store, expired)
        data["pass"] = reaper_pass(store, batch=batch)
        data["idle_pass"] = [reaper_pass(store, batch=batch) for _ in range(5)]
        reset_expired(store, expired)
        data["one_batch"] = reaper_pass(store, batch=expired, purge=False)
        index = f"ix_{table}_expiry"
        data["reap_uses_expiry_index"] = any(
            index in line for line in data["explain_reap"][0]["plan"]
        )
        print("claimers...", flush=True)
        data["claimers"] = [
            claimers(store, processes=1, per_process=per_claimer * 2, raw=False, tag="c1"),
            claimers(store, processes=32, per_process=per_claimer, raw=False, tag="c32"),
            claimers(store, processes=32, per_process=per_claimer, raw=True, tag="r32"),
        ]
        print("renew ticks...", flush=True)
        data["renew"] = [
            renew_ticks(store, expired=expired, held=held, ticks=ticks)
            for held, ticks in ((1, 200), (50, 200), (500, 100))
        ]
    finally:
        store.engine.dispose()
        drop_tables(POSTGRES_URL, table)
    report(data)
    write_result("scale", data, quick=quick)


def report(data: dict[str, Any]) -> None:
    p, one = data["pass"], data["one_batch"]
    idle = statistics.median(x["total_seconds"] for x in data["idle_pass"])
    rows = [
        [
            f"reap {p['reaped']:,} expired, batches of {p['batch']} ({p['batches']} batches)",
            p["reap_seconds"],
            p["reaped"] / p["reap_seconds"],
        ],
        [
            f"purge {p['purged']:,} old jobs, batches of {p['batch']}",
            p["purge_seconds"],
            p["purged"] / p["purge_seconds"] if p["purge_seconds"] else float("nan"),
        ],
        ["whole pass (reap + purge)", p["total_seconds"], float("nan")],
        [
            f"reap {one['reaped']:,} expired in one batch",
            one["reap_seconds"],
            one["reaped"] / one["reap_seconds"],
        ],
        ["idle pass (nothing expired or old), median of 5", idle, float("nan")],
    ]
    print_table(
        f"Reaper pass over {data['rows']['total']:,} jobs (PostgreSQL; filled in "
        f"{data['fill_seconds']:.0f} s)",
        ["what", "seconds", "jobs/s"],
        rows,
    )
    print(f"\nreap SELECT uses the (state, expires_at) index: {data['reap_uses_expiry_index']}")
    for name in ("explain_reap", "explain_purge"):
        for item in data[name]:
            print(f"\nEXPLAIN (ANALYZE, BUFFERS) {_clip(item['sql'], 100)}")
            _print_plan(item["plan"])
    rows = [
        [
            ("raw UPDATE + COMMIT" if c["raw"] else "claim"),
            c["processes"],
            c["operations"],
            c["seconds"],
            c["per_s"],
        ]
        for c in data["claimers"]
    ]
    print_table(
        "Concurrent claimers over distinct queued jobs (one connection each)",
        ["operation", "processes", "operations", "seconds", "per second"],
        rows,
    )
    rows = [
        [
            r["leases"],
            r["statements_per_tick"],
            r["tick"]["median_ms"],
            r["tick"]["p99_ms"],
            r["ticks_per_s"],
            r["leases_renewed_per_s"],
            r["statements_per_s_at_default_interval"],
            100 * r["connection_busy_at_default_interval"],
        ]
        for r in data["renew"]
    ]
    print_table(
        "Renew ticks of one process (one statement renews every lease it holds)",
        [
            "leases held",
            "statements / tick",
            "ms / tick (median)",
            "p99 ms",
            "ticks/s max",
            "leases renewed/s max",
            "statements/s at default interval (10 s)",
            "% of one connection at default interval",
        ],
        rows,
    )
    for r in data["renew"]:
        print(f"\nrenew of {r['leases']} leases, plan:")
        _print_plan(r["plan"], limit=12)


if __name__ == "__main__":
    main()
