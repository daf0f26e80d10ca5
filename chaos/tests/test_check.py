"""The chaos invariants catch what they claim to catch (synthetic logs, no services).

Times are seconds on one made-up database clock: a unit takes one second, a job that ends does
so at ``END`` unless a test says otherwise.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from chaos.check import (
    AT_LEAST_ONCE,
    CLAIMED,
    EXACTLY_ONCE,
    RELEASED,
    RETRY_MARK,
    Admission,
    Callback,
    CheckpointRow,
    Control,
    CursorRow,
    Evidence,
    JobRow,
    Kill,
    Outcome,
    Pause,
    StateRow,
    Trigger,
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


def test_a_unit_the_attempt_a_revoke_was_terminating_started_just_after_the_end_is_allowed() -> (
    None
):
    # Given a job revoked (terminate=True) at 2.5, the end recorded as the signal was sent
    revoked = {"j": ended("j", "revoked", 1, 2.5, 2)}
    done_units = run_of("j", 1, range(2), 0)

    # Then its attempt may still start a unit before the signal ends it, never committed
    soon = [*done_units, unit("j", 2, 1, 2.52, None)]
    terminated = [Control("j", "revoke", 2.5, "w1@h")]
    assert failed_checks(evidence(AT_LEAST_ONCE, soon, jobs=revoked, controls=terminated)) == []

    # But not a second later, nor when no worker said it terminated the attempt
    late = [*done_units, unit("j", 2, 1, 4.0, None)]
    assert AFTER_END in failed_checks(
        evidence(AT_LEAST_ONCE, late, jobs=revoked, controls=terminated)
    )
    flagged = [Control("j", "revoke", 2.5, None)]
    assert AFTER_END in failed_checks(evidence(AT_LEAST_ONCE, soon, jobs=revoked, controls=flagged))


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


def test_a_freeze_between_the_done_and_the_kill_stretches_the_window_by_its_length() -> None:
    # Given a done job (pool process 101, done at END) with nothing stored and no callback
    # sent, its process SIGKILLed 3.5 s after it marked the job done
    e = evidence(EXACTLY_ONCE, run_of("j", 1, range(4), 0), attempts=1)
    lost = replace(
        e, backend={"j": Outcome("PENDING", None)}, callbacks=[], kills=[Kill(END + 3.5, (101,))]
    )

    # When another process was stopped from just after the done to after the kill (stopped
    # inside its write of the result backend's one SQLite file, it held every other store of
    # a result waiting): 0.2 s of the 3.5 ran, tolerated
    frozen = replace(lost, pauses=[Pause((202,), END + 0.2, END + 9.0)])
    assert failed_checks(frozen) == []

    # Then a freeze that covers too little of it, or came before the done, is no excuse
    for pause in [Pause((202,), END + 0.2, END + 1.0), Pause((202,), END - 9.0, END - 1.0)]:
        assert failed_checks(replace(lost, pauses=[pause])) == [BACKEND, CALLBACKS], pause
    assert failed_checks(lost) == [BACKEND, CALLBACKS]


# -- keyed jobs: one run per key, triggers, cursors ------------------------------------------------

KEY = "account:a"
KEY_UNITS = 3
KEYED = "keyed jobs"
ONE_RUN = "one run per key"
FOLLOWED = "every trigger followed by a run of its key that started after it and ended done"
LOST = "no trigger lost"
CURSORS = "cursors"


def keyed_evidence(
    runs: dict[str, list[Unit]],
    triggers: list[Trigger],
    *,
    inserted: dict[str, float],
    states: dict[str, str] | None = None,
    keys: dict[str, str] | None = None,
) -> Evidence:
    """The evidence of keyed jobs only (no other job), consistent where nothing else is said:
    each job inserted at ``inserted[job]``, claimed before each run's first unit, ended as
    ``states`` says (default done) half a second after its last unit; each committed unit wrote
    the cursor of its job's key (``keys``, default ``KEY``) once, in commit order."""
    states, keys = states or {}, keys or {}
    jobs: dict[str, JobRow] = {}
    history: list[StateRow] = []
    units = sorted((r for rows in runs.values() for r in rows), key=lambda r: r.ended_at or 0)
    for job_id, rows in runs.items():
        tokens = sorted({r.token or 0 for r in rows})
        last = max((r.ended_at or r.started_at for r in rows), default=inserted[job_id])
        state = states.get(job_id, "done")
        ended_at = last + 0.5 if state in ("done", "failed", "superseded") else None
        history.append(StateRow(job_id, 0, "queued", inserted[job_id]))
        for token in tokens:
            first = min(r.started_at for r in rows if r.token == token)
            history.append(StateRow(job_id, token, "running", first - 0.01))
        if ended_at is not None:
            history.append(StateRow(job_id, max(tokens, default=0), state, ended_at))
        result = KEY_UNITS if state == "done" else None
        jobs[job_id] = JobRow(
            job_id,
            state,
            len(tokens),
            max(tokens, default=0),
            result,
            {"next": KEY_UNITS},
            None,
            ended_at,
            keys.get(job_id, KEY),
        )
    counts: dict[str, int] = {}
    cursor_log = []
    for row in units:
        if row.committed:
            key = keys.get(row.job_id, KEY)
            counts[key] = counts.get(key, 0) + 1
            cursor = json.dumps({"units": counts[key]})
            cursor_log.append(CursorRow(key, row.job_id, row.token or 0, cursor, row.ended_at or 0))
    return Evidence(
        units=UNITS,
        modes={},
        jobs=jobs,
        table_rows=0,
        unit_rows=[r for rows in runs.values() for r in rows],
        checkpoints=[],
        history=history,
        backend={},
        callbacks=[],
        triggers=triggers,
        key_units=KEY_UNITS,
        cursors={key: {"units": n} for key, n in counts.items()},
        cursor_log=cursor_log,
    )


def a_run_and_its_followup(*, followup_from: float = 5.0) -> dict[str, list[Unit]]:
    """Job x runs units 0-2 from 0 to 3 (token 1), its follow-up y from ``followup_from``."""
    return {
        "x": run_of("x", 1, range(KEY_UNITS), 0),
        "y": run_of("y", 1, range(KEY_UNITS), followup_from),
    }


#: x's own trigger (before it started), and two during its run, served by its follow-up y.
TRIGGERS = [Trigger(KEY, "x", "x", -1.0), Trigger(KEY, "y", "y", 1.0), Trigger(KEY, "t3", "y", 2.0)]
INSERTED = {"x": -1.0, "y": 3.6}


def test_a_keyed_run_its_coalesced_triggers_and_their_followup_keep_every_invariant() -> None:
    e = keyed_evidence(a_run_and_its_followup(), TRIGGERS, inserted=INSERTED)

    assert failed_checks(e) == []
    assert (e.figures["triggers"], e.figures["trigger_jobs"], e.figures["cursor_writes"]) == (
        3,
        2,
        6,
    )


def test_the_keyed_checks_say_so_when_a_run_had_no_keyed_jobs() -> None:
    e = evidence(EXACTLY_ONCE, run_of("j", 1, range(4), 0), attempts=1)

    lines = {check.name: check.text for check in check_all(e)}

    assert lines[FOLLOWED] == "no keyed jobs in this run"


def test_committed_units_of_two_jobs_of_one_key_overlapping_are_caught() -> None:
    # Given y's first unit (2.5-3.5) overlapping x's last (2-3), y inserted after x ended
    runs = a_run_and_its_followup(followup_from=2.5)
    e = keyed_evidence(runs, TRIGGERS[:2], inserted={"x": -1.0, "y": 3.6})

    failed = failed_checks(e)

    assert failed == [ONE_RUN]
    assert e.figures["key_overlaps"] == 1
    (check,) = [c for c in check_all(e) if c.name.startswith(ONE_RUN)]
    assert "unit 2 of x (token 1, 2.000-3.000) overlaps unit 0 of y (token 1" in check.text


def test_a_run_of_a_keys_job_started_while_another_run_of_the_key_went_on_is_caught() -> None:
    # Given y's first attempt starting at 1.5 (its unit never committed: it died), while x ran
    # from 0 and committed until 3, then y's second attempt from 5
    runs = {
        "x": run_of("x", 1, range(KEY_UNITS), 0),
        "y": [unit("y", 0, 1, 1.5, None), *run_of("y", 2, range(KEY_UNITS), 5)],
    }
    e = keyed_evidence(runs, TRIGGERS[:2], inserted={"x": -1.0, "y": 1.4})

    assert failed_checks(e) == [ONE_RUN]
    # no committed units overlap: the run's start inside x's is what shows it
    assert (e.figures["key_overlaps"], e.figures["key_runs_inside"]) == (0, 1)


def test_two_jobs_of_one_key_live_at_once_in_the_state_log_are_caught() -> None:
    # Given y inserted (queued) at 2, while x ran until 3.5, though y ran only from 5
    e = keyed_evidence(a_run_and_its_followup(), TRIGGERS, inserted={"x": -1.0, "y": 2.0})

    assert failed_checks(e) == [ONE_RUN]
    assert (e.figures["key_runs_inside"], e.figures["key_live_overlaps"]) == (0, 1)


def test_jobs_of_two_keys_may_run_at_once() -> None:
    runs = a_run_and_its_followup(followup_from=1.0)
    triggers = [Trigger(KEY, "x", "x", -1.0), Trigger("account:b", "y", "y", 0.5)]
    e = keyed_evidence(runs, triggers, inserted={"x": -1.0, "y": 0.5}, keys={"y": "account:b"})

    assert failed_checks(e) == []


def test_a_trigger_no_run_of_its_key_started_after_is_caught() -> None:
    # Given a trigger at 6, coalesced into y, which had started at 5: nothing ran after it
    late = Trigger(KEY, "t4", "y", 6.0)
    e = keyed_evidence(a_run_and_its_followup(), [*TRIGGERS, late], inserted=INSERTED)

    assert failed_checks(e) == [FOLLOWED]
    (check,) = [c for c in check_all(e) if c.name == FOLLOWED]
    assert "trigger t4 of account:a at 6.000: served by y, done, started -1.00s" in check.text


def test_a_trigger_followed_only_by_a_run_that_did_not_end_done_is_caught() -> None:
    e = keyed_evidence(
        a_run_and_its_followup(), TRIGGERS, inserted=INSERTED, states={"y": "failed"}
    )

    assert failed_checks(e) == [KEYED, FOLLOWED, LOST]


def test_a_trigger_whose_result_id_has_no_job_is_caught_as_lost() -> None:
    # Given the trigger at 1 answered with job z, which never existed (y ran after it anyway)
    lost = [TRIGGERS[0], Trigger(KEY, "y", "y", 1.0), Trigger(KEY, "t3", "z", 2.0)]
    e = keyed_evidence(a_run_and_its_followup(), lost, inserted=INSERTED)

    assert failed_checks(e) == [LOST]
    (check,) = [c for c in check_all(e) if c.name.startswith(LOST)]
    assert "trigger t3 of account:a: served by z, which has no row" in check.text

    # And one answered with a job of another key (no job of its own key ran after it either)
    other = [TRIGGERS[0], Trigger("account:b", "t3", "y", 1.0)]
    e = keyed_evidence(a_run_and_its_followup(), other, inserted=INSERTED)
    assert failed_checks(e) == [FOLLOWED, LOST]


def test_a_call_that_raised_is_not_a_trigger_to_serve() -> None:
    failed_call = Trigger(KEY, "t9", None, 9.0)
    e = keyed_evidence(a_run_and_its_followup(), [*TRIGGERS, failed_call], inserted=INSERTED)

    assert failed_checks(e) == []
    assert e.figures["triggers_failed_calls"] == 1


def test_a_keyed_unit_committed_twice_or_a_keyed_job_left_queued_is_caught() -> None:
    # Given x resumed (token 2) and committing its unit 2 again
    twice = a_run_and_its_followup()
    twice["x"] = [*twice["x"], unit("x", 2, 2, 3.1, 3.2)]
    e = keyed_evidence(twice, TRIGGERS, inserted={"x": -1.0, "y": 4.0})
    assert failed_checks(e) == [KEYED]
    assert e.figures["keyed_duplicated"] == 1

    # And y never run: stuck queued, its triggers unserved
    stuck = keyed_evidence(
        {"x": run_of("x", 1, range(KEY_UNITS), 0), "y": []},
        TRIGGERS,
        inserted=INSERTED,
        states={"y": "queued"},
    )
    assert failed_checks(stuck) == [KEYED, FOLLOWED, LOST]


def test_a_cursor_that_disagrees_with_the_units_its_keys_jobs_committed_is_caught() -> None:
    e = keyed_evidence(a_run_and_its_followup(), TRIGGERS, inserted=INSERTED)
    assert e.cursors == {KEY: {"units": 6}}

    # A final cursor one short (a write lost), or none at all
    for cursors in [{KEY: {"units": 5}}, {}]:
        assert failed_checks(replace(e, cursors=cursors)) == [CURSORS], cursors


def test_a_stale_repeated_or_missing_cursor_write_is_caught() -> None:
    e = keyed_evidence(a_run_and_its_followup(), TRIGGERS, inserted=INSERTED)
    log = e.cursor_log
    writes = 4

    # A stale attempt of x (token 1, superseded) writing units=3 again after y's first write
    stale = CursorRow(KEY, "x", 1, json.dumps({"units": 3}), 5.5)
    assert failed_checks(replace(e, cursor_log=[*log[:writes], stale, *log[writes:]])) == [CURSORS]

    # Or by a token that committed no unit, with the next value
    ghost = [*log[:3], CursorRow(KEY, "x", 2, json.dumps({"units": 4}), 3.2)]
    ghost += [replace(r, cursor=json.dumps({"units": (r.units or 0) + 1})) for r in log[3:]]
    failed = replace(e, cursor_log=ghost, cursors={KEY: {"units": 7}})
    assert failed_checks(failed) == [CURSORS]

    # Or a committed unit whose write is missing (the log skips from 2 to 4)
    assert failed_checks(replace(e, cursor_log=[*log[:2], *log[3:]])) == [CURSORS]


# -- keyed jobs under the triggers-on-the-key model (issue 23) -----------------------------------
#
# x runs from 0 to 3 (its own trigger at -1); the triggers at 1 and 2 wait on the key under the
# first one's id, y; when x ends, y runs for them (a follow-up) or, when a run of the key started
# after both, y is a served row naming that run.

CONTROLS_KEYED = "keyed controls"
ONE_AT_A_TIME = "never two attempts at once"
INTERRUPTS = "interrupts"
CLIENTS = "dying clients"


def served_row(job_id: str, by: JobRow, *, at: float, state: str = "done") -> JobRow:
    """A row recording the triggers of ``job_id`` as served by run ``by``."""
    result = by.result if state == "done" else None
    return JobRow(job_id, state, 0, 0, result, None, None, at, by.key, None, by.id)


def with_served(e: Evidence, job_id: str, by: str, *, at: float, state: str = "done") -> Evidence:
    """``e`` with the triggers answered ``job_id`` served by run ``by`` (a row of their own,
    inserted done at ``at``), and what the backend holds for every result id."""
    jobs = {**e.jobs, job_id: served_row(job_id, e.jobs[by], at=at, state=state)}
    history = [*(e.history or []), StateRow(job_id, 0, state, at)]
    return replace(e, jobs=jobs, history=history, key_backend=key_backend(jobs))


def key_backend(jobs: dict[str, JobRow]) -> dict[str, Outcome]:
    status = {"done": "SUCCESS", "failed": "FAILURE", "revoked": "REVOKED", "cancelled": "REVOKED"}
    status["superseded"] = "REVOKED"
    return {
        i: Outcome(status[j.state], j.result if j.state == "done" else "x")
        for i, j in jobs.items()
        if j.state in status
    }


def test_triggers_served_by_a_run_that_started_after_them_keep_every_invariant() -> None:
    # Given x holding the key from -1 (queued) and starting at 4, after the triggers at 1 and 2
    # (they waited under y), so x served them: y is a served row, no run of its own
    runs = {"x": run_of("x", 1, range(KEY_UNITS), 4)}
    e = keyed_evidence(runs, TRIGGERS, inserted={"x": -1.0})
    e = with_served(e, "y", "x", at=7.6)

    assert failed_checks(e) == []
    assert (e.figures["keyed_served_rows"], e.figures["keyed_jobs"]) == (1, 1)


def test_a_served_rows_unstored_notice_is_tolerated_only_if_its_taker_was_killed_just_after() -> (
    None
):
    # Given x (pid 101) serving the triggers of y, recorded at 7.6 as x ended (7.5), and the
    # result backend told nothing of y: the worker that takes y's notice at x's end died
    # before storing it (a notice goes to one taker), in the window the guarantees page leaves
    runs = {"x": run_of("x", 1, range(KEY_UNITS), 4)}
    served = with_served(keyed_evidence(runs, TRIGGERS, inserted={"x": -1.0}), "y", "x", at=7.6)
    unstored = replace(served, key_backend={"x": served.key_backend["x"]})

    # When x's process was SIGKILLed 0.3 s after y was recorded, it is tolerated and counted
    killed = replace(unstored, kills=[Kill(7.9, (101,))])
    assert failed_checks(killed) == []
    assert killed.figures["keyed_backend_unstored"] == 1

    # Then with no kill, a kill of another process, or one too late, it is caught
    for kills in [[], [Kill(7.9, (999,))], [Kill(9.0, (101,))]]:
        assert failed_checks(replace(unstored, kills=kills)) == [LOST], kills
        (check,) = [c for c in check_all(replace(unstored, kills=kills)) if c.name.startswith(LOST)]
        assert "y: table done, backend nothing" in check.text

    # And a row a reaper pass recorded long after x ended (any pool process may run that pass)
    # is tolerated with the SIGKILL of any process just after it, not of none
    late = with_served(keyed_evidence(runs, TRIGGERS, inserted={"x": -1.0}), "y", "x", at=20.0)
    late = replace(late, key_backend={"x": late.key_backend["x"]})
    assert failed_checks(replace(late, kills=[Kill(20.4, (999,))])) == []
    assert failed_checks(late) == [LOST]


def test_triggers_served_by_a_run_that_started_before_one_of_them_are_caught() -> None:
    # Given x started at 0, before the triggers at 1 and 2, and yet recorded as serving them
    e = keyed_evidence({"x": run_of("x", 1, range(KEY_UNITS), 0)}, TRIGGERS, inserted={"x": -1.0})
    e = with_served(e, "y", "x", at=3.6)

    assert failed_checks(e) == [FOLLOWED]
    (check,) = [c for c in check_all(e) if c.name == FOLLOWED]
    assert "trigger y of account:a at 1.000: served by y served by x, done, started -1.00s" in (
        check.text
    )


def test_a_run_claimed_before_a_trigger_does_not_follow_it_even_if_its_first_unit_came_after() -> (
    None
):
    # Given y, the follow-up of the triggers at 1 and 2, claimed at 1.5 (its started_at) but
    # its first unit only at 5: its claim read the key's cursor before the trigger at 2
    e = keyed_evidence(a_run_and_its_followup(), TRIGGERS, inserted=INSERTED)
    e = replace(e, jobs={**e.jobs, "y": replace(e.jobs["y"], started_at=1.5)})

    assert failed_checks(e) == [FOLLOWED]


def test_triggers_served_by_a_run_that_was_revoked_or_cancelled_are_caught_as_lost() -> None:
    # Given x, which started after the triggers, revoked by the driver (a revoke of x, not of
    # y): the triggers answered y never got a run that ended done
    runs = {"x": run_of("x", 1, range(2), 4)}
    e = keyed_evidence(runs, TRIGGERS, inserted={"x": -1.0}, states={"x": "revoked"})
    e = replace(
        e,
        jobs={**e.jobs, "x": replace(e.jobs["x"], finished_at=6.5)},
        history=[*(e.history or []), StateRow("x", 1, "revoked", 6.5)],
        key_controls=[Control("x", "revoke", 3.0, "queued")],
    )
    e = with_served(e, "y", "x", at=6.6, state="failed")

    failed = failed_checks(e)

    assert failed == [FOLLOWED, LOST]
    (check,) = [c for c in check_all(e) if c.name.startswith(LOST)]
    assert "trigger y of account:a: served by y, failed, served by x" in check.text


def test_a_served_row_that_does_not_mirror_its_run_is_caught() -> None:
    runs = {"x": run_of("x", 1, range(KEY_UNITS), 4)}
    e = with_served(keyed_evidence(runs, TRIGGERS, inserted={"x": -1.0}), "y", "x", at=7.6)

    wrong = replace(e, jobs={**e.jobs, "y": replace(e.jobs["y"], result=KEY_UNITS + 1)})
    assert KEYED in failed_checks(wrong)
    # nor names a run of another key, nor had attempts of its own
    other = replace(e, jobs={**e.jobs, "x": replace(e.jobs["x"], key="account:b")})
    assert KEYED in failed_checks(other)
    attempted = replace(e, jobs={**e.jobs, "y": replace(e.jobs["y"], attempts=1)})
    assert KEYED in failed_checks(attempted)


def test_triggers_still_waiting_on_a_key_at_the_end_are_caught_as_lost() -> None:
    e = keyed_evidence(a_run_and_its_followup(), TRIGGERS, inserted=INSERTED)

    assert failed_checks(replace(e, pending={KEY: "t9"})) == [LOST]


def test_a_result_backend_that_disagrees_with_a_triggers_result_id_is_caught() -> None:
    e = keyed_evidence(a_run_and_its_followup(), TRIGGERS, inserted=INSERTED)
    e = replace(e, key_backend=key_backend(e.jobs))
    assert failed_checks(e) == []

    for outcome in (Outcome("PENDING", None), Outcome("SUCCESS", 99), Outcome("REVOKED", "x")):
        wrong = replace(e, key_backend={**(e.key_backend or {}), "y": outcome})
        assert failed_checks(wrong) == [LOST], outcome


def test_a_keyed_job_revoked_or_cancelled_while_queued_loses_no_other_trigger() -> None:
    # Given x's own trigger at -1, x cancelled while queued (at 0.5, before it ran), and the
    # triggers at 1 and 2 that waited on the key under y run by y from 5
    runs = {"x": [], "y": run_of("y", 1, range(KEY_UNITS), 5)}
    e = keyed_evidence(runs, TRIGGERS, inserted=INSERTED, states={"x": "cancelled"})
    x = replace(e.jobs["x"], finished_at=0.5)
    e = replace(
        e,
        jobs={**e.jobs, "x": x},
        history=[*(e.history or []), StateRow("x", 0, "cancelled", 0.5)],
        key_controls=[Control("x", "cancel", 0.4, "queued")],
    )
    assert failed_checks(e) == []
    assert e.figures["triggers_stopped_by_their_control"] == 1

    # But not when the cancel found nothing to cancel (the id of waiting triggers, no row yet)
    nothing = replace(e, key_controls=[Control("x", "cancel", 0.4, "none")])
    assert failed_checks(nothing) == [KEYED, FOLLOWED, LOST]
    # Nor when y, which no control named, ended cancelled with x: its triggers are lost
    y = replace(e.jobs["y"], state="cancelled", result=None)
    history = [
        replace(r, state="cancelled") if r.job_id == "y" and r.state == "done" else r
        for r in e.history or []
    ]
    both = replace(e, jobs={**e.jobs, "y": y}, history=history)
    assert failed_checks(both) == [KEYED, FOLLOWED, LOST]


def test_a_keyed_job_that_expired_is_allowed_only_its_own_expires_and_only_after_it() -> None:
    # Given x's own call sent with expires at 0.8: x expired (revoked at 1.0) before it ran
    runs = {"x": [], "y": run_of("y", 1, range(KEY_UNITS), 5)}
    triggers = [Trigger(KEY, "x", "x", -1.0, -0.9), *TRIGGERS[1:]]
    e = keyed_evidence(runs, triggers, inserted=INSERTED, states={"x": "revoked"})
    x = replace(e.jobs["x"], finished_at=1.0, expires=True)
    e = replace(
        e,
        jobs={**e.jobs, "x": x},
        history=[*(e.history or []), StateRow("x", 0, "revoked", 1.0)],
        key_expires={"x": 0.8},
    )
    assert failed_checks(e) == []

    # Revoked before its expires passed: caught
    early = replace(e, key_expires={"x": 1.5})
    assert failed_checks(early) == [CONTROLS_KEYED]
    # A run carrying expires no call of its id was sent with: caught (and it may not end
    # revoked either)
    assert CONTROLS_KEYED in failed_checks(replace(e, key_expires={}))


def test_a_followup_that_inherits_its_triggers_expires_is_caught() -> None:
    # Given y's trigger sent with expires, y recorded at 3.6 as the follow-up of the triggers
    # that waited (after that call returned at 1.1), carrying the expires, and expiring
    triggers = [TRIGGERS[0], Trigger(KEY, "y", "y", 1.0, 1.1), TRIGGERS[2]]
    runs = {"x": run_of("x", 1, range(KEY_UNITS), 0), "y": []}
    e = keyed_evidence(runs, triggers, inserted=INSERTED, states={"y": "revoked"})
    y = replace(e.jobs["y"], finished_at=4.0, expires=True)
    e = replace(
        e,
        jobs={**e.jobs, "y": y},
        history=[*(e.history or []), StateRow("y", 0, "revoked", 4.0)],
        key_expires={"y": 3.9},
    )

    assert failed_checks(e) == [KEYED, FOLLOWED, LOST, CONTROLS_KEYED]
    (check,) = [c for c in check_all(e) if c.name.startswith(CONTROLS_KEYED)]
    assert "y: a follow-up (inserted +2.50s after its trigger's call returned)" in check.text


# -- two attempts at once -------------------------------------------------------------------------


def superseded_evidence(**changes: object) -> Evidence:
    """Attempt 1 (pid 101) of j runs units 0-1 from 0; attempt 2 claims j at 2.99 and runs
    units 2-3 from 3; attempt 1 starts unit 2 at 3.5 (never committed: fenced)."""
    rows = [
        *run_of("j", 1, range(2), 0),
        unit("j", 2, 1, 3.5, None),
        *run_of("j", 2, range(2, 4), 3),
    ]
    return replace(evidence(AT_LEAST_ONCE, rows), **changes)  # type: ignore[arg-type]


def test_a_superseded_attempt_that_went_on_while_its_process_ran_is_caught() -> None:
    e = superseded_evidence()

    assert failed_checks(e) == [ONE_AT_A_TIME]
    (check,) = [c for c in check_all(e) if c.name.startswith(ONE_AT_A_TIME)]
    assert "j: the run of token 1 (pid 101) started unit 2 +0.51s after" in check.text


def test_a_superseded_attempt_that_went_on_after_being_stopped_is_excused() -> None:
    # Its own process frozen past its lease
    assert failed_checks(superseded_evidence(pauses=[Pause((101,), 1.0, 3.2)])) == []
    # Another process frozen: not an excuse, unless it held the whole database's lock
    other = [Pause((202,), 1.0, 3.2)]
    assert failed_checks(superseded_evidence(pauses=other)) == [ONE_AT_A_TIME]
    assert failed_checks(superseded_evidence(pauses=other, global_lock=True)) == []
    # PostgreSQL restarting just before, or its worker saying its renewals failed
    assert failed_checks(superseded_evidence(restarts=[0.5])) == []
    assert failed_checks(superseded_evidence(lost_renewals={"j"})) == []


# -- interrupts and dying clients -----------------------------------------------------------------


def test_a_connection_used_after_an_interrupt_or_a_conflict_told_as_an_outage_is_caught() -> None:
    e = evidence(EXACTLY_ONCE, run_of("j", 1, range(4), 0), attempts=1)
    reuse = ["worker1: ... OperationalError: another command is already in progress"]
    outage = ["worker2: leases database unreachable: could not serialize access"]

    assert failed_checks(replace(e, log_errors={"reuse": reuse})) == [INTERRUPTS]
    assert failed_checks(replace(e, log_errors={"conflict_as_outage": outage})) == [INTERRUPTS]
    counts = {"soft limit in library statement": 3, "conflicts run again by the library": 2}
    fine = replace(e, soft_limited={"j": 2.0}, log_counts=counts)
    assert failed_checks(fine) == []
    assert fine.figures["soft_limits_in_library_statements"] == 3


def test_a_job_a_killed_client_recorded_and_nobody_ran_is_caught() -> None:
    # Given j recorded by a client killed before it published j (the call never returned)
    ran = evidence(EXACTLY_ONCE, run_of("j", 1, range(4), 0), attempts=1)
    assert failed_checks(replace(ran, client_calls={"j": False, "gone": False})) == []
    assert ran.figures["client_interrupted_after_record"] == 1

    stuck = JobRow("j", "queued", 0, 0, None, None, None)
    e = evidence(EXACTLY_ONCE, [], jobs={"j": stuck}, attempts=0)
    assert CLIENTS in failed_checks(replace(e, client_calls={"j": False}))


# -- a lease that outlives its attempt ------------------------------------------------------------

OUTLIVES = "no lease outlives its attempt"


def outliving(rows: list[Unit]) -> Evidence:
    """The evidence of one exactly-once job j that ended done half a second after its last
    unit, checked with a slack of 15 s."""
    end = max(r.ended_at or r.started_at for r in rows) + 0.5
    job = replace(done("j", max(r.token or 0 for r in rows)), finished_at=end)
    return replace(evidence(EXACTLY_ONCE, rows, jobs={"j": job}), hold_slack=15.0)


def test_a_job_left_claimed_long_after_its_attempt_ended_is_caught() -> None:
    # Given attempt 1 (pid 101) whose last unit started at 2 and never committed (it gave up:
    # the database ended its transaction), and the job claimed again only at 30.99
    rows = [
        *run_of("j", 1, range(2), 0),
        unit("j", 2, 1, 2, None),
        *run_of("j", 2, range(2, 4), 31),
    ]
    e = outliving(rows)

    assert failed_checks(e) == [OUTLIVES]
    (check,) = [c for c in check_all(e) if c.name.startswith(OUTLIVES)]
    assert "j: token 1 still claimed 29.0 s after its attempt's last unit (pid 101)" in check.text

    # Freed within the slack: fine
    soon = [*rows[:3], *run_of("j", 2, range(2, 4), 12)]
    assert failed_checks(outliving(soon)) == []


def test_a_job_held_while_its_process_was_stopped_or_the_database_restarted_is_excused() -> None:
    rows = [
        *run_of("j", 1, range(2), 0),
        unit("j", 2, 1, 2, None),
        *run_of("j", 2, range(2, 4), 31),
    ]
    e = outliving(rows)

    # Its process stopped from 3 to 25: 7 s left, under the slack
    assert failed_checks(replace(e, pauses=[Pause((101,), 3.0, 25.0)])) == []
    # Another process stopped: no excuse (unless one lock holds the whole database)
    assert failed_checks(replace(e, pauses=[Pause((202,), 3.0, 25.0)])) == [OUTLIVES]
    assert failed_checks(replace(e, pauses=[Pause((202,), 3.0, 25.0)], global_lock=True)) == []
    assert failed_checks(replace(e, restarts=[10.0])) == []


def test_an_attempt_that_found_another_holding_its_job_while_it_ran_unstopped_is_caught() -> None:
    # Given attempt 1 (pid 101) told at its checkpoint (at 3.4) that attempt 2 held the job: no
    # unit of it started after the newer claim, yet it ran while attempt 2 did
    rows = [*run_of("j", 1, range(2), 0), unit("j", 2, 1, 2, None), *run_of("j", 2, range(2, 4), 3)]
    e = replace(evidence(EXACTLY_ONCE, rows), lost_to_another=[("j", 1, 3.4)])

    assert failed_checks(e) == [ONE_AT_A_TIME]
    (check,) = [c for c in check_all(e) if c.name.startswith(ONE_AT_A_TIME)]
    assert "j: its attempt of token 1 (pid 101) was still running when another" in check.text
    # Its process stopped not long before, or killed first: excused
    assert failed_checks(replace(e, pauses=[Pause((101,), 0.5, 3.3)])) == []
    assert failed_checks(replace(e, lost_renewals={"j"})) == []
    # A pause long before does not excuse it
    long_ago = replace(e, pauses=[Pause((101,), -60.0, -50.0)])
    assert failed_checks(long_ago) == [ONE_AT_A_TIME]


def test_a_revoke_of_the_id_waiting_triggers_share_stops_every_trigger_that_shares_it() -> None:
    # Given the triggers at 1 and 2 waiting under y, and y revoked at 1.5 (before it existed:
    # the revoke flagged the id): y's run was discarded, its callers told REVOKED
    runs = {"x": run_of("x", 1, range(KEY_UNITS), 0), "y": []}
    e = keyed_evidence(runs, TRIGGERS, inserted=INSERTED, states={"y": "revoked"})
    y = replace(e.jobs["y"], finished_at=3.7)
    e = replace(
        e,
        jobs={**e.jobs, "y": y},
        history=[*(e.history or []), StateRow("y", 0, "revoked", 3.7)],
        key_controls=[Control("y", "revoke", 1.5, "pending")],
    )

    # Then both are stopped as the documented rule says (a revoke is of an id, for good), the
    # one that joined the id after the revoke included
    assert failed_checks(e) == []
    # But a run nobody revoked that ended revoked loses them
    assert {FOLLOWED, LOST} <= set(failed_checks(replace(e, key_controls=[])))


# -- debounce and newest wins ----------------------------------------------------------------------
#
# A debounced key d: the triggers x (at 0), t2 (0.3) and t3 (0.6) are one burst, answered with
# x's id; x is due at min(0.6 + quiet, 0 + max wait) = 1.1 and runs with t3's arguments. A
# newest-wins key n: x runs from 0 (its own trigger at -1); y at 1.2 supersedes it, x commits
# the unit in flight (1-2) and ends superseded at 2.5; y runs with its own arguments from 2.6.

DEBOUNCE = "debounce"
NEWEST = "newest wins"
DKEY = "account:d0"
NKEY = "account:n0"
QUIET, MAX_WAIT = 0.5, 3.0


def with_markers(e: Evidence, markers: dict[str, str]) -> Evidence:
    """``e`` with a checkpoint per committed unit of each job in ``markers``, saving that
    marker (the id of the trigger whose arguments the run had), in commit order."""
    rows = sorted((r for r in e.unit_rows if r.committed), key=lambda r: r.ended_at or 0.0)
    checkpoints = [
        CheckpointRow(
            r.job_id,
            r.token or 0,
            json.dumps({"next": r.unit + 1, "marker": markers[r.job_id]}),
            r.ended_at or 0.0,
        )
        for r in rows
        if r.job_id in markers
    ]
    return replace(e, checkpoints=[*e.checkpoints, *checkpoints])


def debounced(*, start: float = 1.2, marker: str = "t3", triggers: list[Trigger] | None = None):
    burst = triggers or [
        Trigger(DKEY, "x", "x", 0.0, 0.05),
        Trigger(DKEY, "t2", "x", 0.3, 0.35),
        Trigger(DKEY, "t3", "x", 0.6, 0.65),
    ]
    runs = {"x": run_of("x", 1, range(KEY_UNITS), start)}
    e = keyed_evidence(runs, burst, inserted={"x": 0.0}, keys={"x": DKEY})
    e = replace(e, debounced_keys={DKEY}, debounce=(QUIET, MAX_WAIT))
    return with_markers(e, {"x": marker})


def test_a_debounced_burst_run_once_after_its_quiet_period_with_its_last_arguments_passes() -> None:
    e = debounced()

    assert failed_checks(e) == []
    assert (e.figures["debounce_bursts"], e.figures["debounce_largest_burst"]) == (1, 3)
    assert e.figures["debounce_latest_start"] == 0.1


def test_a_debounced_run_with_an_earlier_triggers_arguments_is_caught() -> None:
    e = debounced(marker="t2")

    assert failed_checks(e) == [DEBOUNCE]
    (check,) = [c for c in check_all(e) if c.name.startswith(DEBOUNCE)]
    assert "x (account:d0, done): ran with the arguments of t2; the last of 3" in check.text


def test_a_debounced_run_claimed_before_its_quiet_period_ended_is_caught() -> None:
    # Given x claimed at 0.9, 0.2 s before the last trigger (0.6) + quiet (0.5)
    e = debounced(start=0.9)

    assert failed_checks(e) == [DEBOUNCE]
    (check,) = [c for c in check_all(e) if c.name.startswith(DEBOUNCE)]
    assert "x (account:d0): claimed at 0.900, 0.20 s before its due time" in check.text

    # But a steady stream runs at max wait after its first trigger, before quiet after its last
    stream = [Trigger(DKEY, "x", "x", 0.0)] + [
        Trigger(DKEY, f"t{n}", "x", 0.4 * n) for n in range(1, 8)
    ]
    assert failed_checks(debounced(start=3.05, marker="t7", triggers=stream)) == []


def test_a_debounced_run_started_late_is_reported_not_failed() -> None:
    # Given x claimed at 9, long after max wait (a frozen worker held it)
    e = debounced(start=9.0)

    assert failed_checks(e) == []
    assert e.figures["debounce_past_max_wait"] == 1
    assert e.figures["debounce_latest_start"] == 7.9

    # And the triggers that kept coming after max wait, while it waited, are counted
    stream = [Trigger(DKEY, "x", "x", 0.0)] + [Trigger(DKEY, f"t{n}", "x", n) for n in range(1, 8)]
    e = debounced(start=9.0, marker="t7", triggers=stream)
    assert failed_checks(e) == []
    assert e.figures["debounce_triggers_after_max_wait"] == 4


def debounced_followup(*, start: float = 4.8, marker: str = "t5") -> Evidence:
    """x's burst (x at 0) runs its units from 1.2 to 4.2 and ends at 4.7; y (2.0) and t5 (2.3)
    come during its run and wait on the key, answered with y's id: the follow-up y, recorded
    when x ends, due at min(2.3 + quiet, 2.0 + max wait) = 2.8, so it runs at once, with t5's
    arguments (the newest)."""
    triggers = [
        Trigger(DKEY, "x", "x", 0.0, 0.05),
        Trigger(DKEY, "y", "y", 2.0, 2.05),
        Trigger(DKEY, "t5", "y", 2.3, 2.35),
    ]
    runs = {
        "x": run_of("x", 1, range(KEY_UNITS), 1.2),
        "y": run_of("y", 1, range(KEY_UNITS), start),
    }
    e = keyed_evidence(runs, triggers, inserted={"x": 0.0, "y": 4.7}, keys={"x": DKEY, "y": DKEY})
    e = replace(e, debounced_keys={DKEY}, debounce=(QUIET, MAX_WAIT))
    return with_markers(e, {"x": "x", "y": marker})


def test_a_debounced_follow_up_runs_with_the_newest_waiting_triggers_arguments() -> None:
    e = debounced_followup()

    assert failed_checks(e) == []
    assert (e.figures["debounce_bursts"], e.figures["debounce_followups"]) == (1, 1)

    # The first waiting trigger's arguments (what follow-ups ran with before) are caught
    first = debounced_followup(marker="y")
    assert failed_checks(first) == [DEBOUNCE]
    (check,) = [c for c in check_all(first) if c.name.startswith(DEBOUNCE)]
    assert "y (account:d0, done): ran with the arguments of y; the last of 2 that waited" in (
        check.text
    )

    # And a follow-up claimed before its quiet period ended is caught, as a burst's run is
    early = debounced_followup(start=2.6)
    assert DEBOUNCE in failed_checks(early)
    (check,) = [c for c in check_all(early) if c.name.startswith(DEBOUNCE)]
    assert "y (account:d0): claimed at 2.600, 0.20 s before its due time" in check.text


def test_two_runs_of_a_debounced_key_at_once_are_caught_by_the_one_run_per_key_check() -> None:
    # Given y, the follow-up of a trigger during x's run, running from 3 while x ran until 4.2
    runs = {"x": run_of("x", 1, range(KEY_UNITS), 1.2), "y": run_of("y", 1, range(KEY_UNITS), 3)}
    triggers = [Trigger(DKEY, "x", "x", 0.0, 0.05), Trigger(DKEY, "y", "y", 2.0, 2.05)]
    e = keyed_evidence(runs, triggers, inserted={"x": 0.0, "y": 2.9}, keys={"x": DKEY, "y": DKEY})
    e = with_markers(replace(e, debounced_keys={DKEY}, debounce=(QUIET, MAX_WAIT)), {"x": "x"})
    e = with_markers(e, {"y": "y"})

    assert failed_checks(e) == [ONE_RUN]


def newest(
    *, x_units: int = 2, y_from: float = 2.6, markers: dict[str, str] | None = None
) -> Evidence:
    triggers = [Trigger(NKEY, "x", "x", -1.0, -0.95), Trigger(NKEY, "y", "y", 1.2, 1.25)]
    runs = {"x": run_of("x", 1, range(x_units), 0), "y": run_of("y", 1, range(KEY_UNITS), y_from)}
    e = keyed_evidence(
        runs,
        triggers,
        inserted={"x": -1.0, "y": x_units + 0.55},  # x ends at its last unit + 0.5
        states={"x": "superseded"},
        keys={"x": NKEY, "y": NKEY},
    )
    e = replace(e, newest_keys={NKEY}, key_backend=key_backend(e.jobs))
    return with_markers(e, markers or {"x": "x", "y": "y"})


def test_a_job_superseded_at_its_checkpoint_and_the_newest_triggers_run_keep_every_invariant() -> (
    None
):
    e = newest()

    assert failed_checks(e) == []
    assert (e.figures["newest_superseded"], e.figures["newest_units_after_supersede"]) == (1, 1)
    assert e.figures["triggers_stopped_by_their_control"] == 1


def test_a_superseded_job_that_commits_beyond_the_unit_in_flight_is_caught() -> None:
    # Given x going on to commit unit 2 (2-3) after finishing the one in flight at the call
    e = newest(x_units=3, y_from=3.6)

    assert failed_checks(e) == [NEWEST]
    (check,) = [c for c in check_all(e) if c.name.startswith(NEWEST)]
    said = "x (account:n0, token 1): superseded by y (answered 1.250), then committed units [1, 2]"
    assert said in check.text


def test_a_last_run_without_the_newest_triggers_arguments_is_caught() -> None:
    e = newest(markers={"x": "x", "y": "x"})

    assert failed_checks(e) == [NEWEST]
    (check,) = [c for c in check_all(e) if c.name.startswith(NEWEST)]
    assert "account:n0: last trigger y at 1.200; the key's last run y, done" in check.text


def test_a_job_superseded_with_no_newer_trigger_or_on_a_coalescing_key_is_caught() -> None:
    e = newest()
    alone = replace(e, triggers=[t for t in e.triggers or [] if t.id == "x"])
    assert NEWEST in failed_checks(alone)

    # superseded is no end for a job of a coalescing key, nor REVOKED for its callers
    coalescing = replace(e, newest_keys=set())
    assert {KEYED, LOST} <= set(failed_checks(coalescing))


def test_triggers_served_by_a_run_with_older_arguments_on_a_newest_wins_key_are_caught() -> None:
    # Given z, a trigger at 2.55 answered with its own id, z recorded as served by y (which was
    # claimed at 2.6, after it): y ran with y's arguments, so z's caller gets a result computed
    # from older ones
    e = newest()
    late = Trigger(NKEY, "z", "z", 2.55, 2.58)
    e = replace(e, triggers=[*(e.triggers or []), late])
    e = with_served(e, "z", "y", at=6.0)
    e = replace(e, newest_keys={NKEY})

    assert failed_checks(e) == [NEWEST]
    (check,) = [c for c in check_all(e) if c.name.startswith(NEWEST)]
    assert "y (account:n0): done, ran with the arguments of y; the newest of its 2" in check.text


def test_a_superseded_job_the_result_backend_does_not_call_revoked_is_caught() -> None:
    e = newest()
    assert (e.key_backend or {})["x"].status == "REVOKED"

    wrong = replace(e, key_backend={**(e.key_backend or {}), "x": Outcome("SUCCESS", KEY_UNITS)})

    assert failed_checks(wrong) == [LOST]


GROUP_LIMIT = "group limit"
GROUP_RATE = "group rate"
GROUPED = "no grouped job lost"


def grouped(
    starts: dict[str, float],
    *,
    limit: int | None = 1,
    rate: float | None = None,
    admitted: dict[str, float] | None = None,
    dues: dict[str, float] | None = None,
    states: dict[str, str] | None = None,
) -> Evidence:
    """Exactly-once jobs of group ``g``, each admitted at ``admitted`` (default: 0.1 s before
    its start) with its token at ``dues`` (default: its admission), claimed at its start,
    running ``UNITS`` units back to back and ending done 0.05 s after its last one."""
    admitted = admitted or {j: s - 0.1 for j, s in starts.items()}
    dues = dues or {}
    rows = [r for j, s in starts.items() for r in run_of(j, 1, range(UNITS), s)]
    jobs = {
        j: replace(done(j, 1), finished_at=s + UNITS + 0.05, started_at=s - 0.01)
        for j, s in starts.items()
    }
    for j, state in (states or {}).items():
        jobs[j] = replace(jobs[j], state=state)
    e = consistent(
        Evidence(
            units=UNITS,
            modes=dict.fromkeys(starts, EXACTLY_ONCE),
            jobs=jobs,
            table_rows=len(starts),
            unit_rows=rows,
            checkpoints=[
                CheckpointRow(j, 1, json.dumps({"next": n + 1}), s + n + 1)
                for j, s in starts.items()
                for n in range(UNITS)
            ],
            groups=dict.fromkeys(starts, "g"),
            group_limits={"g": limit},
            group_rates={"g": rate},
            admissions=[
                Admission(j, "g", at, dues.get(j, at))
                for j, at in sorted(admitted.items(), key=lambda item: item[1])
            ],
        )
    )
    return e


def test_grouped_jobs_admitted_one_after_another_keep_every_invariant() -> None:
    # Given a, b, c of a group of limit 1 and rate 1/s, each admitted once the last ended
    e = grouped({"a": 0.0, "b": 4.2, "c": 8.4}, rate=1.0)

    assert failed_checks(e) == []
    assert e.figures["group_g_most_admitted"] == e.figures["group_g_most_running"] == 1
    assert e.figures["grouped_done"] == 3


def test_two_jobs_of_a_group_of_limit_one_at_once_are_caught() -> None:
    # Given b admitted at 1.9 and running from 2 while a (admitted at -0.1) runs until 4
    e = grouped({"a": 0.0, "b": 2.0})

    assert failed_checks(e) == [GROUP_LIMIT]
    (check,) = [c for c in check_all(e) if c.name.startswith(GROUP_LIMIT)]
    assert "g: 2 jobs admitted and live at 1.900 (limit 1)" in check.text
    assert "g: 2 jobs running committed units at 2.000 (limit 1)" in check.text
    # The same with a limit of 2 is no problem
    assert failed_checks(replace(e, group_limits={"g": 2})) == []


def test_admissions_beyond_the_groups_token_bucket_are_caught() -> None:
    # Given a group of limit 3 and rate 1/s whose three jobs' tokens are 0.3 s apart
    starts = {"a": 0.0, "b": 0.3, "c": 0.6}
    e = grouped(starts, limit=3, rate=1.0)

    assert failed_checks(e) == [GROUP_RATE]
    (check,) = [c for c in check_all(e) if c.name.startswith(GROUP_RATE)]
    assert "g (1/s): 3 admissions' tokens within 0.600 s (at most 1.60)" in check.text

    # Admitted together, tokens a second apart, claimed at their tokens: within the bucket
    tokens = {"a": 0.0, "b": 1.0, "c": 2.0}
    together = dict.fromkeys(tokens, -0.1)
    spaced = grouped(tokens, limit=3, rate=1.0, admitted=together, dues={**tokens, "a": -0.1})
    assert failed_checks(spaced) == []
    assert spaced.figures["group_g_waited_for_token"] == 2

    # But claimed before its token is caught
    early = grouped(tokens, limit=3, rate=1.0, admitted=together, dues={**tokens, "c": 2.5})
    assert failed_checks(early) == [GROUP_RATE]
    (check,) = [c for c in check_all(early) if c.name.startswith(GROUP_RATE)]
    assert "g: c: claimed at 1.990, token 2.500" in check.text


def test_a_crashed_jobs_second_attempt_waits_for_an_admission_of_its_own() -> None:
    # Given a (rate 1/s) whose first attempt died in unit 0 and went back to its group's queue
    # at 0.3, admitted again at 0.4 with the next token (0.9), its second attempt run from 1
    e = grouped({"a": 0.0, "b": 6.0}, rate=1.0, admitted={"a": -0.1, "b": 5.9})
    rows = [unit("a", 0, 1, 0.0, None), *run_of("a", 2, range(UNITS), 1.0)]
    rows += [r for r in e.unit_rows if r.job_id == "b"]
    jobs = {**e.jobs, "a": replace(e.jobs["a"], attempts=2, token=2, finished_at=5.05)}
    admissions = [
        Admission("a", "g", -0.1, -0.1),
        Admission("a", "g", 0.3, kind=RELEASED),
        Admission("a", "g", 0.4, 0.9),
        Admission("b", "g", 5.9, 5.9),
    ]
    e = consistent(replace(e, unit_rows=rows, jobs=jobs, admissions=admissions))

    assert failed_checks(e) == []
    assert e.figures["group_g_readmissions"] == 1

    # Its second claim without the new admission is caught: a start no admission let in
    unadmitted = replace(e, admissions=[a for a in admissions if a.at != 0.4])
    assert failed_checks(unadmitted) == [GROUPED]
    (check,) = [c for c in check_all(unadmitted) if c.name.startswith(GROUPED)]
    assert "a (g): claimed at 0.990 with no admission of its own" in check.text

    # And the new admission's token too close to the first is caught, as its claim before it
    crowded = [*admissions[:2], Admission("a", "g", 0.4, 0.4), admissions[3]]
    assert failed_checks(replace(e, admissions=crowded)) == [GROUP_RATE]
    early = [*admissions[:2], Admission("a", "g", 0.4, 1.5), admissions[3]]
    (check,) = [c for c in check_all(replace(e, admissions=early)) if not c.ok]
    assert "g: a: claimed at 0.990, token 1.500" in check.text


def test_a_grouped_job_left_waiting_or_run_without_admission_is_caught() -> None:
    # Given b still queued at the end, never admitted
    e = grouped({"a": 0.0, "b": 4.2}, admitted={"a": -0.1}, states={"b": "queued"})
    e = replace(e, unit_rows=[r for r in e.unit_rows if r.job_id == "a"])
    e = replace(e, jobs={**e.jobs, "b": replace(e.jobs["b"], finished_at=None, started_at=None)})

    assert set(failed_checks(e)) == {EVERY_JOB, GROUPED}
    (check,) = [c for c in check_all(e) if c.name.startswith(GROUPED)]
    assert "b (g): queued, waiting for its admission" in check.text

    # Given b done, never admitted (no admission logged): it ran outside its group's limit
    unadmitted = grouped({"a": 0.0, "b": 4.2}, admitted={"a": -0.1})
    assert failed_checks(unadmitted) == [GROUPED]
    (check,) = [c for c in check_all(unadmitted) if c.name.startswith(GROUPED)]
    assert "b (g): ran, never admitted" in check.text


def test_a_job_sent_by_name_starts_at_once_counted_in_its_group() -> None:
    # Given a group of limit 1 and rate 1/s: b sent by name, started by its claim at 1.99 while
    # a (admitted) runs, c admitted at 6.1 once both ended. The claim's one statement sets
    # b's started_at, then its admitted_at (logged as the start), each read from the clock:
    # the row's started_at comes a few microseconds before (PostgreSQL's clock_timestamp())
    e = grouped({"a": 0.0, "b": 2.0, "c": 6.2}, rate=1.0, admitted={"a": -0.1, "c": 6.1})
    e = replace(e, jobs={**e.jobs, "b": replace(e.jobs["b"], started_at=1.99 - 4e-6)})
    admissions = [
        Admission("a", "g", -0.1, -0.1),
        Admission("b", "g", 1.99, kind=CLAIMED),
        Admission("c", "g", 6.1, 6.1),
    ]
    e = replace(e, admissions=admissions, by_name={"b"})

    # Its start by claim takes the group over its limit and no token: as documented
    assert failed_checks(e) == []
    assert e.figures["group_g_most_admitted"] == 2

    # But an admission while it runs, its group full, is caught
    full = [*admissions[:2], Admission("c", "g", 3.0, 3.0)]
    (check,) = [c for c in check_all(replace(e, admissions=full)) if not c.ok]
    assert check.name.startswith(GROUP_LIMIT)
    assert "g: 3 jobs admitted and live at 3.000 (limit 1)" in check.text

    # And a job a client recorded, started by its claim, is caught
    recorded = replace(e, by_name=set())
    assert failed_checks(recorded) == [GROUPED]
    (check,) = [c for c in check_all(recorded) if c.name.startswith(GROUPED)]
    assert "b (g): started by its claim, though a client recorded it" in check.text


def test_a_job_sent_by_name_that_the_broker_lost_before_any_claim_is_allowed_only_so() -> None:
    # Given a done, and b sent by name at 1.0 with no row at the end: no claim ever recorded it
    e = grouped({"a": 0.0, "b": 2.0})
    jobs = {"a": e.jobs["a"]}
    e = replace(
        e,
        jobs=jobs,
        table_rows=1,
        unit_rows=[r for r in e.unit_rows if r.job_id == "a"],
        checkpoints=[c for c in e.checkpoints if c.job_id == "a"],
        admissions=[a for a in e.admissions if a.job_id == "a"],
        by_name={"b"},
        by_name_sent={"b": 1.0},
    )
    e = consistent(e)

    # When the broker restarted, losing its queue, after b was sent: the broker lost it
    lost = replace(e, broker_restarts=[1.5])
    assert failed_checks(lost) == []
    assert lost.figures["lost_by_the_broker"] == 1

    # But with no broker restart after its send (one before it), it is a lost job
    for restarts in ([], [0.5]):
        failed = failed_checks(replace(e, broker_restarts=restarts))
        assert {EVERY_JOB, GROUPED, "jobs table rows match jobs submitted"} <= set(failed)
    # And so is a job a client recorded, whatever the broker did
    recorded = replace(e, by_name=set(), by_name_sent={}, broker_restarts=[1.5])
    assert EVERY_JOB in failed_checks(recorded)


def test_a_retry_of_a_rated_job_is_admitted_again_and_its_start_counted() -> None:
    # Given a (limit 1, rate 1/s) that asked for a retry after unit 1 (checkpoint at 2), back
    # in its group's queue at 2.1 with a countdown; b admitted meanwhile at 2.2 (token 2.2),
    # a admitted again at 6.4 once b ended (token 6.4), resuming at unit 2
    e = grouped({"a": 0.0, "b": 2.3}, rate=1.0, admitted={"a": -0.1, "b": 2.2})
    rows = [*run_of("a", 1, range(2), 0.0), *run_of("a", 2, range(2, UNITS), 6.5)]
    rows += [r for r in e.unit_rows if r.job_id == "b"]
    jobs = {**e.jobs, "a": replace(e.jobs["a"], attempts=2, token=2, finished_at=8.55)}
    checkpoints = [
        CheckpointRow("a", 1, json.dumps({"next": 1}), 1.0),
        CheckpointRow("a", 1, json.dumps({"next": 2, RETRY_MARK: True}), 2.0),
        *(CheckpointRow("a", 2, json.dumps({"next": n + 1}), 6.5 + n - 1) for n in (2, 3)),
        *(c for c in e.checkpoints if c.job_id == "b"),
    ]
    admissions = [
        Admission("a", "g", -0.1, -0.1),
        Admission("a", "g", 2.1, kind=RELEASED),
        Admission("b", "g", 2.2, 2.2),
        Admission("a", "g", 6.4, 6.4),
    ]
    e = consistent(
        replace(
            e,
            unit_rows=rows,
            jobs=jobs,
            checkpoints=checkpoints,
            admissions=admissions,
            group_retries={"a": 2},
        )
    )

    assert failed_checks(e) == []
    assert e.figures["grouped_retries_asked"] == e.figures["grouped_retries_readmitted"] == 1
    assert e.figures["group_g_readmissions"] == 1

    # Its retry's re-admission taking a token too soon after b's is caught
    soon = [*admissions[:3], Admission("a", "g", 6.4, 2.6)]
    assert failed_checks(replace(e, admissions=soon)) == [GROUP_RATE]

    # And a that never went back to its group's queue, admitted with b live, is caught
    kept = [a for a in admissions if a.kind != RELEASED]
    assert GROUP_LIMIT in failed_checks(replace(e, admissions=kept))


def test_a_refusal_by_another_attempt_or_an_ended_lease_counts_one_for_an_ended_job_not() -> None:
    """The worker log lines the check of two attempts at once reads (``LOST_TO_ANOTHER``): a
    revoke's terminate ends the job just before its signal stops the pool process, and a
    checkpoint between the two is refused for an ended job, not by another attempt."""
    from chaos.driver import LOST_TO_ANOTHER

    stamp = "[2026-12-06 05:32:04,890: WARNING/ForkPoolWorker-1] lease lost on job j-1 (token 7): "
    counted = [
        "another attempt holds it; checkpoint not saved",
        "its lease ended before this write (the job is now queued); checkpoint not saved",
        "its write was refused, and the job cannot be read now (down); checkpoint not saved",
    ]
    ended = "the job ended meanwhile (revoked: terminated in Celery (w@h)); checkpoint not saved"
    text = "\n".join(stamp + line for line in [*counted, ended])
    found = re.findall(LOST_TO_ANOTHER, text, re.MULTILINE)
    assert [(job, token) for *_, job, token in found] == [("j-1", "7")] * len(counted)
