"""The connection budget: a prefork worker keeps one leases connection per process at rest,
whatever it ran (leased jobs, a pool process killed mid-job, reaper passes). Counted by
PostgreSQL itself (``pg_stat_activity``): the connections with an ``application_name`` of the
test's own. A reaper pass opens one of its own and closes it when it ends (none kept idle
between passes), so what is counted is the connections that last across several passes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases.process import proc_stat
from tests.support.scenario import Scenario, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
]

MakeScenario = Callable[..., Scenario]
POOL_PROCESSES = 3


def connections(database_url: str, name: str) -> set[tuple[Any, ...]]:
    """The connections PostgreSQL holds for ``application_name`` ``name``: each its backend's
    pid and start, and its last statement and client port (what a failure prints)."""
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as connection:
            query = (
                "SELECT pid, backend_start, left(query, 80), client_port FROM pg_stat_activity"
                " WHERE application_name = :name"
            )
            return {tuple(r) for r in connection.execute(sa.text(query), {"name": name})}
    finally:
        engine.dispose()


def holders(ports: set[int], s: Scenario) -> dict[int, str]:
    """Which process of this machine holds each local TCP port of ``ports``: the scenario's
    worker (main process or pool process), its beat, or another (pid and command)."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if port in ports:
                    inodes[fields[9]] = port
    mains = {p.pid: p.name for p in s.spawn.processes if p.process is not None}
    found: dict[int, str] = {}
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(fd)
            inode = target.removeprefix("socket:[").removesuffix("]")
            if inode in inodes:
                pid = int(fd.parts[2])
                parent = int(proc_stat(pid)[1])
                found[inodes[inode]] = (
                    f"{mains[pid]} main process {pid}"
                    if pid in mains
                    else f"{mains[parent]} pool process {pid}"
                    if parent in mains
                    else f"process {pid} {Path(f'/proc/{pid}/cmdline').read_text()[:60]!r}"
                )
    return found


def lasting(database_url: str, name: str, seconds: float) -> set[tuple[Any, ...]]:
    """The connections held both now and ``seconds`` later (the same backends)."""
    first = {row[:2] for row in connections(database_url, name)}
    time.sleep(seconds)
    return {row for row in connections(database_url, name) if row[:2] in first}


def test_a_prefork_worker_at_rest_keeps_one_connection_per_pool_process(
    scenario: MakeScenario, celery_settings: dict[str, Any], database_url: str
) -> None:
    # Given a worker with three pool processes whose leases connections carry a name of their
    # own, and a beat reaping every second
    name = f"leases-{uuid.uuid4().hex[:8]}"
    options = {"connect_args": {"application_name": name}}
    s = scenario(
        {**celery_settings, "leases_engine_options": options},
        lease_seconds=2.0,
        renew_seconds=0.5,
        reaper_every=1.0,
    )
    s.app.conf.leases_engine_options = None  # this test process's own are not counted
    s.start_workers(1, concurrency=POOL_PROCESSES)
    s.start_beat()

    # When it has run leased jobs on every pool process, seen one of them killed mid-job
    # (its job resumed), and run reaper passes
    jobs = [s.send("e2e.units", 6, 0.1) for _ in range(2 * POOL_PROCESSES)]
    row = s.wait_unit(jobs[0], unit=2, timeout=30)
    os.kill(row.pid, signal.SIGKILL)
    for job_id in jobs:
        assert s.wait_finished(job_id, timeout=60).state == "done"
    s.send("e2e.units", 1, 0.0)  # one more, after the pool replaced its process

    # Then, at rest, it keeps one connection per process at most: each pool process its
    # keeper's session (which its task's statements share), the main process the one it
    # handed the dead process's job back on; a reaper pass's own lives as long as the pass
    processes = POOL_PROCESSES + 1
    held: set[tuple[Any, ...]] = set()

    def settled() -> bool:
        nonlocal held
        held = lasting(database_url, name, seconds=3.0)  # three reaper passes
        return 1 <= len(held) <= processes

    try:
        wait_for(settled, timeout=30, interval=0.1, what="the worker's connections to settle")
    except AssertionError as e:
        owners = holders({row[3] for row in held}, s)
        lines = "\n".join(f"  {row[:3]} held by {owners.get(row[3], '?')}" for row in sorted(held))
        raise AssertionError(f"{e}: {len(held)} > {processes} held:\n{lines}") from None
