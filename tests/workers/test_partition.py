"""A worker cut off from the leases database (a network partition), end to end.

Worker A reaches PostgreSQL through a TCP proxy in this process (``tests.support.proxy``),
worker B directly. While A runs a job, the proxy black-holes A's connections: they stay open,
nothing goes through them either way, and what A sends meanwhile is held and delivered when
the partition heals. A sees no error, only statements that never answer, so its keeper's
renewals and its task's next statement wait; the job must move to B once A's lease has run out
by the database clock, and A's held writes, landing after B's, must be refused by the fence.

Triggers (``chaos.app``) record every committed checkpoint and every change of the job's state
or token, with the database's time, so the test reads what landed and in which order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa

from chaos.app import (
    install_checkpoint_log,
    install_state_log,
    remove_checkpoint_log,
    remove_state_log,
)
from tests.support.proxy import TcpProxy
from tests.support.scenario import LEASED_APP, Scenario, check_unit_log, start_all
from tests.support.worker import Spawner, Worker

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("database_url", ["postgres"], indirect=True),
    pytest.mark.parametrize("broker_url", ["redis"], indirect=True),
]

LEASE_SECONDS = 3.0
RENEW_SECONDS = 0.5
REAPER_EVERY = 0.5
UNITS = 150
UNIT_SECONDS = 0.05


@dataclass
class History:
    """What landed in the database: every committed checkpoint and every change of a job's
    state or token, each with the database's time (epoch seconds), in the order they landed."""

    engine: sa.Engine
    table: str
    checkpoint_log: sa.Table
    state_log: sa.Table

    def checkpoints(self, job_id: str) -> list[tuple[str, int, float]]:
        """(checkpoint JSON, the job's token, time) of each checkpoint write."""
        c = self.checkpoint_log.c
        query = sa.select(c.checkpoint, c.token, c.at).where(c.job_id == job_id).order_by(c.id)
        with self.engine.connect() as connection:
            return [(str(j), int(t), float(at)) for j, t, at in connection.execute(query)]

    def states(self, job_id: str) -> list[tuple[str, int, float]]:
        """(state, token, time) of each change of the job's state or token."""
        c = self.state_log.c
        query = sa.select(c.state, c.token, c.at).where(c.job_id == job_id).order_by(c.id)
        with self.engine.connect() as connection:
            return [(str(s), int(t), float(at)) for s, t, at in connection.execute(query)]

    def last_renewal(self, worker: Worker) -> float:
        """When ``worker``'s keepers last renewed their holder rows (database time)."""
        holders = sa.table(f"{self.table}_holders", sa.column("owner"), sa.column("renewed_at"))
        query = sa.select(sa.func.max(holders.c.renewed_at)).where(
            holders.c.owner.like(f"{worker.name}@%")
        )
        with self.engine.connect() as connection:
            return float(connection.execute(query).scalar_one())


@pytest.fixture
def proxy(database_url: str) -> Iterator[TcpProxy]:
    target = urlsplit(database_url)
    tcp = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    tcp.start()
    yield tcp
    tcp.close()


def proxied(database_url: str, proxy: TcpProxy) -> str:
    target = urlsplit(database_url)
    url = database_url.replace(
        f"@{target.hostname}:{target.port or 5432}", f"@127.0.0.1:{proxy.port}"
    )
    assert url != database_url
    return url


@pytest.fixture
def history(database_url: str, table_name: str) -> Iterator[History]:
    engine = sa.create_engine(database_url)
    found = History(
        engine,
        table_name,
        install_checkpoint_log(engine, table_name),
        install_state_log(engine, table_name),
    )
    yield found
    remove_checkpoint_log(engine, table_name)
    remove_state_log(engine, table_name)
    engine.dispose()


def logged_at(match: re.Match[str]) -> float:
    """The time (epoch seconds, this host's clock) of the worker log line ``match`` is in."""
    start = match.string.rfind("\n[", 0, match.start()) + 2
    return datetime.strptime(match.string[start : start + 23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_worker_cut_off_from_the_database_loses_its_job_and_none_of_its_late_writes_land(
    scenario: Callable[..., Scenario],
    celery_settings: dict[str, Any],
    spawn: Spawner,
    proxy: TcpProxy,
    history: History,
    database_url: str,
) -> None:
    # Given worker A, whose leases database is behind the proxy, a beat reaping every 0.5 s,
    # a 3 s lease renewed every 0.5 s, and a job of 150 units of 0.05 s running on A
    # (acks_late: while A runs it, A reserves no other message, so the job's next delivery
    # cannot wait in A)
    s = scenario(
        celery_settings,
        lease_seconds=LEASE_SECONDS,
        renew_seconds=RENEW_SECONDS,
        reaper_every=REAPER_EVERY,
        acks_late=True,
    )
    a = spawn.worker(
        LEASED_APP, env=s.env | {"E2E_DATABASE_URL": proxied(database_url, proxy)}, start=False
    )
    start_all([a, spawn.beat(LEASED_APP, env=s.env, max_interval=1, start=False)])
    s.workers.append(a)
    job_id = s.send("e2e.units", UNITS, UNIT_SECONDS)
    first = s.wait_unit(job_id, unit=0, timeout=30)
    assert s.worker_of(first) is a
    # and worker B, connected directly, started once A runs the job
    (b,) = s.start_workers(1)
    s.wait_unit(job_id, unit=s.log.rows(job_id)[-1].unit + 3, timeout=10)

    # When A's database connections are black-holed
    proxy.blackhole()
    cut_at = s.log.now()

    # Then B claims the job once A's lease has run out, with a newer token, and resumes it
    resumed = s.wait_unit(job_id, unit=0, run_other_than=first.run, timeout=LEASE_SECONDS + 20)
    assert s.worker_of(resumed) is b and resumed.token is not None
    assert first.token is not None and resumed.token > first.token
    renewed = max(  # A's lease ended one lease after this: its last checkpoint or renewal
        [history.last_renewal(a)]
        + [at for _, token, at in history.checkpoints(job_id) if token == first.token]
    )

    # When the partition heals while B still runs, 20 checkpoints past A's
    s.wait_unit(job_id, unit=resumed.unit + 20, timeout=20)
    assert (s.job(job_id).state, s.job(job_id).token) == ("running", resumed.token)
    healed_at = s.log.now()
    proxy.heal()

    # Then A's attempt stops (LeaseLost) once its held statements land: the fence refuses them
    stopped = a.wait_for_log(
        rf"job {job_id}: attempt with token {first.token} stopped, lease lost", timeout=15
    )
    job = s.wait_finished(job_id, timeout=40)
    # and B ended the job: done under B's token, never touched by A after B claimed it
    assert (job.state, job.token, job.attempts, job.result) == ("done", resumed.token, 2, UNITS)
    states = history.states(job_id)
    assert [(state, token) for state, token, _ in states] == [
        ("queued", 0),
        ("running", first.token),
        ("queued", first.token),  # the reaper, once A's lease had run out
        ("running", resumed.token),
        ("done", resumed.token),
    ], states
    claimed_at = states[3][2]
    assert claimed_at >= renewed + LEASE_SECONDS - 0.01, (claimed_at, renewed)
    # and the stored checkpoint went 1, 2, ..., 150, each once: never backwards
    checkpoints = history.checkpoints(job_id)
    assert [text for text, _, _ in checkpoints] == [
        f'{{"next":{n}}}' for n in range(1, UNITS + 1)
    ], checkpoints
    assert all(token == resumed.token for _, token, at in checkpoints if at > claimed_at)
    # and every unit was committed once, B starting at A's last committed checkpoint. A's
    # unit-log start rows are committed on their own, unfenced (a marker, not a unit's
    # write): one A sent during the partition may land after the heal, never committed.
    rows = s.log.rows(job_id)
    late = [r for r in rows if r.run == first.run and r.started_at > healed_at]
    assert len(late) <= 1 and not any(r.committed for r in late), late
    stale, resumed_run = check_unit_log([r for r in rows if r not in late], UNITS, crashes=1)
    assert (stale.id, resumed_run.id, resumed_run.first.unit) == (
        first.run,
        resumed.run,
        resumed.unit,
    )
    assert all(u.ended_at is not None and u.ended_at < claimed_at for u in stale.committed)

    # How long A's code went on without a lease (pytest -s): its last write, and when it raised
    # LeaseLost, each after its last renewal (docs/operating.md, "A dead process or host")
    landed = max(
        [at for _, token, at in checkpoints if token == first.token]
        + [t for r in stale.units for t in (r.started_at, r.ended_at) if t]
    )
    print(
        f"\ncut off {cut_at - renewed:.2f} s after A's last renewal (lease {LEASE_SECONDS} s); "
        f"A's last write before the heal landed {landed - renewed:.2f} s after it; B claimed "
        f"the job {claimed_at - renewed:.2f} s after it; healed {healed_at - renewed:.2f} s "
        f"after it; A raised LeaseLost {logged_at(stopped) - renewed:.2f} s after it "
        f"({logged_at(stopped) - healed_at:.2f} s after the heal); late start rows: {len(late)}"
    )
