"""Webhook-triggered sync of an account's events that survives ``kill -9`` of its worker.

Run the demo: ``python -m examples.webhook_sync.demo`` (see README.md in this folder).
"""
