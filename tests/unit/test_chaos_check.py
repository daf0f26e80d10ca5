"""The chaos invariants catch what they claim to catch (synthetic logs, no services)."""

from __future__ import annotations

import json

from tests.support.chaos.check import (
    AT_LEAST_ONCE,
    EXACTLY_ONCE,
    CheckpointRow,
    Evidence,
    JobRow,
    check_all,
)
from tests.support.unit_log import Unit

UNITS = 4
BACKWARDS = "no checkpoint ever moved backwards"


def unit(job: str, n: int, token: int, start: float, end: float | None) -> Unit:
    return Unit(job, n, f"run-{job}-{token}", token, token, 100 + token, "w@h", start, end)


def run_of(job: str, token: int, units: range, start: float) -> list[Unit]:
    """Units committed back to back, one second each, from ``start``."""
    return [unit(job, n, token, start + i, start + i + 1) for i, n in enumerate(units)]


def checkpoints_of(job: str, *saved: tuple[int, int]) -> list[CheckpointRow]:
    return [CheckpointRow(job, token, json.dumps({"next": n})) for token, n in saved]


def done(job: str, attempts: int) -> JobRow:
    return JobRow(job, "done", attempts, attempts, UNITS, {"next": UNITS}, None)


def evidence(
    mode: str,
    rows: list[Unit],
    checkpoints: list[CheckpointRow] | None = None,
    *,
    attempts: int = 2,
    jobs: dict[str, JobRow] | None = None,
    table_rows: int = 1,
) -> Evidence:
    if checkpoints is None:
        tokens = {r.unit + 1: r.token or 0 for r in rows if r.committed}
        checkpoints = checkpoints_of("j", *((tokens[n], n) for n in sorted(tokens)))
    return Evidence(
        units=UNITS,
        modes={"j": mode},
        jobs={"j": done("j", attempts)} if jobs is None else jobs,
        table_rows=table_rows,
        unit_rows=rows,
        checkpoints=checkpoints,
    )


def failed_checks(e: Evidence) -> list[str]:
    return [check.name.split(":")[0] for check in check_all(e) if not check.ok]


def test_an_exactly_once_job_resumed_at_its_checkpoint_keeps_every_invariant() -> None:
    # Given a first attempt that committed units 0-1 and died in unit 2, and a second that
    # redid unit 2 and finished
    rows = [*run_of("j", 1, range(2), 0), unit("j", 2, 1, 2, None), *run_of("j", 2, range(2, 4), 9)]

    assert failed_checks(evidence(EXACTLY_ONCE, rows)) == []


def test_an_exactly_once_unit_committed_by_two_attempts_is_caught() -> None:
    rows = [*run_of("j", 1, range(3), 0), *run_of("j", 2, range(2, 4), 9)]

    failed = failed_checks(evidence(EXACTLY_ONCE, rows))

    assert failed == ["exactly-once"]


def test_a_superseded_exactly_once_attempt_that_commits_late_breaks_fencing() -> None:
    # Given attempt 1 committing unit 2 after attempt 2 started (at 9)
    rows = [*run_of("j", 1, range(2), 0), unit("j", 2, 1, 2, 10), *run_of("j", 2, range(3, 4), 9)]

    assert "fencing" in failed_checks(evidence(EXACTLY_ONCE, rows))


def test_at_least_once_allows_one_redone_unit_per_interruption_and_not_two() -> None:
    one = [*run_of("j", 1, range(3), 0), *run_of("j", 2, range(2, 4), 9)]
    two = [*run_of("j", 1, range(3), 0), *run_of("j", 2, range(1, 4), 9)]
    checkpoints = checkpoints_of("j", (1, 1), (1, 2), (2, 3), (2, 4))

    assert failed_checks(evidence(AT_LEAST_ONCE, one, checkpoints)) == []
    assert failed_checks(evidence(AT_LEAST_ONCE, two, checkpoints)) == ["at-least-once"]


def test_a_stale_at_least_once_attempt_may_finish_its_unit_in_flight_but_nothing_more() -> None:
    # Given attempt 1 frozen in unit 2, attempt 2 resuming at unit 2 (at 9), and attempt 1
    # waking to commit its unit in flight (at 10): allowed, its write is not fenced
    in_flight = [
        *run_of("j", 1, range(2), 0),
        unit("j", 2, 1, 2, 10),
        *run_of("j", 2, range(2, 4), 9),
    ]
    checkpoints = checkpoints_of("j", (1, 1), (1, 2), (2, 3), (2, 4))
    assert failed_checks(evidence(AT_LEAST_ONCE, in_flight, checkpoints)) == []

    # When it also ran and committed one more unit
    beyond = [*in_flight, unit("j", 3, 1, 10, 11)]

    # Then fencing fails
    assert "fencing" in failed_checks(evidence(AT_LEAST_ONCE, beyond, checkpoints))


def test_a_checkpoint_that_moves_backwards_or_a_stale_token_saving_late_is_caught() -> None:
    rows = [*run_of("j", 1, range(2), 0), *run_of("j", 2, range(2, 4), 9)]
    backwards = checkpoints_of("j", (1, 1), (1, 2), (2, 3), (2, 1), (2, 4))
    stale = checkpoints_of("j", (1, 1), (2, 2), (1, 3), (2, 4))

    assert failed_checks(evidence(EXACTLY_ONCE, rows, backwards)) == [BACKWARDS]
    assert failed_checks(evidence(EXACTLY_ONCE, rows, stale)) == [BACKWARDS]


def test_a_stuck_job_a_lost_job_and_an_extra_row_are_caught() -> None:
    rows = run_of("j", 1, range(2), 0)
    stuck = JobRow("j", "running", 1, 1, None, {"next": 2}, None)

    assert "every job done" in failed_checks(evidence(EXACTLY_ONCE, rows, jobs={"j": stuck}))
    assert "every job done" in failed_checks(evidence(EXACTLY_ONCE, [], jobs={}, table_rows=0))
    full = run_of("j", 1, range(4), 0)
    assert failed_checks(evidence(EXACTLY_ONCE, full, attempts=1, table_rows=2)) == [
        "jobs table rows match jobs submitted"
    ]
