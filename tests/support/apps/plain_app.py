"""A plain Celery app (no celery-leases) for testing the test infrastructure itself.

The broker comes from ``TEST_BROKER_URL``, other settings from ``TEST_CELERY_CONFIG``
(see ``tests.support.service.celery_env``).
"""

from __future__ import annotations

import time

from celery import Celery

from tests.support.service import config_from_env

app = Celery("plain_app")
app.conf.update(config_from_env())


@app.task(name="plain.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="plain.sleep")
def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
