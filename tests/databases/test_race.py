"""Many processes claiming one job at the same instant: exactly one wins, every time."""

from __future__ import annotations

import multiprocessing
import queue as queue_module
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases.db.rows import Claimed
from celery_leases.db.store import Store
from celery_leases.settings import DEFAULTS, validate
from tests.support.message import job_message

PROCESSES = 16
ROUNDS = 20
# Seconds a process waits for the others at the barrier before the round counts as broken.
BARRIER_TIMEOUT = 60


def settings_of(database_url: str, table: str) -> Any:
    return validate(DEFAULTS | {"database_url": database_url, "table": table})


def claimant(
    database_url: str,
    table: str,
    job_ids: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """One process: in every round, wait for all the others, then claim that round's job."""
    store = Store(settings_of(database_url, table))
    try:
        store.now()  # connect and check the schema before the race, not during it
        for round_, job_id in enumerate(job_ids):
            barrier.wait(BARRIER_TIMEOUT)
            try:
                outcome = store.claim(
                    job_message(job_id, "tests.race", recorded=False),
                    owner=f"racer/{multiprocessing.current_process().pid}",
                    duration=30.0,
                )
            except Exception as exc:
                results.put((round_, "error", repr(exc)))
            else:
                won = isinstance(outcome, Claimed)
                results.put((round_, "won" if won else "refused", getattr(outcome, "token", None)))
    except Exception as exc:  # a broken barrier: tell the parent instead of hanging it
        results.put((-1, "error", repr(exc)))
    finally:
        store.engine.dispose()


def claimants_context() -> Any:
    """Processes forked from a fork server that imported this module once (SQLAlchemy, the
    drivers, celery-leases): a fresh interpreter per claimant ("spawn") cost ~1 s of CPU each,
    16 per test, and no claimant inherits a connection or a thread of the test process."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


class Race:
    """16 processes that claim one job per round, released together by a barrier."""

    def __init__(self, store: Store, database_url: str, job_ids: list[str]) -> None:
        context = claimants_context()
        self.barrier = context.Barrier(PROCESSES + 1)
        self.results = context.Queue()
        self.processes = [
            context.Process(
                target=claimant,
                args=(database_url, store.table.name, job_ids, self.barrier, self.results),
                daemon=True,
            )
            for _ in range(PROCESSES)
        ]
        for process in self.processes:
            process.start()

    def run_round(self) -> list[tuple[int, str, Any]]:
        self.barrier.wait(BARRIER_TIMEOUT)
        outcomes = []
        for _ in range(PROCESSES):
            try:
                outcomes.append(self.results.get(timeout=BARRIER_TIMEOUT))
            except queue_module.Empty:
                pytest.fail(f"only {len(outcomes)} of {PROCESSES} processes answered: {outcomes}")
        return outcomes

    def stop(self) -> None:
        self.barrier.abort()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self.results.close()


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(settings_of(database_url, table_name))
    yield store
    store.engine.dispose()


def expire(store: Store, job_id: str) -> None:
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(t).where(t.c.id == job_id).values(expires_at=t.c.expires_at - 100)
        )


def test_sixteen_processes_claiming_an_expired_job_at_once_have_exactly_one_winner(
    store: Store, database_url: str
) -> None:
    # Given a job whose holder's lease expired
    sent = job_message("contested", "tests.race", recorded=False)
    store.register(sent)
    first = store.claim(sent, owner="crashed/1", duration=30.0)
    assert isinstance(first, Claimed)
    race = Race(store, database_url, ["contested"] * ROUNDS)
    tokens = [0]
    try:
        for round_ in range(ROUNDS):
            expire(store, "contested")

            # When 16 processes claim it at the same instant
            outcomes = race.run_round()

            # Then exactly one wins, with the next token, and the others see it held
            assert [o for o in outcomes if o[1] == "error"] == []
            assert {o[0] for o in outcomes} == {round_}
            winners = [o for o in outcomes if o[1] == "won"]
            assert len(winners) == 1, f"round {round_}: {outcomes}"
            assert winners[0][2] > tokens[-1]
            tokens.append(winners[0][2])
    finally:
        race.stop()
    job = store.get("contested")
    assert job is not None and (job.token, job.attempts) == (tokens[-1], ROUNDS + 1)


def test_sixteen_processes_claiming_a_job_with_no_row_at_once_have_exactly_one_winner(
    store: Store, database_url: str
) -> None:
    # Messages sent by name from elsewhere: the claim creates the row, and only one may.
    job_ids = [f"unrecorded-{n}" for n in range(ROUNDS)]
    race = Race(store, database_url, job_ids)
    winner_tokens: list[int] = []
    try:
        for round_ in range(ROUNDS):
            outcomes = race.run_round()

            assert [o for o in outcomes if o[1] == "error"] == []
            winners = [o for o in outcomes if o[1] == "won"]
            assert len(winners) == 1, f"round {round_}: {outcomes}"
            winner_tokens.append(winners[0][2])
    finally:
        race.stop()
    assert sorted(job.token for job in store.list_jobs(limit=100)) == sorted(winner_tokens)
    assert len(store.list_jobs(limit=100)) == ROUNDS
