"""A round trip after a pause: how long one statement takes by how long the client spent before
sending it.

No library code in the timed part: a raw driver connection (psycopg 3; PyMySQL for MariaDB), in
autocommit, runs ``UPDATE <table> SET checkpoint = ? WHERE id = ?`` of one row of a scratch
jobs table, a state of its own each call. Before each call the client waits ``gap`` seconds
(0 to 10 ms), either **busy** (spinning on ``time.perf_counter``, as a process running Python
between statements: a library's bookkeeping, a task's body) or **asleep** (``time.sleep``, as a
process waiting on something else). Gaps and modes alternate in blocks of 40 calls, the order
turning every round, so drift hits them alike. Printed: the statement's median and p90 for
each gap and mode, and its ratio to the back-to-back median (gap 0).

What it tells: on a machine whose idle cores sleep deeply (a VM here), a database server
process that waited for its next statement answers it later, so every figure that puts the
library's Python, or a task's body, between round trips pays more per round trip than a tight
loop does (``bench.checkpoint``'s bare side included).

    python -m bench.pause [--quick] [--database postgres mariadb]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.common import available, parser, report, row, scratch
from bench.operations import open_store, register

GAPS = (0.0, 25e-6, 100e-6, 250e-6, 1e-3, 10e-3)
COLUMNS = "database gap_us mode calls median_us p90_us vs_back_to_back"


def connect(db: str, url: str) -> Any:
    """A raw connection of the store's driver to ``url``, in autocommit."""
    from sqlalchemy.engine import make_url

    parts = make_url(url)
    if db == "postgres":
        import psycopg

        return psycopg.connect(
            host=parts.host, port=parts.port, user=parts.username, dbname=parts.database,
            autocommit=True,
        )  # fmt: skip
    import pymysql

    return pymysql.connect(
        host=parts.host, port=parts.port or 3306, user=parts.username,
        password=parts.password or "", database=parts.database, autocommit=True,
    )  # fmt: skip


def wait(gap: float, mode: str) -> None:
    if mode == "busy":
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass
    elif gap:
        time.sleep(gap)


def measure(db: str, url: str, *, rounds: int, block: int) -> list[dict[str, Any]]:
    with scratch(url, "pause") as table:
        store = open_store(url, table)
        register(store, "pause-row")
        store.engine.dispose()
        connection = connect(db, url)
        cursor = connection.cursor()
        sql = f"UPDATE {table} SET checkpoint = %s WHERE id = %s"
        cases = [(gap, mode) for gap in GAPS for mode in ("busy", "asleep")]
        times: dict[tuple[float, str], list[float]] = {case: [] for case in cases}
        n = 0
        try:
            for turn in range(rounds):
                for gap, mode in cases if turn % 2 else reversed(cases):
                    for _ in range(block):
                        n += 1
                        state = json.dumps({"done": f"{n:012d}"})
                        wait(gap, mode)
                        started = time.perf_counter()
                        cursor.execute(sql, (state, "pause-row"))
                        times[(gap, mode)].append(time.perf_counter() - started)
        finally:
            connection.close()
    base = statistics.median(times[(0.0, "busy")] + times[(0.0, "asleep")])
    rows = []
    for (gap, mode), seconds in times.items():
        median = statistics.median(seconds)
        found = row(
            COLUMNS, db, round(gap * 1e6), mode, len(seconds), median * 1e6,
            statistics.quantiles(seconds, n=10)[-1] * 1e6, median / base,
        )  # fmt: skip
        print(found, flush=True)
        rows.append(found)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    options = parser(__doc__)
    options.add_argument(
        "--database", nargs="+", choices=("postgres", "mariadb"), default=["postgres", "mariadb"]
    )
    args = options.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for db in args.database:
        url = available(db)
        if url is not None:
            rows += measure(db, url, rounds=4 if args.quick else 20, block=40)
    report(
        "pause",
        rows,
        quick=args.quick,
        title="One UPDATE's round trip after the client spent a gap before it (us)",
        argv=argv,
    )


if __name__ == "__main__":
    main()
