"""The metrics recipe of the docs' operating page on a real prefork worker: the pool processes'
counters, summed by prometheus_client's multiprocess mode and served from the worker's main
process with the table's gauges, labelled by task."""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import migrate_table, store_of
from tests.support.scenario import wait_for
from tests.support.service import celery_client, celery_env
from tests.support.worker import Spawner

pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.e2e

TASK = "progress.count"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """The samples served on ``port``, by name with labels, as the exposition format has them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        found = re.fullmatch(r"(\S+(?:\{[^}]*\})?) (\S+)", line)
        if found and not line.startswith("#"):
            samples[found[1]] = float(found[2])
    return samples


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_prefork_workers_metrics_count_every_pool_processs_claims_by_task_and_the_jobs(
    spawn: Spawner, celery_settings: dict[str, Any], tmp_path: Path
) -> None:
    # Given a prefork worker of two processes with the docs' metrics setup
    url = f"sqlite:///{tmp_path}/leases.sqlite3"
    settings = {**celery_settings, "leases_database_url": url}
    migrate_table(url, "celery_leases_jobs")
    port = free_port()
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = celery_env(settings) | {
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "TEST_METRICS_PORT": str(port),
    }
    spawn.worker("tests.support.apps.metrics_app", env=env, concurrency=2)

    # When six jobs of 3 checkpoints run on it
    store = store_of(settings)
    try:
        with celery_client(settings) as client:
            ids = [client.send_task(TASK, args=(3,)).id for _ in range(6)]

        def all_done() -> bool:
            jobs = [store.get(job_id) for job_id in ids]
            return all(job is not None and job.state == "done" for job in jobs)

        wait_for(all_done, timeout=60, what="six jobs done")
    finally:
        store.engine.dispose()

    # Then the served metrics count every claim and checkpoint of both processes, labelled
    # by the task, and the table's gauges say six jobs are done
    samples = scrape(port)
    label = f'{{task="{TASK}"}}'
    assert samples.get(f"celery_leases_claims_total{label}") == 6, samples
    assert samples.get(f"celery_leases_checkpoint_seconds_count{label}") == 18, samples
    assert samples.get(f"celery_leases_resumes_total{label}", 0) == 0, samples
    assert samples.get('celery_leases_jobs{state="done"}') == 6, samples
    assert samples.get("celery_leases_database_up") == 1, samples
