"""What every benchmark shares: service URLs, scratch tables, timing statistics, tables, results.

Service URLs default to the test suite's (``tests.services``) and can be overridden with the
same variables: ``LEASES_TEST_POSTGRES_URL``, ``LEASES_TEST_MARIADB_URL``,
``LEASES_TEST_REDIS_URL``, ``LEASES_TEST_RABBITMQ_URL``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine.interfaces import CacheStats

from celery_leases.config import DEFAULTS, Settings, validate

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

POSTGRES_URL = os.environ.get(
    "LEASES_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MARIADB_URL = os.environ.get("LEASES_TEST_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("LEASES_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("LEASES_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


# -- command line and results ---------------------------------------------------------------------


def arguments(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The common command line: ``--quick`` for a short run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a short run (fewer calls and runs)")
    return parser.parse_args(argv)


def write_result(name: str, data: Mapping[str, Any], *, quick: bool) -> Path:
    """Write ``bench/results/<name>.json`` (the figures plus when, how and where) and return it."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    document = {
        "benchmark": name,
        "quick": quick,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": f"python -m bench.{name}" + (" --quick" if quick else ""),
        "machine": machine(),
        **data,
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"\nwrote {path.relative_to(REPO_ROOT)}")
    return path


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a Markdown table (so it pastes into docs/benchmarks.md as is)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    print(f"\n### {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    sys.stdout.flush()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3f}"
    return str(value)


# -- statistics ---------------------------------------------------------------------------------


def ms(seconds: Sequence[float]) -> list[float]:
    return [s * 1000.0 for s in seconds]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between neighbours."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(seconds: Sequence[float]) -> dict[str, float]:
    """Median, p90, p99, mean and count of durations given in seconds; figures in ms."""
    values = ms(seconds)
    return {
        "n": len(values),
        "median_ms": statistics.median(values),
        "p90_ms": percentile(values, 0.90),
        "p99_ms": percentile(values, 0.99),
        "mean_ms": statistics.fmean(values),
    }


def interleaved(
    variants: Mapping[str, Callable[[int], Any]], *, calls: int, block: int
) -> dict[str, list[float]]:
    """Time ``calls`` calls of each variant, alternating blocks of ``block`` calls.

    Each variant is called with the call's index (0..calls-1, distinct per variant). The order
    of the variants rotates every round, so drift on a noisy machine hits all of them alike.
    Returns each variant's durations in seconds.
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    done = 0
    round_number = 0
    clock = time.perf_counter
    while done < calls:
        size = min(block, calls - done)
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            call = variants[name]
            out = times[name]
            for i in range(done, done + size):
                started = clock()
                call(i)
                out.append(clock() - started)
        done += size
        round_number += 1
    return times


# -- databases ------------------------------------------------------------------------------------


def settings(database_url: str, table: str, **overrides: Any) -> Settings:
    """Validated celery-leases settings for ``table`` in ``database_url``."""
    return validate(DEFAULTS | {"database_url": database_url, "table": table} | overrides)


def scratch_name(tag: str) -> str:
    """A table name of this run's own: ``bench_<tag>_<6 hex>``."""
    return f"bench_{tag}_{uuid.uuid4().hex[:6]}"


def drop_tables(database_url: str, prefix: str) -> None:
    """Drop every table named ``prefix`` or starting with ``prefix_`` (SQLite: delete the file)."""
    if database_url.startswith("sqlite"):
        path = sa.engine.make_url(database_url).database
        if path:
            for suffix in ("", "-wal", "-shm", "-journal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + suffix)
        return
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as connection:
            for table in sa.inspect(connection).get_table_names():
                if table == prefix or table.startswith(f"{prefix}_"):
                    sa.Table(table, sa.MetaData()).drop(connection, checkfirst=True)
    finally:
        engine.dispose()


@contextlib.contextmanager
def scratch_table(database_url: str, tag: str) -> Iterator[str]:
    """A table name of this run's own in ``database_url``; dropped on exit."""
    name = scratch_name(tag)
    try:
        yield name
    finally:
        drop_tables(database_url, name)


def sqlite_url(tag: str) -> str:
    """URL of a fresh SQLite file for this run (under TMPDIR)."""
    folder = Path(os.environ.get("TMPDIR", "/tmp"))
    return f"sqlite:///{folder}/bench-{tag}-{uuid.uuid4().hex[:6]}.sqlite3"


def reachable(database_url: str) -> str | None:
    """None if the database answers, else the error text."""
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        engine.dispose()
    return None


class StatementCounter:
    """Counts what an engine sends: SQL statements (``before_cursor_execute``), and the
    connection checkouts (each costs a ping with ``pool_pre_ping``), commits and rollbacks.

    Also counts SQLAlchemy compiled-cache misses, so a statement that is compiled on every call
    shows up.
    """

    def __init__(self, engine: sa.engine.Engine) -> None:
        self.engine = engine
        self.statements = 0
        self.checkouts = 0
        self.commits = 0
        self.rollbacks = 0
        self.cache_misses = 0
        self.last: list[tuple[str, Any]] = []
        self._listeners: list[tuple[Any, str, Callable[..., Any]]] = [
            (engine, "before_cursor_execute", self._on_execute),
            (engine, "commit", self._on_commit),
            (engine, "rollback", self._on_rollback),
            (engine.pool, "checkout", self._on_checkout),
        ]
        for target, name, fn in self._listeners:
            sa.event.listen(target, name, fn)

    def _on_execute(
        self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool
    ) -> None:
        self.statements += 1
        self.last.append((statement, params))
        if getattr(context, "cache_hit", None) is CacheStats.CACHE_MISS:
            self.cache_misses += 1

    def _on_commit(self, conn: Any) -> None:
        self.commits += 1

    def _on_rollback(self, conn: Any) -> None:
        self.rollbacks += 1

    def _on_checkout(self, *args: Any) -> None:
        self.checkouts += 1

    def reset(self) -> None:
        self.statements = self.checkouts = self.commits = self.rollbacks = 0
        self.cache_misses = 0
        self.last = []

    def counts(self) -> dict[str, int]:
        return {
            "statements": self.statements,
            "checkouts": self.checkouts,
            "commits": self.commits,
            "rollbacks": self.rollbacks,
            "cache_misses": self.cache_misses,
        }

    def close(self) -> None:
        for target, name, fn in self._listeners:
            sa.event.remove(target, name, fn)


# -- brokers --------------------------------------------------------------------------------------


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A Redis URL on a database number nobody else uses (the test suite's claim scheme)."""
    from tests.services import private_redis_url

    with private_redis_url() as url:
        yield url


def delete_rabbitmq(queue: str) -> None:
    """Delete ``queue`` and the exchanges named after it on RabbitMQ (missing ones are fine)."""
    from tests.services import delete_rabbitmq_entities

    control = f"{queue}_control"
    delete_rabbitmq_entities(
        RABBITMQ_URL,
        queues=[queue],
        exchanges=[queue, f"{control}.pidbox", f"reply.{control}.pidbox"],
    )


# -- the machine ----------------------------------------------------------------------------------

_machine: dict[str, Any] | None = None


def machine() -> dict[str, Any]:
    """nproc, memory, CPU, kernel, and the versions of everything measured (cached)."""
    global _machine
    if _machine is not None:
        return _machine
    from importlib.metadata import PackageNotFoundError, version

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cpu": _cpu_model(),
        "kernel": platform.release(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
    }
    for package in ("celery", "kombu", "billiard", "SQLAlchemy", "psycopg", "PyMySQL", "redis"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    import sqlite3

    info["sqlite"] = sqlite3.sqlite_version
    info["postgresql"] = _server_version(POSTGRES_URL, "SHOW server_version")
    info["mariadb"] = _server_version(MARIADB_URL, "SELECT VERSION()")
    info["redis_server"] = _redis_version()
    info["rabbitmq"] = _rabbitmq_version()
    _machine = info
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _server_version(url: str, query: str) -> str | None:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return str(connection.execute(sa.text(query)).scalar())
    except Exception:
        return None
    finally:
        engine.dispose()


def _redis_version() -> str | None:
    try:
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=3)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()
    except Exception:
        return None


def _rabbitmq_version() -> str | None:
    try:
        import kombu

        with kombu.Connection(RABBITMQ_URL, connect_timeout=3) as connection:
            connection.connect()
            props = connection.connection.server_properties
            value = props.get("version")
            return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:
        return None


def run_module(name: str, *, quick: bool, timeout: float | None = None) -> int:
    """Run ``python -m bench.<name> [--quick]`` in a subprocess; its exit status."""
    command = [sys.executable, "-m", f"bench.{name}"] + (["--quick"] if quick else [])
    try:
        return subprocess.run(command, cwd=REPO_ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"bench.{name} took longer than {timeout:.0f} s: stopped", file=sys.stderr)
        return -1


# -- celery workers -------------------------------------------------------------------------------


def bench_worker(
    config: dict[str, Any],
    *,
    counter_url: str,
    run: str,
    concurrency: int,
    log_dir: str | os.PathLike[str],
    loglevel: str = "warning",
) -> Any:
    """A started ``celery -A bench.worker_app worker -P prefork -c <concurrency>`` subprocess,
    ready (its ``worker_ready`` signal reached Redis); stop it with ``.stop()``."""
    import redis

    from bench.worker_app import worker_env
    from tests.workers import Worker

    class BenchWorker(Worker):
        # The worker logs at WARNING, so readiness comes from Redis, not from the log.
        ready_pattern = re.compile("")

    worker = BenchWorker(
        "bench.worker_app",
        env=worker_env(config, counter_url=counter_url, run=run),
        pool="prefork",
        concurrency=concurrency,
        loglevel=loglevel,
        log_dir=log_dir,
    )
    worker.start()
    client = redis.Redis.from_url(counter_url)
    try:
        deadline = time.monotonic() + 60
        while not client.exists(f"{run}:ready"):
            if not worker.is_alive() or time.monotonic() > deadline:
                worker.stop(timeout=5)
                raise RuntimeError(
                    f"worker did not start; log {worker.log_path}:\n{worker.log_tail()}"
                )
            time.sleep(0.05)
    finally:
        client.close()
    return worker


def wait_done(
    counter_url: str, run: str, total: int, *, worker: Any, timeout: float
) -> dict[str, Any]:
    """Wait until ``total`` tasks of ``run`` completed; their first/last completion times
    (epoch seconds) and the SQL statements counted by kind."""
    import redis

    client = redis.Redis.from_url(counter_url)
    try:
        deadline = time.monotonic() + timeout
        while int(client.get(f"{run}:done") or 0) < total:
            if not worker.is_alive():
                raise RuntimeError(f"worker died; log {worker.log_path}:\n{worker.log_tail()}")
            if time.monotonic() > deadline:
                done = int(client.get(f"{run}:done") or 0)
                raise RuntimeError(
                    f"only {done}/{total} tasks done after {timeout:.0f} s; "
                    f"log {worker.log_path}:\n{worker.log_tail()}"
                )
            time.sleep(0.02)
        counted: dict[bytes, bytes] = client.hgetall(f"{run}:sql")  # type: ignore[assignment]
        sql = {k.decode(): int(v) for k, v in counted.items()}
        return {
            "done": int(client.get(f"{run}:done") or 0),
            "first": float(client.get(f"{run}:first") or 0),
            "last": float(client.get(f"{run}:last") or 0),
            "sql": sql,
        }
    finally:
        client.close()
