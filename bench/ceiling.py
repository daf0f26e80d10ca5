"""The leases database's ceiling: job lifecycles per second one PostgreSQL sustains as worker
processes grow, straight to the server and behind PgBouncer (transaction mode).

N real OS processes (1, 2, 4, 8, 16 by default), spawned, each with its own Store and
connections, loop job lifecycles on jobs of their own, as fast as they can (a closed loop):
record (``Store.register``, what ``apply_async`` sends), claim (bound to the process's
holder row, as a worker's claim is), one checkpoint of 100 B, finish; every call timed. They
are *simulated* workers: the store's lifecycle loop, as ``bench.operations`` calls it, without
Celery, its broker or a task body. Each also renews its holder row every renew interval (the
default, a third of the 30 s lease) between two lifecycles, as a prefork pool process's keeper
takes its turn on the process's connection: on the keeper's session, bound to it, straight to
the server; unbound behind PgBouncer, as the library's keeper renews there.

Each window (a number of processes, a way in) starts on an emptied table, after a
CHECKPOINT, with new processes; they connect and run 20 lifecycles each (past psycopg's
preparing of statements) before the window opens, then loop for ``--seconds`` (default 15;
quick 5). Each cell has ``--rounds`` windows (default 2; quick 1), every other round from the
most processes down, the two ways in alternating; a row is all its windows together
(``per_round``: each one's rate).

CPU over the window is read from ``/proc`` (2 cores, shared by the server and the clients), as
the scheduler's run time of each process's threads (``schedstat``; the workers keep their
connections, so their backends, until it has been read):
``server_cores`` is every ``postgres`` process (its backends, WAL writer, checkpointer,
autovacuum), ``backends_cores`` the backends serving this run (by ``application_name`` in
``pg_stat_activity``), ``pgbouncer_cores`` PgBouncer's, ``clients_cores`` the simulated
workers'; ``busy_cores`` the whole machine (``/proc/stat``, steal left out: ``steal_cores``
is what the host took), ``server_share`` the server's part of it. ``server_ms`` is the
server's CPU per lifecycle, ``per_server_core`` lifecycles per second of the server's CPU:
lifecycles / server CPU seconds. WAL bytes and WAL syncs per lifecycle come from
``pg_current_wal_lsn()`` and ``pg_stat_wal`` (the whole cluster's). Latencies in ms, each
store call timed around it in the process.

``--databases 2`` adds cells where the processes split over two databases of the same
server (process i uses database i % 2, each with its jobs table: what ``leases_routes`` does
with two routes), against one (``databases`` column): straight only. On one server the two
share its CPU and its WAL, so this measures what routing costs, not what a second server
gives.

    python -m bench.ceiling [--quick] [--processes 1 2 4 8 16] [--seconds S] [--rounds R]
        [--via direct pgbouncer] [--databases 1 2]
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import time
import uuid
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from bench.common import available, parser, report, row, scratch
from bench.operations import (
    checkpoint,
    claim,
    engine,
    finish,
    keeper_session,
    open_store,
    register,
    renew_holder,
    state_text,
)

STATEMENTS = ("record", "claim", "checkpoint", "finish")
#: Lifecycles each process runs before the window (psycopg prepares a statement at its 6th run).
WARM_UP = 20
CHECKPOINT_BYTES = 100
#: Seconds to wait for the processes to start and warm up, and to report after the window.
START_TIMEOUT = 180.0
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")

COLUMNS = (
    "via databases processes lifecycles lifecycles_per_s per_round"
    + "".join(f" {s}_p50 {s}_p99" for s in STATEMENTS)
    + " ticks tick_p50 server_cores backends_cores pgbouncer_cores clients_cores busy_cores"
    + " steal_cores"
    + " server_share server_ms per_server_core wal_bytes wal_syncs"
)


# -- a simulated worker process --------------------------------------------------------------


def simulate(
    url: str, table: str, via: str, index: int, processes: int, seconds: float,
    app_name: str, ready: Any, start: Any, results: Any, release: Any,
) -> None:  # fmt: skip
    """One simulated worker: open a Store, warm up, wait for ``start``, loop lifecycles for
    ``seconds``; put what it measured on ``results``; close its connections at ``release``
    (their backends' CPU time goes when they end, so not before it has been read)."""
    options = {"connect_args": {"application_name": app_name}}
    store = open_store(url, table, engine_options=options)
    session = keeper_session(store) if via == "direct" else None
    holder = f"ceiling-{index}-{uuid.uuid4().hex[:6]}"
    renew_holder(store, holder, session)
    state = state_text(CHECKPOINT_BYTES)
    times = {name: array("d") for name in STATEMENTS}
    for n in range(WARM_UP):
        lifecycle(store, f"warm-{index}-{n}", holder, state, None)
    engine(store).pool.dispose()  # the migrations' pooled connection: a worker keeps none
    ready.put(os.getpid())
    start.wait()
    clock = time.perf_counter
    began = clock()
    deadline = began + seconds
    interval = store.settings.renew_interval
    next_tick = began + interval * (index + 1) / (processes + 1)  # keepers out of phase
    ticks = array("d")
    done = n = 0
    while clock() < deadline:
        if clock() >= next_tick:
            started = clock()
            renew_holder(store, holder, session)
            ticks.append(clock() - started)
            next_tick += interval
        lifecycle(store, f"p{index}-{n}", holder, state, times)
        n += 1
        done += clock() <= deadline
    results.put(
        {
            "index": index,
            "lifecycles": done,
            "times": {name: values.tobytes() for name, values in times.items()},
            "ticks": ticks.tobytes(),
        }
    )
    release.wait()
    if session is not None:
        session.close()
    engine(store).dispose()


def lifecycle(
    store: Any, job_id: str, holder: str, state: str, times: dict[str, array[float]] | None
) -> None:
    """Record, claim, checkpoint and finish the job ``job_id``; each call's seconds appended
    to ``times[statement]`` (None: untimed)."""
    clock = time.perf_counter
    t0 = clock()
    register(store, job_id)
    t1 = clock()
    token = claim(store, job_id, holder)
    t2 = clock()
    checkpoint(store, job_id, token, state)
    t3 = clock()
    finish(store, job_id, token)
    t4 = clock()
    if times is not None:
        for name, seconds in zip(STATEMENTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[name].append(seconds)


# -- what the server and the machine did over the window -------------------------------------


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's command name and CPU time so far, in seconds: the scheduler's run time
    of each of its threads (``/proc/<pid>/task/*/schedstat``). Not ``utime`` and ``stime``:
    this kernel samples those at its clock ticks, which miss processes that run for a tenth of
    a millisecond at a time, as a backend serving one statement does (they read 0 here)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/comm") as file:
                name = file.read().strip()
            nanoseconds = 0
            for task in os.scandir(f"/proc/{entry.name}/task"):
                with open(f"{task.path}/schedstat") as file:
                    nanoseconds += int(file.read().split()[0])
        except OSError:
            continue  # it ended meanwhile
        found[int(entry.name)] = (name, nanoseconds / 1e9)
    return found


def machine_idle() -> tuple[float, float]:
    """Seconds the machine's cores spent idle (or waiting for I/O), and stolen by the host,
    so far (``/proc/stat``: idle time there is measured, not sampled)."""
    with open("/proc/stat") as file:
        fields = list(map(int, file.readline().split()[1:9]))
    idle, wait, steal = fields[3], fields[4], fields[7]
    return (idle + wait) / TICKS_PER_SECOND, steal / TICKS_PER_SECOND


def server_counters(connection: sa.Connection) -> tuple[int, int]:
    """The cluster's WAL position (bytes) and WAL syncs so far."""
    lsn = connection.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one()
    syncs = connection.execute(sa.text("SELECT wal_sync FROM pg_stat_wal")).scalar_one()
    return int(lsn), int(syncs)


def backends(connection: sa.Connection, app_name: str) -> set[int]:
    """The server processes whose session last said ``app_name``: this cell's backends."""
    sql = "SELECT pid FROM pg_stat_activity WHERE application_name = :name"
    return set(connection.execute(sa.text(sql), {"name": app_name}).scalars())


def cores(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
          pids: set[int] | None, name: str | None, seconds: float) -> float:  # fmt: skip
    """Cores the processes ``pids`` (None: any) named ``name`` (None: any) kept busy."""
    used = 0.0
    for pid, (comm, now) in after.items():
        if (pids is None or pid in pids) and (name is None or comm == name):
            earlier = before.get(pid)
            used += now - (earlier[1] if earlier and earlier[0] == comm else 0.0)
    return used / seconds


# -- a cell: N processes, one way in -----------------------------------------------------------


@contextlib.contextmanager
def admin(url: str) -> Iterator[sa.Connection]:
    """A connection of the bench's own to the server, in autocommit."""
    connection_engine = sa.create_engine(url, connect_args={"application_name": "bench-ceiling"})
    try:
        with connection_engine.connect() as connection:
            yield connection.execution_options(isolation_level="AUTOCOMMIT")
    finally:
        connection_engine.dispose()


@contextlib.contextmanager
def second_database(server: sa.Connection, url: str) -> Iterator[str]:
    """The URL of a database of this run's own on ``url``'s server, dropped on exit."""
    name = f"bench_ceiling_{uuid.uuid4().hex[:6]}"
    server.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield str(sa.make_url(url).set(database=name).render_as_string(hide_password=False))
    finally:
        server.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


def empty(connection: sa.Connection, table: str) -> None:
    """Empty the jobs, holders and keys tables, and checkpoint: each cell starts the same."""
    connection.execute(sa.text(f"TRUNCATE {table}, {table}_holders, {table}_keys"))
    connection.execute(sa.text("CHECKPOINT"))


def window(
    servers: list[sa.Connection], urls: list[str], table: str, via: str, processes: int,
    seconds: float,
) -> dict[str, Any]:  # fmt: skip
    """Run ``processes`` simulated workers for ``seconds``, process i through ``urls[i %
    len(urls)]``: what they and the machine did (lifecycles, each call's seconds, cores
    used, WAL). ``servers``: a connection to each of those databases."""
    for connection in servers:
        empty(connection, table)
    server = servers[0]
    app_name = f"bench-ceiling-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")
    ready, results = context.Queue(), context.Queue()
    start, release = context.Event(), context.Event()
    workers = [
        context.Process(
            target=simulate,
            args=(
                urls[i % len(urls)],
                table,
                via,
                i,
                processes,
                seconds,
                app_name,
                ready,
                start,
                results,
                release,
            ),
            daemon=True,
        )
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        clients = {ready.get(timeout=START_TIMEOUT) for _ in workers}
        ours = backends(server, app_name)
        counters, idle, steal = server_counters(server), *machine_idle()
        cpu = cpu_seconds()
        opened = time.monotonic()
        start.set()
        time.sleep(seconds)
        cpu_after, (idle_after, steal_after) = cpu_seconds(), machine_idle()
        elapsed = time.monotonic() - opened
        counters_after = server_counters(server)
        ours |= backends(server, app_name)
        measured = [results.get(timeout=START_TIMEOUT) for _ in workers]
    finally:
        release.set()
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    return {
        "lifecycles": sum(m["lifecycles"] for m in measured),
        "seconds": seconds,
        "times": {name: b"".join(m["times"][name] for m in measured) for name in STATEMENTS},
        "ticks": b"".join(m["ticks"] for m in measured),
        "server": cores(cpu, cpu_after, None, "postgres", elapsed),
        "backends": cores(cpu, cpu_after, ours, "postgres", elapsed),
        "pgbouncer": cores(cpu, cpu_after, None, "pgbouncer", elapsed),
        "clients": cores(cpu, cpu_after, clients, None, elapsed),
        "busy": (os.cpu_count() or 1) - (idle_after - idle + steal_after - steal) / elapsed,
        "steal": (steal_after - steal) / elapsed,
        "wal": counters_after[0] - counters[0],
        "syncs": counters_after[1] - counters[1],
    }


def summary(
    via: str, databases: int, processes: int, windows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The row of ``windows`` of one cell: lifecycles and CPU over all of them, percentiles
    of all their calls."""
    done = sum(w["lifecycles"] for w in windows)
    seconds = sum(w["seconds"] for w in windows)

    def mean(key: str) -> float:
        return float(sum(w[key] * w["seconds"] for w in windows) / seconds)

    latencies = []
    for name in STATEMENTS:
        seen = merged(w["times"][name] for w in windows)
        latencies += [percentile(seen, 50), percentile(seen, 99)]
    ticks = merged(w["ticks"] for w in windows)
    server, busy = mean("server"), mean("busy")
    per_round = " / ".join(f"{w['lifecycles'] / w['seconds']:,.0f}" for w in windows)
    values = (
        via, databases, processes, done, done / seconds, per_round, *latencies,
        len(ticks), percentile(ticks, 50),
        server, mean("backends"), mean("pgbouncer") if via == "pgbouncer" else None,
        mean("clients"), busy, mean("steal"), server / busy if busy else None,
        server * seconds * 1000 / max(done, 1),
        done / (server * seconds) if server else None,
        sum(w["wal"] for w in windows) / max(done, 1),
        sum(w["syncs"] for w in windows) / max(done, 1),
    )  # fmt: skip
    return row(COLUMNS, *values)


def merged(parts: Iterable[bytes]) -> list[float]:
    values = array("d")
    for part in parts:
        values.frombytes(part)
    return sorted(values)


def percentile(ordered: list[float], p: int) -> float | None:
    """The ``p``-th percentile of ``ordered`` (seconds), in ms (None: no value)."""
    if not ordered:
        return None
    if len(ordered) == 1:
        return ordered[0] * 1000
    return statistics.quantiles(ordered, n=100, method="inclusive")[p - 1] * 1000


def main(argv: Sequence[str] | None = None) -> None:
    command = parser(__doc__)
    command.add_argument("--processes", nargs="+", type=int, default=(1, 2, 4, 8, 16))
    command.add_argument("--seconds", type=float, help="window per cell (default 15; quick 5)")
    command.add_argument("--rounds", type=int, help="windows per cell (default 2; quick 1)")
    command.add_argument(
        "--via", nargs="+", choices=("direct", "pgbouncer"), default=("direct", "pgbouncer")
    )
    command.add_argument("--databases", nargs="+", type=int, choices=(1, 2), default=(1,))
    args = command.parse_args(argv)
    seconds = args.seconds or (5.0 if args.quick else 15.0)
    rounds = args.rounds or (1 if args.quick else 2)
    direct = available("postgres")
    if direct is None:
        raise SystemExit("PostgreSQL does not answer")
    found = {"direct": direct, "pgbouncer": available("pgbouncer")}
    urls = {via: url for via, url in found.items() if url is not None and via in args.via}
    cells = [(via, 1) for via in urls if 1 in args.databases]
    if 2 in args.databases:
        cells.append(("direct", 2))
    windows: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        table = stack.enter_context(scratch(direct, "ceiling"))
        server = stack.enter_context(admin(direct))
        second: list[tuple[str, sa.Connection]] = []
        if 2 in args.databases:
            other = stack.enter_context(second_database(server, direct))
            stack.enter_context(scratch(other, "ceiling", name=table))
            second = [(other, stack.enter_context(admin(other)))]
        for round_number in range(rounds):
            # Every other round runs from the most processes down; the cells alternate.
            order = args.processes if round_number % 2 == 0 else args.processes[::-1]
            for step, processes in enumerate(order):
                shift = (step + round_number) % len(cells)
                for via, databases in cells[shift:] + cells[:shift]:
                    print(
                        f"  round {round_number + 1}: {via}, {databases} database(s), "
                        f"{processes} processes",
                        flush=True,
                    )
                    extra = second if databases == 2 else []
                    measured = window(
                        [server, *(c for _, c in extra)],
                        [urls[via], *(u for u, _ in extra)],
                        table, via, processes, seconds,
                    )  # fmt: skip
                    windows.setdefault((via, databases, processes), []).append(measured)
    rows = [
        summary(via, databases, processes, windows[via, databases, processes])
        for processes in args.processes
        for via, databases in cells
    ]
    title = (
        "Job lifecycles (record, claim, 100 B checkpoint, finish) per second from N simulated"
        " worker processes, PostgreSQL straight and behind PgBouncer; latencies in ms"
    )
    report(
        "ceiling", rows, quick=args.quick, title=title, seconds=seconds, warm_up=WARM_UP,
        checkpoint_bytes=CHECKPOINT_BYTES, processes=args.processes,
        cells=[f"{via}x{databases}" for via, databases in cells], rounds=rounds,
        run_seconds=time.monotonic() - started,
    )  # fmt: skip


if __name__ == "__main__":
    main()
