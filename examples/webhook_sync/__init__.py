"""Webhook-triggered sync of an account's events that survives ``kill -9`` of its worker.

The code to copy: ``app.py`` (the Celery app and the sync task), ``client.py``, ``sink.py``,
``receiver.py`` (the webhook receiver), ``signature.py`` and ``deliveries.py``. The demo's rig
is the ``demo`` package: ``python -m examples.webhook_sync.demo`` (see README.md in this folder).
"""
