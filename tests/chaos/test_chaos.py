"""The short chaos form (issue 7): 40 jobs x 10 units on 3 prefork workers, ~18 faults, among
them cancels (and revokes on Redis), and 4 jobs sent with an ``expires`` that passes for some
of them; and keyed jobs (issue 17): 16 triggers of 2 accounts in bursts, sent while the faults
happen, coalesced into one run per account at a time. And the edges of issue 23 that cost no
time: 4 jobs sent with a short soft time limit (on PostgreSQL their statements are slowed so it
lands inside them), clients killed between recording and publishing a job (``kill_client``),
keyed jobs revoked or cancelled while they wait and triggers sent with ``expires``, on
PostgreSQL the transactional checkpoints of half the jobs at repeatable read, and on SQLite a
second reaper in a PID namespace of its own when ``unshare`` works here.

Each test runs the chaos driver (``chaos/driver.py``) against real services, with a result backend
(a Redis database of its own; an SQLite file with the embedded broker), and fails when an
invariant does not hold. The seed is printed (``pytest -s``) and is in the failure message;
replay one with ``CHAOS_SEED=<seed> pytest tests/chaos -m chaos -k <test>``, or run the long
form with ``python -m chaos.driver --help``. The PostgreSQL + Redis test restarts
both local servers mid-run (set ``CHAOS_SERVICE_RESTARTS=0`` to leave them alone on a shared
machine); the result backend's database is kept across the Redis restart.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from chaos import fault as faults
from chaos.driver import Chaos, Config, Report, new_seed
from tests.support.service import in_ci, private_redis_url, sqlite_result_backend
from tests.support.worker import Spawner

pytestmark = [pytest.mark.chaos, pytest.mark.e2e, pytest.mark.timeout(600)]

SHORT = Config(
    jobs=40,
    units=10,
    unit_seconds=0.6,
    workers=3,
    concurrency=2,
    faults=18,
    expiring=0.1,
    keys=2,
    triggers=16,
    key_units=5,
    soft_limits=0.1,
    key_expiring=0.1,
)
#: The fault kinds of the PostgreSQL short form, before the service restarts this machine
#: allows: every worker fault, the freeze inside a transaction, the controls (keyed ones
#: too), and the dying clients.
POSTGRES_KINDS = (
    faults.WORKER_KINDS
    + faults.TRANSACTION_KINDS
    + faults.CONTROL_KINDS
    + faults.KEYED_CONTROL_KINDS
    + faults.CLIENT_KINDS
)
#: The SQLite form's: no freeze inside a transaction (it would hold the whole file), no revokes
#: (see its test).
SQLITE_KINDS = (*faults.WORKER_KINDS, "cancel", "cancel_keyed", *faults.CLIENT_KINDS)
#: The PostgreSQL form's isolation level of the transactional checkpoints.
POSTGRES_ISOLATION = "mixed"


def short_config(kinds: tuple[str, ...], **changes: Any) -> Config:
    seed = int(os.environ["CHAOS_SEED"]) if os.environ.get("CHAOS_SEED") else new_seed()
    return replace(SHORT, seed=seed, kinds=kinds, **changes)


def namespace_reaper() -> bool:
    """Whether this machine lets the SQLite form run its second reaper in a PID namespace of
    its own (``unshare``); if not, it says why and runs without it."""
    error = faults.unshare_error()
    if error is not None:
        print(f"chaos: no reaper in another PID namespace here: unshare: {error}")
    return error is None


def service_restarts(database_url: str, broker_url: str) -> tuple[str, ...]:
    """The service restarts this machine allows: the local PostgreSQL and Redis, unless
    ``CHAOS_SERVICE_RESTARTS=0`` (they disturb every other user of those servers)."""
    if os.environ.get("CHAOS_SERVICE_RESTARTS", "1") == "0":
        return ()
    kinds = []
    if faults.can_restart_postgres(database_url):
        kinds.append("restart_database")
    if faults.can_restart_redis(broker_url):
        kinds.append("restart_broker")
    missing = {"restart_database", "restart_broker"} - set(kinds)
    if missing and in_ci():
        pytest.fail(f"chaos in CI needs {sorted(missing)} on this machine", pytrace=False)
    return tuple(kinds)


def assert_chaos_survived(report: Report, config: Config) -> None:
    replay = f"replay: CHAOS_SEED={report.seed}"
    assert report.ok, f"{replay}\n{report.text}"
    done = sum(report.faults.values())
    assert done >= 0.8 * config.faults, f"only {done} faults done; {replay}\n{report.text}"
    sent = report.figures.get("triggers", 0)
    assert sent >= config.triggers, f"only {sent} triggers sent; {replay}\n{report.text}"


# exclusive: it restarts the shared PostgreSQL and Redis, which would break the tests running
# beside it; `make test` runs it alone, after the parallel run (scripts/test.sh).
@pytest.mark.exclusive
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_on_postgresql_and_redis_kills_freezes_and_restarts_lose_nothing_and_run_nothing_twice(
    spawn: Spawner, database_url: str, table_name: str, celery_settings: dict[str, Any]
) -> None:
    # Given 3 workers, beat running the reaper, 40 jobs (half exactly-once, half at-least-once,
    # 4 of them sent with expires), a Redis result backend
    # and 16 triggers of 2 accounts sent in bursts during the run (keyed jobs)
    restarts = service_restarts(database_url, celery_settings["broker_url"])
    config = short_config(POSTGRES_KINDS + restarts, isolation=POSTGRES_ISOLATION)

    # When pool processes and workers are SIGKILLed, frozen past their lease (some inside the
    # transaction of a checkpoint, the job's row locked), SIGTERMed, PostgreSQL and Redis
    # (losing its queue) restart, jobs are revoked and cancelled while the jobs run (keyed ones
    # while they wait), soft time limits land inside statements, clients die between recording
    # a job and publishing it, and half the checkpoints commit at repeatable read
    with private_redis_url() as backend:
        chaos = Chaos(config, spawn, celery_settings, database_url, table_name, backend)
        report = chaos.run()

    # Then every job is done or ended as its control decided, for good, the result backend and
    # the callbacks agree, no unit twice in exactly-once mode, at most one redone per
    # interruption in at-least-once mode, no overlap between attempts, no checkpoint backwards;
    # never two runs of one key at once, every trigger followed by a run that started after it,
    # none lost, and each key's cursor counts exactly the units its jobs committed
    assert_chaos_survived(report, config)
    assert all(report.faults[kind] >= 1 for kind in restarts), report.text


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_on_sqlite_and_the_embedded_broker_kills_and_freezes_lose_nothing_and_run_nothing_twice(
    spawn: Spawner,
    database_url: str,
    table_name: str,
    filesystem_broker: dict[str, Any],
    queue_name: str,
    tmp_path: Path,
) -> None:
    # Given the filesystem:// broker (no redelivery at all) and an SQLite store
    broker = {
        **filesystem_broker,
        "broker_transport_options": {
            **filesystem_broker["broker_transport_options"],
            "polling_interval": 0.1,
        },
        "task_default_queue": queue_name,
    }
    backend = sqlite_result_backend(tmp_path / "results.sqlite3")
    # No revoke: the filesystem transport's broadcast rarely reaches a worker started mid-run
    # (every revoke would only flag the id); cancels go through the table. A second reaper in
    # a PID namespace of its own, as a second container of one pod sharing the volume runs it.
    config = short_config(SQLITE_KINDS, namespace_reaper=namespace_reaper())

    # When pool processes and workers are SIGKILLed, frozen past their lease and SIGTERMed,
    # jobs are cancelled or expire, bursts of triggers of keyed jobs arrive (some cancelled
    # while they wait), soft time limits pass and clients die between record and publish
    report = Chaos(config, spawn, broker, database_url, table_name, backend).run()

    # Then the invariants hold: the reaper recovered every message the kills destroyed (and
    # the jobs the dying clients never published), every control held, the keyed jobs ran one
    # at a time per key, each trigger served, and no attempt ran beside another (the reaper
    # in the other namespace took no live holder for dead)
    assert_chaos_survived(report, config)
