"""Tests that start real processes: ``celery worker`` and ``celery beat`` (marker ``e2e``), the
demo and the webhook receiver, and, unmarked, the ``celery leases`` command, a fresh pytest
(pytester) or interpreter, and a process whose death the main process sees."""
