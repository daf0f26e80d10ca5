"""``progress_app`` serving its metrics as the docs say (operating.md) (prefork, prometheus_client's
multiprocess mode, the worker's main process serving them), for the metrics test.

The port to serve on comes from ``TEST_METRICS_PORT``; ``PROMETHEUS_MULTIPROC_DIR`` is set by
the test before the worker starts.
"""

from __future__ import annotations

import os
from typing import Any

from celery.signals import worker_ready
from prometheus_client import CollectorRegistry, multiprocess, start_http_server

from celery_leases import JobsCollector
from tests.support.apps.progress_app import app

__all__ = ["app"]


@worker_ready.connect
def serve_metrics(sender: Any, **_: Any) -> None:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(JobsCollector(sender.app))
    start_http_server(int(os.environ["TEST_METRICS_PORT"]), addr="127.0.0.1", registry=registry)
