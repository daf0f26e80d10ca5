"""The webhook-sync example: its demo end to end, and the exactly-once storage of a page.

The demo runs as a subprocess, in a shorter size, and must pass its own verdict: on the
embedded default (SQLite + the atomicfs broker, no servers) and on Redis + PostgreSQL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, _state

from celery_leases import LeasedTask, LeaseLost
from celery_leases.lease import Lease, current
from celery_leases.rows import Claimed
from tests.support.service import private_redis_url, require

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO = [sys.executable, "-m", "examples.webhook_sync.demo"]
EVENTS = 1000
#: Seconds the demo may take before the test gives up (it takes ~10 s).
DEMO_TIMEOUT = 150

VERDICT = [
    rf"^  ok    every event stored exactly once: {EVENTS:,} rows, {EVENTS:,} distinct ids, "
    rf"{EVENTS:,} upstream, 0 missing$",
    r"^  ok    pages fetched again after the kill: [01]\b",
    r"^  ok    resumed on (w[12]) after the kill of (w[12]): claimed \d+\.\d\d s later",
    r"^  ok    job done: \d+ attempts, ",
    r"^PASS: the sync survived kill -9 of the worker holding its lease$",
]


def run_demo(
    data: Path, *options: str, name: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = None if name is None else {**os.environ, "WEBHOOK_SYNC_NAME": name}
    return subprocess.run(
        [*DEMO, "--data", str(data), "--events", str(EVENTS), *options],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
    )


def assert_verdict_holds(done: subprocess.CompletedProcess[str], data: Path) -> None:
    logs = "".join(
        f"\n--- end of {log.name}:\n" + "\n".join(log.read_text().splitlines()[-25:])
        for log in sorted((data / "logs").glob("*.log"))
    )
    report = f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}{logs}"
    assert done.returncode == 0, report
    assert "FAIL" not in done.stdout, report
    for pattern in VERDICT:
        assert re.search(pattern, done.stdout, re.MULTILINE), f"no line {pattern!r}\n{report}"
    resumed = re.search(VERDICT[2], done.stdout, re.MULTILINE)
    assert resumed is not None and resumed[1] != resumed[2], report


@pytest.mark.e2e
def test_the_demo_resumes_the_killed_sync_on_the_embedded_broker(tmp_path: Path) -> None:
    data = tmp_path / "demo"

    done = run_demo(data)

    assert_verdict_holds(done, data)
    assert "atomicfs://" in done.stdout
    assert re.search(r"SIGKILL w[12]: pid \d+ and its pool process", done.stdout)


@pytest.mark.e2e
def test_the_demo_resumes_the_killed_sync_on_redis_and_postgresql(tmp_path: Path) -> None:
    database = require("postgres")
    name = f"leases_t_{uuid.uuid4().hex[:8]}"
    data = tmp_path / "demo"
    try:
        with private_redis_url() as broker:
            done = run_demo(data, "--broker", broker, "--database", database, name=name)
    finally:
        _drop_tables(database, f"{name}_leases", f"{name}_synced_events")

    assert_verdict_holds(done, data)
    assert "postgresql+psycopg://" in done.stdout


def _drop_tables(url: str, *names: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            for name in names:
                sa.Table(name, sa.MetaData()).drop(connection, checkfirst=True)
    finally:
        engine.dispose()


# -- exactly-once storage: a page and its checkpoint in one transaction ---------------------------


@pytest.fixture
def example() -> Iterator[ModuleType]:
    """The example's app module, imported without leaving its app as the current app."""
    previous = _state.get_current_app()
    import examples.webhook_sync.app as module

    previous.set_current()
    yield module


@contextmanager
def running(lease: Lease) -> Iterator[Lease]:
    """Run the block as the attempt holding ``lease`` (what LeasedTask does around run())."""
    current.stack.append(lease)
    try:
        yield lease
    finally:
        current.stack.remove(lease)


def attempt(job_id: str, claimed: Claimed | Any, owner: str) -> Lease:
    assert isinstance(claimed, Claimed)
    return Lease(job_id, claimed.token, claimed.attempt, claimed.checkpoint, owner, 30.0, 10.0)


def test_a_stale_attempt_can_neither_store_a_page_nor_move_the_cursor(
    example: ModuleType, database_url: str, table_name: str
) -> None:
    from examples.webhook_sync import sink
    from examples.webhook_sync.upstream import generate_events

    app = Celery("exactly_once", set_as_current=False)
    app.conf.update(leases_database_url=database_url, leases_table=table_name)

    @app.task(base=LeasedTask, bind=True, name="exactly_once.sync", shared=False)  # type: ignore[untyped-decorator]
    def sync(self: LeasedTask) -> None:
        """Only its leases settings and checkpoint() are used."""

    store = sync.lease_store
    engine = sa.create_engine(database_url)
    table = sink.events_table(f"{table_name}_events")
    page = generate_events("exactly-once", "acct_1", 50)
    after_page = {"cursor": page[-1]["id"], "page": 1, "done": 50}
    try:
        sink.create(engine, table)
        # Given a job whose first attempt's lease expired and was claimed again by a second one
        job_id = f"job-{uuid.uuid4().hex}"
        store.register(job_id, task=sync.name, args="[]", kwargs="{}", options="{}")
        claim = {"duration": 30.0, "task": sync.name, "args": "[]", "kwargs": "{}"}
        stale = attempt(job_id, store.claim(job_id, owner="w1/1", **claim), "w1/1")
        assert store.release(job_id)
        fresh = attempt(job_id, store.claim(job_id, owner="w2/2", **claim), "w2/2")
        assert fresh.token > stale.token

        # When the first (stale) attempt stores a page with its checkpoint
        with running(stale), pytest.raises(LeaseLost):
            example.store_page(sync, engine, table, "acct_1", page, after_page, progress=(50, 100))

        # Then the transaction rolled back: no event stored, the cursor did not move
        assert sink.count(engine, table, "acct_1") == 0
        job = store.get(job_id)
        assert job is not None
        assert (job.checkpoint, job.progress_done, job.owner) == (None, None, "w2/2")

        # And the attempt holding the lease stores the same page, and its checkpoint, once
        with running(fresh):
            example.store_page(sync, engine, table, "acct_1", page, after_page, progress=(50, 100))
        assert sorted(sink.stored_ids(engine, table, "acct_1")) == sorted(e["id"] for e in page)
        job = store.get(job_id)
        assert job is not None
        assert (job.checkpoint, job.progress_done, job.progress_total) == (after_page, 50, 100)
    finally:
        engine.dispose()
        store.engine.dispose()
