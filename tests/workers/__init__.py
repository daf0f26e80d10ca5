"""Tests that start real processes. Marked ``e2e``: ``celery worker`` and ``celery beat``, the
webhook demo and its receiver. Unmarked (``scripts/matrix.sh`` runs these): the ``celery leases``
command, a fresh pytest (pytester) or interpreter, and a process whose death the library sees."""
