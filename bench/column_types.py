"""PostgreSQL column types for the jobs table: ``jsonb`` vs ``text`` checkpoints, and
``timestamptz`` vs epoch-seconds ``double precision`` lease arithmetic.

Each pair runs the same statement shape through the **same psycopg connection** (autocommit,
as the store runs a checkpoint), alternating in blocks (``bench.common.interleaved``), on two
scratch tables that differ only in the column's type:

- checkpoint: ``UPDATE t SET checkpoint = %s[::jsonb], checkpoint_at = <now> WHERE id = %s``
  with a checkpoint of 100 B, 10 KB and 1 MB, in two shapes: one string of random hex (what
  ``bench.operations`` writes) and a list of small objects (a cursor over many records);
- lease ends through holders: a renew tick no longer moves any job's ``expires_at`` (it is
  one upsert of the keeper's holder row); a running job's lease end is computed from its
  holder's last renewal, ``coalesce(expires_at, greatest(renewed_at, <its holder's
  renewed_at>) + duration)``, and the reaper compares it with the clock for every job of a
  holder that stopped renewing (``release_stale``). Here that selection, counted (a
  ``SELECT count(*)`` with the reaper's condition, so every call sees the same rows), over
  1,000 running jobs bound to 10 stale holders, with times as ``double precision`` (epoch
  seconds, ``clock_timestamp()`` converted) or as ``timestamptz`` (``+ duration * interval
  '1 second'``, compared with ``clock_timestamp()``).

Medians and p90 in ms, and the size each form takes on disk (``pg_column_size``).

    python -m bench.column_types [--quick]
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import sqlalchemy as sa

from bench.common import interleaved, median_ms, p90_ms, parser, report, row, scratch, steady
from tests.support.service import require

SIZES = {"100 B": 100, "10 KB": 10_000, "1 MB": 1_000_000}
NOW_EPOCH = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


def checkpoint_text(shape: str, size: int) -> str:
    """JSON text of about ``size`` bytes: one hex string, or a list of small objects."""
    if shape == "string":
        return json.dumps({"blob": os.urandom(max(size // 2 - 6, 1)).hex()})
    records: list[dict[str, Any]] = []
    text = "[]"
    while len(text) < size:
        records.append({"id": len(records), "cursor": uuid.uuid4().hex[:12], "ok": True})
        if len(records) % 64 == 0 or size < 200:
            text = json.dumps({"records": records})
    return json.dumps({"records": records})


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    url = require("postgres")
    dsn = sa.engine.make_url(url).set(drivername="postgresql").render_as_string(False)
    calls = 100 if args.quick else 400
    block = 10 if args.quick else 20
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    with (
        scratch(url, "types", leases=False) as name,
        psycopg.connect(dsn, autocommit=True) as connection,
    ):
        text_table, jsonb_table = f"{name}_text", f"{name}_jsonb"
        for table, kind in ((text_table, "text"), (jsonb_table, "jsonb")):
            connection.execute(
                f"CREATE TABLE {table} (id varchar(155) PRIMARY KEY, checkpoint {kind}, "
                "checkpoint_at double precision)"
            )
            connection.execute(f"INSERT INTO {table} VALUES ('job', NULL, NULL)")
        for shape in ("string", "objects"):
            for label, size in SIZES.items():
                payload = checkpoint_text(shape, size)
                n = max(calls // 8, 20) if size >= 1_000_000 else calls

                def write(table: str, cast: str, payload: str = payload) -> Callable[[int], Any]:
                    sql = (
                        f"UPDATE {table} SET checkpoint = %s{cast}, checkpoint_at = {NOW_EPOCH} "
                        "WHERE id = 'job'"
                    )
                    return lambda _: connection.execute(sql, (payload,))

                times = interleaved(
                    {
                        "text": steady(write(text_table, "")),
                        "jsonb": steady(write(jsonb_table, "::jsonb")),
                    },
                    calls=n,
                    block=block,
                )
                sizes = {
                    kind: connection.execute(
                        f"SELECT pg_column_size(checkpoint) FROM {table}"
                    ).fetchone()[0]  # type: ignore[index]
                    for table, kind in ((text_table, "text"), (jsonb_table, "jsonb"))
                }
                text_ms, jsonb_ms = median_ms(times["text"]), median_ms(times["jsonb"])
                rows.append(
                    row(
                        "operation shape size calls text_ms jsonb_ms jsonb/text "
                        "text_p90 jsonb_p90 text_bytes jsonb_bytes",
                        "checkpoint",
                        shape,
                        f"{label} ({len(payload):,} B)",
                        n,
                        text_ms,
                        jsonb_ms,
                        jsonb_ms / text_ms,
                        p90_ms(times["text"]),
                        p90_ms(times["jsonb"]),
                        sizes["text"],
                        sizes["jsonb"],
                    )
                )
                raw[f"checkpoint {shape} {label}"] = times
        rows += lease_end_rows(connection, name, calls=calls, block=block, raw=raw)
    report(
        "column_types",
        rows,
        quick=args.quick,
        title="PostgreSQL: jsonb vs text checkpoints, timestamptz vs double lease ends",
        raw=raw,
    )


#: The jobs of the lease-end comparison: 10 holders of 100 running jobs each.
HOLDERS, JOBS_PER_HOLDER = 10, 100

#: The reaper's stale-lease condition (``statements/reaper.py``, ``release_stale``), counted:
#: jobs of a holder past its expiry whose lease end (through the holder) has passed. ``{now}``
#: the clock, ``{seconds}`` a duration in the column's type.
LEASE_ENDS = (
    "SELECT count(*) FROM {jobs} j WHERE j.state = 'running'"
    " AND j.holder IN (SELECT id FROM {holders} WHERE expires_at <= (SELECT {now}))"
    " AND coalesce(j.expires_at, CASE WHEN j.holder IS NOT NULL THEN greatest(j.renewed_at,"
    " coalesce((SELECT h.renewed_at FROM {holders} h WHERE h.id = j.holder), j.renewed_at))"
    " + {seconds} END) <= {now}"
)


def counting(connection: psycopg.Connection[Any], sql: str) -> Callable[[int], Any]:
    """A timed call running the query ``sql`` and reading its rows."""
    return lambda _: connection.execute(sql).fetchall()  # type: ignore[arg-type]


def lease_end_rows(
    connection: psycopg.Connection[Any], name: str, *, calls: int, block: int, raw: dict[str, Any]
) -> list[dict[str, Any]]:
    """The reaper's lease-end test of 1,000 jobs bound to 10 stale holders, with epoch-second
    doubles and with timestamptz."""
    forms = {
        "double": ("double precision", NOW_EPOCH, "j.duration", f"{NOW_EPOCH} - %s"),
        "timestamptz": (
            "timestamptz",
            "clock_timestamp()",
            "j.duration * interval '1 second'",
            "clock_timestamp() - %s * interval '1 second'",
        ),
    }
    sql: dict[str, str] = {}
    for kind, (column, now, seconds, ago) in forms.items():
        jobs, holders = f"{name}_{kind}_jobs", f"{name}_{kind}_holders"
        connection.execute(
            f"CREATE TABLE {holders} (id varchar(64) PRIMARY KEY, renewed_at {column}, "
            f"expires_at {column})"
        )
        connection.execute(
            f"CREATE TABLE {jobs} (id varchar(155) PRIMARY KEY, state varchar(16), "
            f"holder varchar(64), duration double precision, renewed_at {column}, "
            f"expires_at {column})"
        )
        connection.execute(
            f"CREATE INDEX {jobs}_holder ON {jobs} (holder) WHERE holder IS NOT NULL"
        )
        # Holders that stopped renewing two hours ago, past their expiry an hour ago; their
        # jobs claimed then (30 s leases), bound (no expiry of their own).
        connection.execute(
            f"INSERT INTO {holders} SELECT 'holder-' || g, {ago}, {ago} "
            f"FROM generate_series(1, {HOLDERS}) AS g",
            (7200, 3600),
        )
        connection.execute(
            f"INSERT INTO {jobs} SELECT 'job-' || g, 'running', "
            f"'holder-' || (mod(g, {HOLDERS}) + 1), 30.0, {ago}, NULL "
            f"FROM generate_series(1, {HOLDERS * JOBS_PER_HOLDER}) AS g",
            (7200,),
        )
        connection.execute(f"VACUUM ANALYZE {holders}")
        connection.execute(f"VACUUM ANALYZE {jobs}")
        sql[kind] = LEASE_ENDS.format(jobs=jobs, holders=holders, now=now, seconds=seconds)
        counted = connection.execute(sql[kind]).fetchone()[0]  # type: ignore[index]
        if counted != HOLDERS * JOBS_PER_HOLDER:
            raise RuntimeError(f"{kind}: {counted} lease ends passed, not every job's")
    times = interleaved(
        {kind: steady(counting(connection, text)) for kind, text in sql.items()},
        calls=calls,
        block=block,
    )
    label = f"{HOLDERS * JOBS_PER_HOLDER:,} jobs, {HOLDERS} holders"
    raw[f"lease ends, {label}"] = times
    double_ms, tz_ms = median_ms(times["double"]), median_ms(times["timestamptz"])
    return [
        row(
            "operation shape size calls text_ms jsonb_ms jsonb/text text_p90 jsonb_p90",
            "reaper's lease-end test through holders (double / timestamptz)",
            label,
            "-",
            calls,
            double_ms,
            tz_ms,
            tz_ms / double_ms,
            p90_ms(times["double"]),
            p90_ms(times["timestamptz"]),
        )
    ]


if __name__ == "__main__":
    main()
