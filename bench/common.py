"""What the benchmarks share: the command line, interleaved timing, results, scratch tables.

A script turns its measurements into rows (dicts); :func:`report` prints them as one table and
writes them to ``bench/results/<name>.json``. Service URLs are the test suite's
(``tests.support.service``, overridden by the same ``LEASES_TEST_*_URL`` variables).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.service import require

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: A timed variant: entered (untimed) around each block, it yields the call to time, which
#: takes the call's index.
Block = Callable[[], AbstractContextManager[Callable[[int], Any]]]


def parser(doc: str) -> argparse.ArgumentParser:
    """The command line every script shares: ``--quick`` for a short run."""
    result = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    result.add_argument("--quick", action="store_true", help="a short run: fewer calls and runs")
    return result


def steady(call: Callable[[int], Any]) -> Block:
    """A variant that needs nothing around its blocks."""
    return lambda: nullcontext(call)


def interleaved(variants: Mapping[str, Block], *, calls: int, block: int) -> dict[str, list[float]]:
    """Seconds of each of ``calls`` calls per variant, run in alternating blocks of ``block``.

    The variants' order rotates every round, so drift on a shared machine hits all of them.
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for round_number, start in enumerate(range(0, calls, block)):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            out = times[name]
            with variants[name]() as call:
                for i in range(start, min(start + block, calls)):
                    started = clock()
                    call(i)
                    out.append(clock() - started)
    return times


def median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1000.0


def p90_ms(seconds: Sequence[float]) -> float:
    return statistics.quantiles(seconds, n=10)[-1] * 1000.0 if len(seconds) > 1 else float("nan")


def row(columns: str, *values: Any) -> dict[str, Any]:
    """A row of a table: the ``columns`` (names separated by spaces) and their ``values``."""
    return dict(zip(columns.split(), values, strict=True))


def available(service: str) -> str | None:
    """The URL of ``service`` as the tests use it, or None (said) when it does not answer."""
    try:
        return require(service)
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:
        print(f"{service}: left out ({exc.msg})", flush=True)
        return None


def report(name: str, rows: list[dict[str, Any]], *, quick: bool, title: str, **extra: Any) -> Path:
    """Print ``rows`` as a table; write them, ``extra``, the load and the versions to the
    result file."""
    print_rows(title, rows)
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    packages = ("celery", "kombu", "SQLAlchemy", "psycopg", "PyMySQL", "redis")
    machine = {
        "nproc": os.cpu_count(),
        "load": os.getloadavg(),
        "python": platform.python_version(),
    }
    document = {
        "benchmark": name,
        "command": f"python -m bench.{name}" + (" --quick" if quick else ""),
        "quick": quick,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine | {package: metadata.version(package) for package in packages},
        "title": title,
        "rows": rows,
        **extra,
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"\nwrote {path}", flush=True)
    return path


def print_rows(title: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Print rows of dicts as a Markdown table: one column per key, in order of appearance."""
    keys = list(dict.fromkeys(key for item in rows for key in item))
    cells = [[_cell(item.get(key)) for key in keys] for item in rows]
    widths = [max([len(key)] + [len(r[i]) for r in cells]) for i, key in enumerate(keys)]
    print(f"\n### {title}\n")
    for line in (keys, ["-" * w for w in widths], *cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
    print(flush=True)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, float):
        size = abs(value)
        return f"{value:,.0f}" if size >= 100 else f"{value:.{(size < 10) + (size < 0.1) + 1}f}"
    return str(value)


@contextlib.contextmanager
def scratch(url: str, tag: str, *, leases: bool = True, name: str | None = None) -> Iterator[str]:
    """A table name of this run's own in ``url`` (``name``, or one made of ``tag``); with
    ``leases`` the migrations make it a jobs table. On exit that table (and its migrations)
    and any ``<name>_*`` table (a unit log) are dropped."""
    from celery_leases.db import migrations
    from celery_leases.db.store import Store
    from celery_leases.settings import DEFAULTS, validate

    name = name or f"bench_{tag}_{uuid.uuid4().hex[:6]}"
    store = Store(validate(DEFAULTS | {"database_url": url, "table": name}))
    try:
        if leases:
            migrations.upgrade(store)
        yield name
    finally:
        try:
            if leases:
                migrations.downgrade(store)
        finally:
            store.engine.dispose()
        engine = sa.create_engine(url)
        try:
            with engine.begin() as connection:
                for table in sa.inspect(connection).get_table_names():
                    if table == name or table.startswith(f"{name}_"):
                        connection.execute(sa.text(f"DROP TABLE {table}"))
        finally:
            engine.dispose()


def bench_scenario(spawner: Any, url: str, table: str, broker: str) -> Any:
    """A :class:`~tests.support.scenario.Scenario` for a bench: ``broker``, the scratch leases
    ``table`` of ``url``, a queue of its own, a 30 s lease; no worker started."""
    from tests.support.scenario import Scenario

    return Scenario.create(
        spawner,
        broker={"broker_url": broker},
        database_url=url,
        table=table,
        queue=f"{table}_queue",
        lease_seconds=30.0,
    )


@contextlib.contextmanager
def redis_bed(url: str, tag: str, *, workers: int) -> Iterator[Any]:
    """A :class:`~tests.support.scenario.Scenario` of ``workers`` real workers on a private
    Redis, a scratch leases table of ``url`` and a queue of its own (a 30 s lease); every
    process killed at the end."""
    import tempfile

    from tests.support.scenario import kill_all
    from tests.support.service import private_redis_url
    from tests.support.worker import Spawner

    with (
        private_redis_url() as broker,
        tempfile.TemporaryDirectory(prefix=f"bench-{tag}-") as logs,
        scratch(url, tag) as table,
    ):
        spawner = Spawner(logs)
        bed = bench_scenario(spawner, url, table, broker)
        try:
            bed.start_workers(workers)
            yield bed
        finally:
            kill_all(spawner)
            bed.close()
