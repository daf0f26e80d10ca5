"""Benchmarks of celery-leases, each next to plain Celery or the raw SQL, measured in the same run.

Every script is plain Python, runs on its own as ``python -m bench.<name> [--quick]``, prints a
table and writes ``bench/results/<name>.json``; ``python -m bench.run_all [--quick]`` runs them
all in order. Nothing here asserts on time: the figures are read, not checked.
Shared helpers (services, statistics, tables, results) live in ``bench.common``.
"""
