"""A celery-leases app that serves its metrics as the README says (prefork, prometheus_client's
multiprocess mode, the worker's main process serving them), for the metrics test.

Settings come from ``TEST_CELERY_CONFIG`` (``tests.support.service.celery_env``); the port to
serve on from ``TEST_METRICS_PORT``. ``PROMETHEUS_MULTIPROC_DIR`` is set by the test before the
worker starts.

- ``metrics.count(total)``: ``total`` checkpoints; returns ``total``.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import worker_ready
from prometheus_client import CollectorRegistry, multiprocess, start_http_server

from celery_leases import JobsCollector, LeasedTask
from tests.support.service import config_from_env

app = Celery("metrics_app")
app.conf.update(config_from_env())


@app.task(base=LeasedTask, bind=True, name="metrics.count")
def count(self: LeasedTask, total: int) -> int:
    done = (self.lease.checkpoint or {}).get("done", 0)
    while done < total:
        done += 1
        self.checkpoint({"done": done}, progress=(done, total))
    return total


@worker_ready.connect
def serve_metrics(sender: Any, **_: Any) -> None:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(JobsCollector(sender.app))
    start_http_server(int(os.environ["TEST_METRICS_PORT"]), addr="127.0.0.1", registry=registry)
