"""Ten million rows on PostgreSQL: the store's operations, the operators' reads, the retention
purge and a day's churn on a jobs table of 10,000,000 finished and 100,000 live jobs.

The table (``--quick``: 1,000,000 finished and 10,000 live) is filled by ``INSERT ... SELECT
generate_series`` from rows the store wrote (a finished job, a queued one, a running one bound
to a live keeper's holder and holding a lease key, and that key's coalesced trigger): ids are
uuid4 text, 20 task names, finished jobs spread evenly over 14 days (2 % failed, 0.5 %
cancelled, a quarter of them keyed), half the live jobs queued, half running, 3,000 lease keys
on ``<table>_keys`` held by running jobs, one in ten with a trigger waiting.

First with the indexes of revision 0003 (the release before), the reads as that release ran
them; then revision 0004's indexes are built (each ``CREATE INDEX`` timed: it holds the table's
writes that long), and the store's calls measured again. Then the retention purge (the
reaper's batches over the oldest 1 % of the finished jobs: time per batch, which bounds the
row locks a batch holds), against the rate one process records jobs at; then a compressed day
of churn (lifecycles through the store, the purge keeping pace as retention would), with the
table's and indexes' sizes and dead rows before and after, and after a ``VACUUM``.

    python -m bench.large [--quick] [--churn SECONDS]
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from celery import Celery

from bench.common import median_ms, p90_ms, parser, print_rows, report, row, scratch
from bench.operations import (
    checkpoint,
    claim,
    count_states,
    engine,
    finish,
    ids_starting_with,
    keeper_session,
    list_jobs,
    open_store,
    purge,
    reaper_steps,
    register,
    renew_holder,
    trigger,
)
from celery_leases.cli.view import COUNT_CAP
from celery_leases.reaper import reap
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, private_redis_url

DAY = 86400.0
#: The finished jobs' spread: they ended over the last 14 days.
SPREAD = 14 * DAY
#: The purge's retention: the oldest 1 % of the finished jobs are past it.
RETENTION = 0.99 * SPREAD
#: Lease keys (each held by a running job), and one in this many with a trigger waiting.
KEYS, PENDING_EVERY = 3000, 10
#: The keeper's holder of every running job, renewed on a session this process keeps open.
HOLDER = "large-keeper"
#: The indexes of revision 0004, dropped to measure the release before it, then built.
NEW_INDEXES = {
    "state_created": "(state, created_at)",
    "task_created": "(task, state, created_at)",
    "id_prefix": "(id varchar_pattern_ops)",
}
COLUMNS = "phase measure calls median_ms p90_ms max_ms note"


def sql(c: sa.Connection, text: str, **params: Any) -> Any:
    return c.execute(sa.text(text), params)


def copy(c: sa.Connection, table: str, template: str, n: int, values: dict[str, str]) -> None:
    """``n`` copies of the row ``template``, with ``values`` (SQL over ``g``, 1..n) replacing
    its columns."""
    names = [col["name"] for col in sa.inspect(c).get_columns(table) if col["name"] != "live_key"]
    exprs = ", ".join(values.get(name, f'"{name}"') for name in names)
    quoted = ", ".join(f'"{name}"' for name in names)
    sql(
        c,
        f"INSERT INTO {table} ({quoted}) SELECT {exprs} FROM {table}, generate_series(1, {n}) g"
        " WHERE id = :template",
        template=template,
    )


def fill(store: Any, table: str, finished: int, live: int) -> None:
    """The table: ``finished`` finished jobs over 14 days, ``live`` live ones, the keys."""
    register(store, "tpl-done")
    finish(store, "tpl-done", claim(store, "tpl-done", HOLDER))
    register(store, "tpl-queued")
    trigger(store, "tpl-running", "account:0")
    claim(store, "tpl-running", HOLDER)
    if trigger(store, "tpl-trigger", "account:0") != "coalesced":
        raise RuntimeError("the template trigger was not coalesced")
    now = time.time()
    ended = f"{now} - {SPREAD} * ((g - 0.5) / {finished})"
    uid = "gen_random_uuid()::text"
    with engine(store).begin() as c:
        copy(c, table, "tpl-done", finished, {
            "id": uid,
            "task": "'bench.task_' || (g % 20)",
            "state": "CASE WHEN g % 50 = 0 THEN 'failed' WHEN g % 200 = 1 THEN 'cancelled'"
            " ELSE 'done' END",
            "finished_at": ended,
            "created_at": f"{ended} - 30 - g % 300",
            "claimed_at": f"{ended} - 29 - g % 300",
            "started_at": f"{ended} - 29 - g % 300",
            "renewed_at": f"{ended} - 1",
            "checkpoint_at": f"{ended} - 1",
            "lease_key": f"CASE WHEN g % 4 = 0 THEN 'account:' || (g % {KEYS}) END",
        })  # fmt: skip
        copy(c, table, "tpl-queued", live // 2, {
            "id": uid,
            "task": "'bench.task_' || (g % 20)",
            "created_at": f"{now} - g % 600",
        })  # fmt: skip
        copy(c, table, "tpl-running", live // 2, {
            "id": uid,
            "task": "'bench.task_' || (g % 20)",
            "created_at": f"{now} - 60 - g % 3600",
            "lease_key": f"CASE WHEN g < {KEYS} THEN 'account:' || g END",
        })  # fmt: skip
        keys = f"{table}_keys"
        names = [col["name"] for col in sa.inspect(c).get_columns(keys)]
        pending = f"CASE WHEN g % {PENDING_EVERY} = 0 THEN {{}} END"
        exprs = {
            "lease_key": "'account:' || g",
            "cursor_state": "'{\"page\": ' || g || '}'",
            "pending_id": pending.format(uid),
            "pending": pending.format("pending"),
            "pending_at": pending.format("pending_at"),
        }
        sql(
            c,
            f"INSERT INTO {keys} ({', '.join(names)}) SELECT "
            + ", ".join(exprs.get(n, n) for n in names)
            + f" FROM {keys}, generate_series(1, {KEYS - 1}) g WHERE lease_key = 'account:0'",
        )


def timed(call: Callable[[], Any], *, times: int, budget: float = 20.0) -> list[float]:
    """Seconds of up to ``times`` calls of ``call``, fewer once ``budget`` seconds are spent
    (a scan of ten million rows is timed once or twice)."""
    seconds: list[float] = []
    while len(seconds) < times and sum(seconds) < budget:
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return seconds


def measured(phase: str, measure: str, seconds: list[float], note: str = "") -> dict[str, Any]:
    worst = max(seconds) * 1000.0
    return row(
        COLUMNS, phase, measure, len(seconds), median_ms(seconds), p90_ms(seconds), worst, note
    )


def old_reads(store: Any) -> dict[str, Callable[[], Any]]:
    """The operators' reads as the release before ran them (fca57fc): one statement each."""
    t, reads = store.table, store.sql.reads
    newest = t.c.created_at.desc()

    def listed(*where: Any) -> Callable[[], Any]:
        stmt = reads.select_jobs(*where).order_by(newest).limit(50)
        return lambda: run(store, stmt)

    prefix = sa.select(t.c.id).where(t.c.id.like("ab12%", escape="\\")).order_by(t.c.id).limit(5)
    return {
        "list": listed(),
        "list --state running": listed(t.c.state.in_(["running"])),
        "list --task bench.task_3": listed(t.c.task == "bench.task_3"),
        "counts (GROUP BY state)": lambda: run(store, reads.count_by_state),
        "id prefix (ab12)": lambda: run(store, prefix),
    }


def run(store: Any, stmt: Any) -> list[Any]:
    with engine(store).connect() as c:
        return list(c.execute(stmt).all())


def new_reads(store: Any) -> dict[str, Callable[[], Any]]:
    """The same reads through the store's calls."""
    return {
        "list": lambda: list_jobs(store),
        "list --state running": lambda: list_jobs(store, ["running"]),
        "list --task bench.task_3": lambda: list_jobs(store, task="bench.task_3"),
        f"counts (live exact, finished up to {COUNT_CAP:,})": lambda: count_states(
            store, COUNT_CAP
        ),
        "counts (GROUP BY state)": lambda: count_states(store, None),
        "id prefix (ab12)": lambda: ids_starting_with(store, "ab12"),
    }


def writes(store: Any, app: Celery, phase: str) -> list[dict[str, Any]]:
    """A claim (of a job just recorded), a record, a coalesced trigger, an idle reaper pass."""
    tag = uuid.uuid4().hex[:6]
    ids = [f"{phase}-{tag}-{i}" for i in range(200)]
    recorded = timed(lambda: register(store, ids.pop()), times=100)
    claims = [f"{phase}-{tag}-c{i}" for i in range(100)]
    for job_id in claims:
        register(store, job_id)
    claimed = timed(lambda: claim(store, claims.pop(), HOLDER), times=100)
    outcomes: list[str] = []
    coalesced = timed(
        lambda: outcomes.append(trigger(store, f"t-{uuid.uuid4().hex}", "account:7")), times=100
    )
    if set(outcomes) != {"coalesced"}:
        raise RuntimeError(f"triggers of a busy key: {set(outcomes)}")
    passes: list[dict[str, Any]] = []
    idle = timed(lambda: passes.append(reap(app).as_dict()), times=5)
    if any(p["republished"] or p["gave_up"] or p["purged"] for p in passes):
        raise RuntimeError(f"the reaper pass was not idle: {passes[0]}")
    steps = [
        measured(phase, f"  reaper step: {name}", timed(call, times=5))
        for name, call in reaper_steps(app).items()
    ]
    return [
        measured(phase, "record (Store.register)", recorded),
        measured(phase, "claim, bound to a holder", claimed),
        measured(phase, "coalesced trigger of a busy key", coalesced),
        measured(phase, "idle reaper pass (reap)", idle, "nothing expired or past retention"),
        *steps,
    ]


def purged(store: Any, finished: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The reaper's purge over the oldest 1 % of the finished jobs, batch by batch, and the
    rate one process records jobs at, next to it."""
    batch = store.settings.reap_batch
    seconds, deleted = [], 0
    while True:
        started = time.perf_counter()
        done = purge(store, RETENTION, batch)
        seconds.append(time.perf_counter() - started)
        deleted += done
        if done < batch:
            break
    rate = deleted / sum(seconds)
    tag = uuid.uuid4().hex[:6]
    inserted = timed(lambda: register(store, f"rate-{tag}-{uuid.uuid4().hex}"), times=2000)
    insert_rate = len(inserted) / sum(inserted)
    note = f"{deleted:,} jobs in {len(seconds)} batches of {batch}, {rate:,.0f} jobs/s"
    rows = [
        measured(
            "purge", "purge batch (one transaction: its row locks' longest hold)", seconds, note
        ),
        measured(
            "purge", "record, next to it (one process)", inserted, f"{insert_rate:,.0f} jobs/s"
        ),
    ]
    facts = {
        "purged": deleted,
        "batches": len(seconds),
        "purge_rate": rate,
        "insert_rate": insert_rate,
    }
    if abs(deleted - finished // 100) > finished // 1000 + 2:
        raise RuntimeError(f"the purge deleted {deleted:,}, not about {finished // 100:,}")
    return rows, facts


def sizes(store: Any, table: str, label: str) -> list[dict[str, Any]]:
    """The table's size, each index's, and its live and dead rows (the statistics' counts)."""
    with engine(store).connect() as c:
        found = [("table (heap)", sql(c, "SELECT pg_relation_size(:t)", t=table).scalar_one())]
        found.append(
            (
                "table + indexes + TOAST",
                sql(c, "SELECT pg_total_relation_size(:t)", t=table).scalar_one(),
            )
        )
        for name, size in sql(
            c,
            "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index"
            " WHERE indrelid = CAST(:t AS regclass) ORDER BY 1",
            t=table,
        ).all():
            found.append((name.replace(table, "<table>"), size))
        live, dead = sql(
            c, "SELECT n_live_tup, n_dead_tup FROM pg_stat_user_tables WHERE relname = :t", t=table
        ).one()
    rows = [row("when relation MB", label, name, size / 2**20) for name, size in found]
    rows.append(row("when relation MB", label, f"rows: {live:,} live, {dead:,} dead", None))
    return rows


def churn(store: Any, seconds: float, finished: int, checkpoints: int = 3) -> dict[str, Any]:
    """Lifecycles (record, claim, ``checkpoints`` checkpoints, finish) through the store for
    ``seconds``, in one process; after each second's worth, the purge deletes what ageing
    would have: the table ages one day per ``finished / 14`` lifecycles."""
    per_day = finished / (SPREAD / DAY)
    tag, done, deleted, purge_seconds = uuid.uuid4().hex[:6], 0, 0, 0.0
    batch = store.settings.reap_batch
    started = time.perf_counter()
    next_purge = started + 1.0
    while time.perf_counter() - started < seconds:
        job_id = f"churn-{tag}-{done}"
        register(store, job_id)
        token = claim(store, job_id, HOLDER)
        for k in range(checkpoints):
            checkpoint(store, job_id, token, f'{{"page": {k}}}')
        finish(store, job_id, token)
        done += 1
        if time.perf_counter() >= next_purge:
            older_than = RETENTION - done / per_day * DAY
            began = time.perf_counter()
            while (n := purge(store, older_than, batch)) > 0:
                deleted += n
                if n < batch:
                    break
            purge_seconds += time.perf_counter() - began
            next_purge = time.perf_counter() + 1.0
    elapsed = time.perf_counter() - started
    return {
        "lifecycles": done,
        "seconds": elapsed,
        "lifecycles_per_s": done / elapsed,
        "checkpoints": checkpoints,
        "purged": deleted,
        "purge_seconds": purge_seconds,
        "day_fraction": done / per_day,
    }


def build_indexes(store: Any, table: str) -> list[dict[str, Any]]:
    """Revision 0004's indexes, each built as the revision builds it (plain ``CREATE INDEX``:
    the table's writes wait that long)."""
    rows = []
    with engine(store).connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        for name, columns in NEW_INDEXES.items():
            started = time.perf_counter()
            sql(c, f"CREATE INDEX ix_{table}_{name} ON {table} {columns}")
            took = [time.perf_counter() - started]
            rows.append(measured("migrate", f"CREATE INDEX {columns}", took, "writes wait"))
        sql(c, f"ANALYZE {table}")
    return rows


def reads(phase: str, calls: dict[str, Callable[[], Any]], times: int) -> list[dict[str, Any]]:
    return [measured(phase, name, timed(call, times=times)) for name, call in calls.items()]


def vacuum(store: Any, table: str, what: str) -> float:
    started = time.perf_counter()
    with engine(store).connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        sql(c, f"{what} {table}")
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    cli = parser(__doc__)
    cli.add_argument("--churn", type=float, help="seconds of churn (default 120; quick 20)")
    args = cli.parse_args(argv)
    finished, live = (1_000_000, 10_000) if args.quick else (10_000_000, 100_000)
    churn_seconds = args.churn or (20.0 if args.quick else 120.0)
    rows: list[dict[str, Any]] = []
    facts: dict[str, Any] = {"finished": finished, "live": live}
    with scratch(POSTGRES_URL, "large") as table, private_redis_url() as broker:
        store = open_store(POSTGRES_URL, table, duration=3600.0)
        session = keeper_session(store)
        renew_holder(store, HOLDER, session)
        with engine(store).begin() as c:
            facts["autovacuum"] = sql(c, "SHOW autovacuum").scalar_one()
            for name in NEW_INDEXES:
                sql(c, f"DROP INDEX ix_{table}_{name}")
        started = time.perf_counter()
        fill(store, table, finished, live)
        facts["fill_seconds"] = time.perf_counter() - started
        facts["vacuum_analyze_seconds"] = vacuum(store, table, "VACUUM ANALYZE")
        fill_s, vacuum_s = facts["fill_seconds"], facts["vacuum_analyze_seconds"]
        print(f"filled in {fill_s:.0f} s, VACUUM ANALYZE {vacuum_s:.0f} s", flush=True)
        app = Celery("bench-large", set_as_current=False)
        app.conf.update(
            broker_url=broker,
            leases_database_url=POSTGRES_URL,
            leases_table=table,
            leases_retention=2 * SPREAD,
            leases_duration=3600.0,
        )
        try:
            rows += writes(store, app, "0003")
            rows += reads("0003", old_reads(store), times=3)
            rows += build_indexes(store, table)
            renew_holder(store, HOLDER, session)
            rows += writes(store, app, "0004")
            rows += reads("0004", new_reads(store), times=20)
        finally:
            close_app(app)
        size_rows = sizes(store, table, "filled, 0004's indexes")
        purge_rows, facts["purge"] = purged(store, finished)
        rows += purge_rows
        renew_holder(store, HOLDER, session)
        facts["churn"] = churn(store, churn_seconds, finished)
        size_rows += sizes(store, table, "after the churn")
        facts["vacuum_seconds"] = vacuum(store, table, "VACUUM")
        size_rows += sizes(store, table, "after VACUUM")
        session.close()
        engine(store).dispose()
    title = f"{finished:,} finished and {live:,} live jobs (PostgreSQL)"
    report("large", rows, quick=args.quick, title=title, sizes=size_rows, **facts)
    print_rows("Sizes (MB)", size_rows)
    print(json.dumps(facts, indent=2, default=str), flush=True)


if __name__ == "__main__":
    main()
