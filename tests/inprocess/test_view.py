"""How ``leases list`` and ``watch`` word the counts of the states."""

from __future__ import annotations

from celery_leases.cli.view import counts_text, jobs_count
from celery_leases.db.rows import StateCounts


def test_a_count_stopped_at_its_cap_is_shown_as_at_least_that_many() -> None:
    counts = StateCounts({"done": 10_000, "running": 3, "failed": 2}, frozenset({"done"}))

    assert counts_text(counts, 1) == ["3 running (1 stalled)", "10,000+ done", "2 failed"]
    assert jobs_count(counts.total, bool(counts.capped)) == "10,005+"


def test_exact_counts_are_shown_as_they_are_and_running_always() -> None:
    counts = StateCounts({"done": 12_345})

    assert counts_text(counts, 0) == ["0 running", "12,345 done"]
    assert jobs_count(counts.total, bool(counts.capped)) == "12,345"
