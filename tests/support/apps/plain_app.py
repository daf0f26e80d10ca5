"""A plain Celery app (no celery-leases) for testing the test infrastructure itself.

The broker comes from ``TEST_BROKER_URL``, other settings from ``TEST_CELERY_CONFIG``
(see ``tests.support.service.celery_env``).
"""

from __future__ import annotations

import time

from tests.support.apps.factory import make_app

app = make_app("plain_app", variables="celery_env", current=True)


@app.task(name="plain.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="plain.sleep")
def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
