"""Benchmarks of celery-leases, each next to plain Celery or a raw-driver baseline, in one run.

``python -m bench.<name> [--quick]`` prints its rows as a table and writes them to
``bench/results/<name>.json``; ``python -m bench.run_all`` runs them all. Nothing asserts on
time. See docs/benchmarks.md.
"""
