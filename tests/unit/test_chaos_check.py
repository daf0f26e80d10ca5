"""The chaos invariants catch what they claim to catch (synthetic logs, no services).

Times are seconds on one made-up database clock: a unit takes one second, a job that ends does
so at ``END`` unless a test says otherwise.
"""

from __future__ import annotations

import json
from dataclasses import replace

from tests.support.chaos.check import (
    AT_LEAST_ONCE,
    EXACTLY_ONCE,
    Callback,
    CheckpointRow,
    Control,
    Evidence,
    JobRow,
    Kill,
    Outcome,
    StateRow,
    check_all,
)
from tests.support.unit_log import Unit

UNITS = 4
END = 100.0
BACKWARDS = "no checkpoint ever moved backwards"
EVERY_JOB = "every job done, or ended as its control decided"
ENDS = "ends are final"
CONTROLS = "controls"
BACKEND = "result backend agrees with the table"
CALLBACKS = "callbacks agree with the table"
AFTER_END = "nothing ran after an end"
REVOKED_TEXT = "TaskRevokedError: terminated"


def unit(job: str, n: int, token: int, start: float, end: float | None) -> Unit:
    return Unit(job, n, f"run-{job}-{token}", token, token, 100 + token, "w@h", start, end)


def run_of(job: str, token: int, units: range, start: float) -> list[Unit]:
    """Units committed back to back, one second each, from ``start``."""
    return [unit(job, n, token, start + i, start + i + 1) for i, n in enumerate(units)]


def checkpoints_of(job: str, *saved: tuple[int, int]) -> list[CheckpointRow]:
    return [CheckpointRow(job, token, json.dumps({"next": n})) for token, n in saved]


def done(job: str, attempts: int) -> JobRow:
    return JobRow(job, "done", attempts, attempts, UNITS, {"next": UNITS}, None, END)


def ended(job: str, state: str, token: int, at: float, next_unit: int) -> JobRow:
    """A job that stopped ``state`` at ``at`` with checkpoint ``next_unit``."""
    return JobRow(job, state, token, token, None, {"next": next_unit}, state, at)


def consistent(e: Evidence) -> Evidence:
    """``e`` with the state log, the result backend and the callback log its jobs and unit
    rows imply when nothing went wrong: a claim per token before its first unit, then the end;
    SUCCESS / REVOKED with a ``link`` call per done job and its callback job done."""
    history: list[StateRow] = []
    backend: dict[str, Outcome] = {}
    callbacks: list[Callback] = []
    jobs = dict(e.jobs)
    for job_id, job in e.jobs.items():
        history.append(StateRow(job_id, 0, "queued", -1.0))
        starts: dict[int, float] = {}
        for row in e.unit_rows:
            if row.job_id == job_id and row.token is not None:
                starts[row.token] = min(starts.get(row.token, row.started_at), row.started_at)
        for token in range(1, job.token + 1):
            history.append(StateRow(job_id, token, "running", starts.get(token, 0.0) - 0.01))
        if job.finished_at is not None:
            history.append(StateRow(job_id, job.token, job.state, job.finished_at))
        if job.state == "done":
            backend[job_id] = Outcome("SUCCESS", job.result)
            callbacks.append(Callback(job_id, "link", json.dumps(job.result)))
            jobs[f"cb-{job_id}"] = JobRow(f"cb-{job_id}", "done", 1, 1, job_id, None, None, END)
        elif job.state in ("revoked", "cancelled"):
            backend[job_id] = Outcome("REVOKED", REVOKED_TEXT)
    return replace(
        e,
        jobs=jobs,
        history=history,
        backend=backend,
        callbacks=callbacks,
        callback_jobs=[i for i in jobs if i.startswith("cb-")],
    )


def evidence(
    mode: str,
    rows: list[Unit],
    checkpoints: list[CheckpointRow] | None = None,
    *,
    attempts: int = 2,
    jobs: dict[str, JobRow] | None = None,
    table_rows: int = 1,
    controls: list[Control] | None = None,
    expires: dict[str, float] | None = None,
) -> Evidence:
    """The evidence of one job ``j`` in ``mode``, consistent everywhere (see
    :func:`consistent`); checkpoints default to one per committed unit."""
    if checkpoints is None:
        saved = {r.unit + 1: (r.token or 0, r.ended_at or 0.0) for r in rows if r.committed}
        checkpoints = [
            CheckpointRow("j", token, json.dumps({"next": n}), at)
            for n, (token, at) in sorted(saved.items())
        ]
    return consistent(
        Evidence(
            units=UNITS,
            modes={"j": mode},
            jobs={"j": done("j", attempts)} if jobs is None else jobs,
            table_rows=table_rows,
            unit_rows=rows,
            checkpoints=checkpoints,
            controls=controls or [],
            expires=expires or {},
        )
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

    assert EVERY_JOB in failed_checks(evidence(EXACTLY_ONCE, rows, jobs={"j": stuck}))
    assert EVERY_JOB in failed_checks(evidence(EXACTLY_ONCE, [], jobs={}, table_rows=0))
    full = run_of("j", 1, range(4), 0)
    assert failed_checks(evidence(EXACTLY_ONCE, full, attempts=1, table_rows=2)) == [
        "jobs table rows match jobs submitted"
    ]


# -- revokes, cancels and expiry -----------------------------------------------------------------


def test_jobs_revoked_cancelled_or_expired_that_ended_so_keep_every_invariant() -> None:
    # Given units 0-1 committed, unit 2 in flight when the job ended at 2.5
    rows = [*run_of("j", 1, range(2), 0), unit("j", 2, 1, 2, None)]
    for state, control in [
        ("revoked", Control("j", "revoke", 2.4, "w1@h")),
        ("cancelled", Control("j", "cancel", 1.5, "running")),
        ("cancelled", Control("j", "cancel", 1.5, "queued")),
    ]:
        stopped = {"j": ended("j", state, 1, 2.5, 2)}

        # Then every invariant holds (nothing is required of the units it never ran)
        e = evidence(EXACTLY_ONCE, rows, jobs=stopped, controls=[control])
        assert failed_checks(e) == [], (state, control)

    # And an expiring job may end revoked (after its expires) or done
    revoked = evidence(
        EXACTLY_ONCE, rows, jobs={"j": ended("j", "revoked", 1, 2.5, 2)}, expires={"j": 2.0}
    )
    assert failed_checks(revoked) == []
    full = run_of("j", 1, range(4), 0)
    assert failed_checks(evidence(EXACTLY_ONCE, full, attempts=1, expires={"j": 2.0})) == []


def test_a_revoke_that_terminated_a_job_which_then_ended_done_is_caught() -> None:
    # Given a revoke answered "terminate" by the worker running the job, at 2.5
    rows = [*run_of("j", 1, range(2), 0), unit("j", 2, 1, 2, None), *run_of("j", 2, range(2, 4), 9)]
    revoke = Control("j", "revoke", 2.5, "w1@h")

    # When the job was resumed and ended done anyway
    failed = failed_checks(evidence(EXACTLY_ONCE, rows, controls=[revoke]))

    # Then it did not end as the revoke decided
    assert failed == [EVERY_JOB, CONTROLS]


def test_a_revoke_that_found_the_job_between_attempts_may_end_done_or_revoked() -> None:
    # Given a revoke no worker was running the job for (a worker started later ran it)
    rows = [*run_of("j", 1, range(2), 0), *run_of("j", 2, range(2, 4), 9)]
    flagged = Control("j", "revoke", 5.0, None)

    assert failed_checks(evidence(EXACTLY_ONCE, rows, controls=[flagged])) == []
    revoked = {"j": ended("j", "revoked", 1, 5.0, 2)}
    stopped = run_of("j", 1, range(2), 0)
    assert failed_checks(evidence(EXACTLY_ONCE, stopped, jobs=revoked, controls=[flagged])) == []


def test_a_cancel_may_end_a_job_done_only_when_it_came_after_the_last_checkpoint() -> None:
    rows = run_of("j", 1, range(4), 0)  # the last checkpoint at 4

    after = Control("j", "cancel", 4.2, "running")
    before = Control("j", "cancel", 2.5, "running")

    assert failed_checks(evidence(EXACTLY_ONCE, rows, attempts=1, controls=[after])) == []
    assert failed_checks(evidence(EXACTLY_ONCE, rows, attempts=1, controls=[before])) == [
        EVERY_JOB,
        CONTROLS,
    ]

    # A cancel whose store call failed may or may not have reached the table
    uncertain = Control("j", "cancel", 2.5, "uncertain")
    assert failed_checks(evidence(EXACTLY_ONCE, rows, attempts=1, controls=[uncertain])) == []


def test_a_job_revoked_or_cancelled_with_no_control_is_caught() -> None:
    rows = run_of("j", 1, range(2), 0)
    for state in ("revoked", "cancelled"):
        stopped = {"j": ended("j", state, 1, 2.5, 2)}

        assert failed_checks(evidence(EXACTLY_ONCE, rows, jobs=stopped)) == [EVERY_JOB, CONTROLS]


def test_an_expired_job_revoked_before_its_expires_or_claimed_long_after_it_is_caught() -> None:
    rows = run_of("j", 1, range(2), 0)
    revoked = {"j": ended("j", "revoked", 1, 2.5, 2)}

    # A job revoked at 2.5 whose expires is at 10
    assert failed_checks(evidence(EXACTLY_ONCE, rows, jobs=revoked, expires={"j": 10.0})) == [
        CONTROLS
    ]

    # A job claimed again (token 2 at 8.99) 8 s after its expires passed (at 1), slack 2 s
    resumed = [*run_of("j", 1, range(2), 0), *run_of("j", 2, range(2, 4), 9)]
    assert failed_checks(evidence(EXACTLY_ONCE, resumed, expires={"j": 1.0})) == [CONTROLS]


def test_a_unit_committed_after_a_revoke_ended_the_job_is_caught_but_not_the_one_in_flight() -> (
    None
):
    # Given a job revoked at 2.5 while unit 2 (started at 2) was in flight
    revoke = [Control("j", "revoke", 2.5, "w1@h")]
    revoked = {"j": ended("j", "revoked", 1, 2.5, 2)}
    in_flight = [*run_of("j", 1, range(2), 0), unit("j", 2, 1, 2, 3)]

    # Then in at-least-once mode its unfenced write may commit after the end (at 3)
    assert failed_checks(evidence(AT_LEAST_ONCE, in_flight, jobs=revoked, controls=revoke)) == []

    # But not in exactly-once mode (the checkpoint in its transaction is fenced)
    assert failed_checks(evidence(EXACTLY_ONCE, in_flight, jobs=revoked, controls=revoke)) == [
        CONTROLS,
        AFTER_END,
    ]

    # And a unit started after the end (at 3) is caught in either mode
    beyond = [*in_flight, unit("j", 3, 1, 3, 4)]
    for mode in (AT_LEAST_ONCE, EXACTLY_ONCE):
        failed = failed_checks(evidence(mode, beyond, jobs=revoked, controls=revoke))
        assert AFTER_END in failed and CONTROLS in failed, mode


def test_a_unit_started_after_a_done_job_ended_is_caught() -> None:
    rows = [*run_of("j", 1, range(4), 0), unit("j", 3, 2, END + 1, None)]

    assert failed_checks(evidence(AT_LEAST_ONCE, rows, attempts=1)) == [AFTER_END]


def test_an_end_a_reaper_or_a_redelivery_undid_is_caught() -> None:
    # Given a job revoked at 2.5, then re-published and claimed again, and done
    rows = [*run_of("j", 1, range(2), 0), *run_of("j", 2, range(2, 4), 9)]
    e = evidence(EXACTLY_ONCE, rows, controls=[Control("j", "revoke", 2.4, "w1@h")])
    assert e.history is not None
    undone = [
        StateRow("j", 0, "queued", -1.0),
        StateRow("j", 1, "running", 0.0),
        StateRow("j", 1, "revoked", 2.5),
        StateRow("j", 1, "queued", 5.0),
        StateRow("j", 2, "running", 8.99),
        StateRow("j", 2, "done", END),
    ]
    e = replace(e, history=[r for r in e.history if r.job_id != "j"] + undone)

    assert ENDS in failed_checks(e)


def test_a_row_that_disagrees_with_its_state_log_is_caught() -> None:
    e = evidence(EXACTLY_ONCE, run_of("j", 1, range(4), 0), attempts=1)
    assert e.history is not None
    last = e.history[-1]
    e = replace(e, history=[*e.history, replace(last, state="failed")])

    assert ENDS in failed_checks(e)


# -- the result backend and the callbacks ----------------------------------------------------------


def test_a_result_backend_that_disagrees_with_the_table_is_caught() -> None:
    rows = run_of("j", 1, range(4), 0)
    e = evidence(EXACTLY_ONCE, rows, attempts=1)
    for wrong in [
        Outcome("FAILURE", "WorkerLostError: Worker exited prematurely"),
        Outcome("SUCCESS", UNITS - 1),
        Outcome("PENDING", None),
        Outcome("REVOKED", REVOKED_TEXT),
    ]:
        assert failed_checks(replace(e, backend={"j": wrong})) == [BACKEND], wrong

    # A revoked job the backend calls anything but REVOKED
    stopped = evidence(
        EXACTLY_ONCE,
        run_of("j", 1, range(2), 0),
        jobs={"j": ended("j", "revoked", 1, 2.5, 2)},
        controls=[Control("j", "revoke", 2.4, "w1@h")],
    )
    for wrong in [Outcome("SUCCESS", UNITS), Outcome("PENDING", None)]:
        failed = failed_checks(replace(stopped, backend={"j": wrong}))
        assert failed == [CONTROLS, BACKEND], wrong


def test_callbacks_missing_run_twice_or_run_for_a_stopped_job_are_caught() -> None:
    e = evidence(EXACTLY_ONCE, run_of("j", 1, range(4), 0), attempts=1)
    link = Callback("j", "link", json.dumps(UNITS))
    errback = Callback("j", "errback", "celery.exceptions.WorkerLostError: lost")
    for calls in [[], [link, link], [link, errback], [Callback("j", "link", "3")]]:
        assert failed_checks(replace(e, callbacks=calls)) == [CALLBACKS], calls

    # A callback job that never ran
    stuck = JobRow("cb-j", "queued", 0, 0, None, None, None)
    assert failed_checks(replace(e, jobs={**e.jobs, "cb-j": stuck})) == [CALLBACKS]

    # A revoked job whose link ran
    stopped = evidence(
        EXACTLY_ONCE,
        run_of("j", 1, range(2), 0),
        jobs={"j": ended("j", "revoked", 1, 2.5, 2)},
        controls=[Control("j", "revoke", 2.4, "w1@h")],
    )
    assert failed_checks(replace(stopped, callbacks=[link])) == [CALLBACKS]


def test_a_result_and_a_link_lost_to_a_kill_right_after_the_job_ended_done_are_told_apart() -> None:
    # Given a done job (its run in pool process 101, done at END) with nothing stored and no
    # callback sent
    e = evidence(EXACTLY_ONCE, run_of("j", 1, range(4), 0), attempts=1)
    lost = replace(e, backend={"j": Outcome("PENDING", None)}, callbacks=[])

    # When that process was SIGKILLed 0.2 s after it marked the job done: the window README
    # "Guarantees" leaves open, tolerated (and counted)
    assert failed_checks(replace(lost, kills=[Kill(END + 0.2, (101,))])) == []

    # But not when the kill came later, hit another process, or when the backend holds a wrong
    # state rather than nothing
    assert failed_checks(replace(lost, kills=[Kill(END + 5, (101,))])) == [BACKEND, CALLBACKS]
    assert failed_checks(replace(lost, kills=[Kill(END + 0.2, (102,))])) == [BACKEND, CALLBACKS]
    failure = replace(lost, backend={"j": Outcome("FAILURE", "WorkerLostError")})
    assert failed_checks(replace(failure, kills=[Kill(END + 0.2, (101,))])) == [BACKEND]
