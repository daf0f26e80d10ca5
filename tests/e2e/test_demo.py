"""The webhook-sync example: its demo end to end (real workers, beat, a kill -9).

The demo runs as a subprocess, in a shorter size, and must pass its own verdict: on the
embedded default (SQLite + the atomicfs broker, no servers) and on Redis + PostgreSQL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.service import drop_tables, private_redis_url, require

REPO_ROOT = Path(__file__).resolve().parents[2]
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
        drop_tables(database, name)

    assert_verdict_holds(done, data)
    assert "postgresql+psycopg://" in done.stdout
