"""PostgreSQL column types for the jobs table: ``jsonb`` vs ``text`` checkpoints, and
``timestamptz`` vs epoch-seconds ``double precision`` lease arithmetic.

Each pair runs the same statement shape through the **same psycopg connection** (autocommit,
as the store runs a checkpoint), alternating in blocks (``bench.common.interleaved``), on two
scratch tables that differ only in the column's type:

- checkpoint: ``UPDATE t SET checkpoint = %s[::jsonb], checkpoint_at = <now> WHERE id = %s``
  with a checkpoint of 100 B, 10 KB and 1 MB, in two shapes: one string of random hex (what
  ``bench.operations`` writes) and a list of small objects (a cursor over many records);
- renew tick: ``UPDATE t SET expires_at = <now> + duration, renewed_at = <now> WHERE id IN
  (...)`` over 100 running leases, with times as ``double precision`` (epoch seconds,
  ``clock_timestamp()`` converted) or as ``timestamptz`` (``clock_timestamp() + duration *
  interval '1 second'``).

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
        rows += renew_rows(connection, name, calls=calls, block=block, raw=raw)
    report(
        "column_types",
        rows,
        quick=args.quick,
        title="PostgreSQL: jsonb vs text checkpoints, timestamptz vs double renewals",
        raw=raw,
    )


def renew_rows(
    connection: psycopg.Connection[Any], name: str, *, calls: int, block: int, raw: dict[str, Any]
) -> list[dict[str, Any]]:
    """A renew tick of 100 leases with epoch-second doubles and with timestamptz."""
    double, tz = f"{name}_double", f"{name}_tz"
    connection.execute(
        f"CREATE TABLE {double} (id varchar(155) PRIMARY KEY, duration double precision, "
        "expires_at double precision, renewed_at double precision)"
    )
    connection.execute(
        f"CREATE TABLE {tz} (id varchar(155) PRIMARY KEY, duration double precision, "
        "expires_at timestamptz, renewed_at timestamptz)"
    )
    ids = [f"job-{i}" for i in range(100)]
    for table in (double, tz):
        connection.execute(
            f"INSERT INTO {table} (id, duration) SELECT unnest(%s::varchar[]), 30.0", (ids,)
        )
    sql = {
        "double": f"UPDATE {double} SET expires_at = {NOW_EPOCH} + duration, "
        f"renewed_at = {NOW_EPOCH} WHERE id = ANY(%s)",
        "timestamptz": f"UPDATE {tz} SET expires_at = clock_timestamp() + duration * "
        "interval '1 second', renewed_at = clock_timestamp() WHERE id = ANY(%s)",
    }
    times = interleaved(
        {kind: steady(lambda _, s=s: connection.execute(s, (ids,))) for kind, s in sql.items()},
        calls=calls,
        block=block,
    )
    raw["renew 100 leases"] = times
    double_ms, tz_ms = median_ms(times["double"]), median_ms(times["timestamptz"])
    return [
        row(
            "operation shape size calls text_ms jsonb_ms jsonb/text text_p90 jsonb_p90",
            "renew tick (double | timestamptz)",
            "100 leases",
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
