"""The webhook-sync example: its demo end to end (real workers, beat, the receiver, a kill -9).

The demo runs as a subprocess, in a shorter size, and must pass its own verdict (six signed
webhooks: one sync and one follow-up; a retried delivery and a forged one start nothing; the
sync resumes after the kill; the follow-up syncs the new events only): on the embedded default
(SQLite + the atomicfs broker, no servers) and on Redis + PostgreSQL.
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
EVENTS, NEW_EVENTS = 1000, 300
TOTAL = EVENTS + NEW_EVENTS
#: Seconds the demo may take before the test gives up (it takes ~10 s).
DEMO_TIMEOUT = 150

RESUMED = r"^  ok    resumed on (w[12]) after the kill of (w[12]): claimed \d+\.\d\d s later"
VERDICT = [
    rf"^  ok    every event stored exactly once: {TOTAL:,} rows, {TOTAL:,} distinct ids, "
    rf"{TOTAL:,} upstream, 0 missing$",
    r"^  ok    6 webhooks, one sync and one follow-up: answered [0-9a-f]{8} x1, [0-9a-f]{8} x5;",
    r"^  ok    never two runs at once: the follow-up was claimed \d+\.\d\d s after the sync",
    r"^  ok    the follow-up started after the last webhook of the burst: \d+\.\d\d s after",
    r"^  ok    a provider's retry of dlv_[0-9a-f]+, once the account was idle: answered 200 ",
    r"^  ok    a delivery signed with another secret: answered 401 ",
    RESUMED,
    rf"^  ok    the follow-up synced only the new events: {NEW_EVENTS} in 3 page",
    r"^  ok    pages fetched again: [01]\b",
    r"^PASS: 6 webhooks, one sync and one follow-up; the sync survived kill -9 of its worker$",
]


def run_demo(
    data: Path, *options: str, name: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = None if name is None else {**os.environ, "WEBHOOK_SYNC_NAME": name}
    return subprocess.run(
        [
            *DEMO,
            "--data",
            str(data),
            "--events",
            str(EVENTS),
            "--new-events",
            str(NEW_EVENTS),
            *options,
        ],
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
    resumed = re.search(RESUMED, done.stdout, re.MULTILINE)
    assert resumed is not None and resumed[1] != resumed[2], report
    # The job ids the receiver answered, as printed: the sync once, then its follow-up five times
    answered = re.findall(r"dlv_[0-9a-f]+ -> 202, job ([0-9a-f-]{36})", done.stdout)
    assert len(answered) == 6 and len(set(answered[1:])) == 1, report
    assert answered[0] != answered[1], report


@pytest.mark.e2e
def test_the_demo_coalesces_its_webhooks_and_resumes_the_killed_sync_on_the_embedded_broker(
    tmp_path: Path,
) -> None:
    data = tmp_path / "demo"

    done = run_demo(data)

    assert_verdict_holds(done, data)
    assert "atomicfs://" in done.stdout
    assert re.search(r"SIGKILL w[12]: pid \d+ and its pool process", done.stdout)


@pytest.mark.e2e
def test_the_demo_coalesces_its_webhooks_and_resumes_the_killed_sync_on_redis_and_postgresql(
    tmp_path: Path,
) -> None:
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
