"""The invariants of a chaos run, computed once every process is stopped from the jobs table,
the unit log, the checkpoint log, the state log (every change of a job's state or token), the
callback log, the result backend and what the driver did (its revokes and cancels, the jobs it
sent with ``expires``). Each check gives one line with its figures.

A *run* is one execution of a task body: the unit rows sharing a ``run`` value. Each run holds
one claim, so runs of a job are ordered by their token. A unit is *committed* when its row's
``ended_at`` is set. A job's *end* is the moment (``finished_at``, database clock, epoch
seconds) its row reached a finished state. A job is *controlled* when the driver revoked or
cancelled it or sent it with ``expires``: it may end ``revoked`` or ``cancelled`` (see
:func:`allowed_ends`); every other job must end ``done``.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.support.unit_log import Unit

EXACTLY_ONCE = "exactly_once"
AT_LEAST_ONCE = "at_least_once"

DONE, FAILED, CANCELLED, REVOKED = "done", "failed", "cancelled", "revoked"
FINISHED = (DONE, FAILED, CANCELLED, REVOKED, "replaced")
LIVE = ("queued", "running")
#: The Celery state the result backend must hold for a job that ended in each table state.
CELERY_STATE = {DONE: "SUCCESS", FAILED: "FAILURE", CANCELLED: "REVOKED", REVOKED: "REVOKED"}
#: Seconds after a job was marked done within which a SIGKILL of the process that marked it
#: leaves its result unstored and its callbacks unsent, as README "Guarantees" says ("A worker
#: killed between the moment its attempt marks the job done and the moment Celery stores the
#: result ... leaves the result unstored"): tolerated, and counted apart.
UNSTORED_WINDOW = 1.0


@dataclass(frozen=True)
class JobRow:
    id: str
    state: str
    attempts: int
    token: int
    result: Any
    checkpoint: Any
    error: str | None
    #: When the row reached a finished state (database clock, epoch seconds); None while live.
    finished_at: float | None = None


@dataclass(frozen=True)
class CheckpointRow:
    """One committed checkpoint write, in commit order (the trigger's serial id); ``at`` is
    when it was written (database clock, epoch seconds)."""

    job_id: str
    token: int
    checkpoint: str | None
    at: float = 0.0

    @property
    def next(self) -> int | None:
        state = json.loads(self.checkpoint) if self.checkpoint else None
        return state.get("next") if isinstance(state, dict) else None


@dataclass(frozen=True)
class StateRow:
    """One change of a job's state or token in the table (an insert, a claim, a hand-back, a
    re-publish, an end), in commit order per job; ``at`` is the database clock (epoch s)."""

    job_id: str
    token: int
    state: str
    at: float


@dataclass(frozen=True)
class Control:
    """A revoke or a cancel the driver sent to one job; ``at`` is the database clock (epoch
    seconds) once it was sent.

    ``detail``: for ``revoke``, the worker that answered it had terminated the job (None when
    no worker said so: the revoke only flagged the id in the live workers, or the replies were
    lost); for ``cancel``, ``queued`` or ``running``, the state the cancel met, or
    ``uncertain`` when the store call failed (its update may or may not have committed).
    """

    job_id: str
    kind: str
    at: float
    detail: str | None = None


@dataclass(frozen=True)
class Kill:
    """A SIGKILL the driver sent: when (epoch seconds) and to which pids (a pool process, or a
    worker's main process and its pool)."""

    at: float
    pids: tuple[int, ...]


@dataclass(frozen=True)
class Outcome:
    """What the result backend holds for a job: its Celery state and result (for a failure
    or a revoke, the exception's text)."""

    status: str
    result: Any


@dataclass(frozen=True)
class Callback:
    """One recorded callback call: ``link`` (with the job's result as JSON) or ``errback``."""

    job_id: str
    kind: str
    detail: str


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    text: str

    def line(self) -> str:
        return f"  [{'ok' if self.ok else 'FAILED'}] {self.name}: {self.text}"


@dataclass
class Evidence:
    """Everything the checks read. The logs that were not collected are None (their check
    then says so and passes)."""

    units: int
    #: job id -> mode, for every job submitted
    modes: dict[str, str]
    #: every row of the jobs table (the callback jobs too), by id
    jobs: dict[str, JobRow]
    #: rows of the jobs table of the submitted jobs' tasks (the callback jobs left out)
    table_rows: int
    unit_rows: list[Unit]
    checkpoints: list[CheckpointRow]
    #: the revokes and cancels the driver sent, in order
    controls: list[Control] = field(default_factory=list)
    #: the SIGKILLs the driver sent, in order
    kills: list[Kill] = field(default_factory=list)
    #: job id -> its ``expires`` (epoch seconds), for the jobs sent with one
    expires: dict[str, float] = field(default_factory=dict)
    #: seconds a claim may follow a job's ``expires``: a worker checks it when it takes the
    #: message, then the claim may wait that long (a frozen worker)
    expiry_slack: float = 2.0
    #: the state log, in commit order per job
    history: list[StateRow] | None = None
    #: job id -> what the result backend holds, for every submitted job
    backend: dict[str, Outcome] | None = None
    #: the callback log, and the ids of the callback jobs (``chaos.on_done``)
    callbacks: list[Callback] | None = None
    callback_jobs: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def check_all(e: Evidence) -> list[Check]:
    """Every invariant, in the order they are printed; figures also land in ``e.figures``."""
    rows_by_job: dict[str, list[Unit]] = {}
    for row in e.unit_rows:
        rows_by_job.setdefault(row.job_id, []).append(row)
    return [
        _every_job_done(e),
        _ends_final(e),
        _controls(e, rows_by_job),
        _result_backend(e),
        _callbacks(e),
        _nothing_after_end(e, rows_by_job),
        _exactly_once(e, rows_by_job),
        _at_least_once(e, rows_by_job),
        _fencing(e, rows_by_job),
        _checkpoints(e),
        _table_rows(e),
    ]


# -- what each job may end as ----------------------------------------------------------------


def controls_by_job(e: Evidence) -> dict[str, list[Control]]:
    found: dict[str, list[Control]] = {}
    for control in e.controls:
        found.setdefault(control.job_id, []).append(control)
    return found


def final_checkpoint_at(e: Evidence, job_id: str) -> float | None:
    """When the job's checkpoint after its last unit was first committed (epoch s), or None."""
    for row in e.checkpoints:
        if row.job_id == job_id and row.next == e.units:
            return row.at
    return None


def allowed_ends(e: Evidence, job_id: str, controls: list[Control]) -> set[str]:
    """The states the job may end in, as Celery and celery-leases decide:

    - no control: ``done``;
    - a revoke that terminated the running job: ``revoked``; a revoke no worker was running
      it for only flags the id in the live workers: ``revoked``, or ``done`` if its message
      then reached a worker started after the revoke (as Celery without ``--statedb``);
    - a cancel: ``cancelled``, or ``done`` when it met the job running after its last
      checkpoint (nothing was left to stop at) or when the cancel call failed;
    - ``expires``: ``revoked`` if a worker or the reaper saw it passed, else ``done``.
    """
    allowed: set[str] = set()
    for control in controls:
        if control.kind == "revoke":
            allowed |= {REVOKED} if control.detail else {REVOKED, DONE}
        elif control.kind == "cancel":
            allowed.add(CANCELLED)
            last = final_checkpoint_at(e, job_id)
            if control.detail == "uncertain" or (
                control.detail == "running" and last is not None and last <= control.at
            ):
                allowed.add(DONE)
    if job_id in e.expires:
        allowed |= {REVOKED} if controls else {REVOKED, DONE}
    return allowed or {DONE}


def killed_after_done(e: Evidence, job_id: str) -> Kill | None:
    """The SIGKILL of the pool process whose run finished the job (the run of its final
    token), sent at most ``UNSTORED_WINDOW`` seconds after the job was marked done; None if
    there was none."""
    job = e.jobs.get(job_id)
    if job is None or job.state != DONE or job.finished_at is None:
        return None
    final = [r for r in e.unit_rows if r.job_id == job_id and r.token == job.token]
    if not final:
        return None
    pid = final[-1].pid
    for kill in e.kills:
        if pid in kill.pids and 0.0 <= kill.at - job.finished_at <= UNSTORED_WINDOW:
            return kill
    return None


def _late_units(
    e: Evidence, job_id: str, rows: list[Unit]
) -> tuple[list[Unit], list[Unit], list[Unit]]:
    """The job's units (started, committed) after its end: (started after it, committed after
    it that were in flight at the end and may commit (at-least-once: the unit in progress of
    its run, whose write is not fenced), committed after it beyond those)."""
    job = e.jobs.get(job_id)
    if job is None or job.finished_at is None or job.state not in FINISHED:
        return [], [], []
    end = job.finished_at
    started = [r for r in rows if r.started_at > end]
    in_flight: list[Unit] = []
    beyond: list[Unit] = []
    for run in runs_by_token(rows):
        for r in run:
            if r.committed and (r.ended_at or 0) > end:
                allowed = (
                    e.modes.get(job_id) == AT_LEAST_ONCE and r is run[-1] and r.started_at <= end
                )
                (in_flight if allowed else beyond).append(r)
    return started, in_flight, beyond


def _every_job_done(e: Evidence) -> Check:
    """Every job without a control ended done with the full result; every controlled one
    ended as its control allows; none stuck (queued or running) or lost (no row)."""
    states = Counter(e.jobs[i].state if i in e.jobs else "lost" for i in e.modes)
    by_job = controls_by_job(e)
    wrong_result = [
        i
        for i in e.modes
        if i in e.jobs and e.jobs[i].state == DONE and e.jobs[i].result != e.units
    ]
    otherwise = [
        i
        for i in e.modes
        if i in e.jobs
        and e.jobs[i].state in FINISHED
        and e.jobs[i].state not in allowed_ends(e, i, by_job.get(i, []))
    ]
    stuck = states["queued"] + states["running"]
    done = states[DONE] - len(wrong_result)
    stopped = states[REVOKED] + states[CANCELLED]
    as_decided = stopped - sum(1 for i in otherwise if e.jobs[i].state in (REVOKED, CANCELLED))
    attempts = [e.jobs[i].attempts for i in e.modes if i in e.jobs]
    e.figures.update(
        jobs=len(e.modes),
        done=done,
        revoked=states[REVOKED],
        cancelled=states[CANCELLED],
        stuck=stuck,
        failed=states[FAILED],
        lost=states["lost"],
        ended_otherwise=len(otherwise),
        attempts=sum(attempts),
        max_attempts=max(attempts, default=0),
    )
    text = (
        f"{done}/{len(e.modes)} done, {as_decided} revoked or cancelled as decided "
        f"({states[REVOKED]} revoked, {states[CANCELLED]} cancelled); {stuck} stuck, "
        f"{states[FAILED]} failed, {states['lost']} lost, {len(otherwise)} ended otherwise "
        f"than allowed (failed included), {len(wrong_result)} with a wrong result; attempts "
        f"{sum(attempts)} (max {max(attempts, default=0)} for one job)"
    )
    bad = [
        i
        for i in e.modes
        if i not in e.jobs or i in otherwise or i in wrong_result or e.jobs[i].state in LIVE
    ]
    for job_id in bad[:3]:
        job = e.jobs.get(job_id)
        allowed = "/".join(sorted(allowed_ends(e, job_id, by_job.get(job_id, []))))
        if job is None:
            text += f"\n      {job_id}: no row (lost)"
        else:
            text += (
                f"\n      {job_id}: {job.state} (may end {allowed}), attempts {job.attempts}, "
                f"result {job.result!r}, error {job.error!r}"
            )
    ok = not bad and stuck == 0 and states["lost"] == 0
    return Check("every job done, or ended as its control decided", ok, text)


def _ends_final(e: Evidence) -> Check:
    """Once a job's row reached a finished state, it never changed state or token again (no
    reaper, redelivery, retry or restarted worker undid the end), and it is the row's state
    at the end of the run."""
    if e.history is None:
        return Check("ends are final", True, "no state log recorded")
    by_job: dict[str, list[StateRow]] = {}
    for row in e.history:
        by_job.setdefault(row.job_id, []).append(row)
    ended = undone = mismatched = 0
    examples: list[str] = []
    for job_id, rows in by_job.items():
        first = next((n for n, r in enumerate(rows) if r.state in FINISHED), None)
        if first is None:
            continue
        ended += 1
        end = rows[first]
        after = rows[first + 1 :]
        if after:
            undone += 1
            steps = " -> ".join(
                f"{r.state} (token {r.token}, +{r.at - end.at:.1f}s)" for r in after
            )
            examples.append(f"{job_id}: {end.state} (token {end.token}) -> {steps}")
        job = e.jobs.get(job_id)
        if job is not None and job.state != rows[-1].state:
            mismatched += 1
            examples.append(f"{job_id}: state log ends {rows[-1].state}, the row says {job.state}")
    e.figures.update(ends=ended, ends_undone=undone, ends_mismatched=mismatched)
    text = (
        f"{ended} jobs ended (callback jobs included), {undone} changed state or token after "
        f"their end, {mismatched} whose row disagrees with the state log; "
        f"{len(e.history)} state changes logged"
    )
    for example in examples[:3]:
        text += f"\n      {example}"
    return Check(
        "ends are final: no reaper, redelivery, retry or restart undid one",
        undone == 0 and mismatched == 0,
        text,
    )


def _controls(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """Revokes, cancels and expiry: each controlled job ended as its control allows (a revoke
    that terminated it: ``revoked``; a cancel: ``cancelled``; an expiry: ``revoked`` after its
    ``expires``, never before), is REVOKED in the result backend when it ended so, no claim
    of it came after its ``expires`` (beyond the slack), and nothing of it committed after
    its end but the unit in flight; no job ended revoked or cancelled without a control."""
    by_job = controls_by_job(e)
    problems: list[str] = []
    tally: Counter[str] = Counter()
    for control in e.controls:
        job = e.jobs.get(control.job_id)
        state = job.state if job is not None else "lost"
        if control.kind == "revoke":
            kind = "revoke_terminated" if control.detail else "revoke_flagged"
        else:
            kind = f"cancel_{control.detail}"
        tally[kind] += 1
        tally[f"{kind}_{state}"] += 1
    for job_id, expires in e.expires.items():
        job = e.jobs.get(job_id)
        state = job.state if job is not None else "lost"
        tally["expires"] += 1
        tally[f"expires_{state}"] += 1
        revoked_early = (
            state == REVOKED
            and job is not None
            and job_id not in by_job
            and job.finished_at is not None
            and job.finished_at < expires
        )
        if revoked_early and job is not None and job.finished_at is not None:
            problems.append(
                f"{job_id}: ended revoked {expires - job.finished_at:.1f} s before its "
                f"expires, with no revoke"
            )
        for row in e.history or []:
            if (
                row.job_id == job_id
                and row.state == "running"
                and row.at > expires + e.expiry_slack
            ):
                tally["claimed_after_expiry"] += 1
                problems.append(
                    f"{job_id}: claimed (token {row.token}) {row.at - expires:.1f} s after its "
                    f"expires passed"
                )
    for job_id in e.modes:
        job = e.jobs.get(job_id)
        if job is None:
            continue
        controlled = job_id in by_job or job_id in e.expires
        if job.state in (REVOKED, CANCELLED) and not controlled:
            problems.append(f"{job_id}: ended {job.state} with no revoke, cancel or expiry")
        if not controlled:
            continue
        allowed = allowed_ends(e, job_id, by_job.get(job_id, []))
        if job.state in FINISHED and job.state not in allowed:
            made = ", ".join(f"{c.kind} ({c.detail})" for c in by_job.get(job_id, []))
            if job_id in e.expires:
                made = ", ".join(filter(None, [made, "expires"]))
            problems.append(f"{job_id}: ended {job.state} after {made}; may end {allowed}")
        if job.state in (REVOKED, CANCELLED):
            tally["stopped"] += 1
            outcome = (e.backend or {}).get(job_id)
            if e.backend is not None and (outcome is None or outcome.status != "REVOKED"):
                problems.append(
                    f"{job_id}: {job.state} in the table, "
                    f"{outcome.status if outcome else 'nothing'} in the result backend"
                )
            else:
                tally["stopped_revoked_in_backend"] += 1
            _, in_flight, beyond = _late_units(e, job_id, rows_by_job.get(job_id, []))
            tally["late_in_flight"] += len(in_flight)
            tally["late_beyond"] += len(beyond)
            if beyond:
                late = (beyond[0].ended_at or 0.0) - (job.finished_at or 0.0)
                problems.append(
                    f"{job_id}: {job.state}, then units {[r.unit for r in beyond]} committed "
                    f"(token {beyond[0].token}, the first +{late:.2f}s after the end)"
                )
    e.figures.update({f"controls_{k}": v for k, v in sorted(tally.items())})
    t = tally
    backend = (
        ""
        if e.backend is None
        else (f"; REVOKED in the backend {t['stopped_revoked_in_backend']}/{t['stopped']}")
    )
    text = (
        f"revoke(terminate=True): {t['revoke_terminated']} terminated a running job -> "
        f"{t['revoke_terminated_revoked']} revoked; {t['revoke_flagged']} no worker said it "
        f"terminated (between attempts, or no reply) -> {t['revoke_flagged_revoked']} revoked, "
        f"{t['revoke_flagged_done']} done (a worker that never saw the revoke ran it); cancel: "
        f"{t['cancel_queued']} queued -> {t['cancel_queued_cancelled']} cancelled, "
        f"{t['cancel_running']} running -> {t['cancel_running_cancelled']} cancelled, "
        f"{t['cancel_running_done']} done after their last checkpoint"
        + (f", {t['cancel_uncertain']} whose call failed" if t["cancel_uncertain"] else "")
        + f"; expires: {t['expires']} jobs -> {t['expires_revoked']} "
        f"revoked, {t['expires_done']} done, {t['expires_cancelled']} cancelled (a cancel "
        f"too), {t['claimed_after_expiry']} claimed over "
        f"{e.expiry_slack:g} s after it passed{backend}; after their end "
        f"{t['late_in_flight']} units in flight committed (at-least-once, allowed), "
        f"{t['late_beyond']} beyond"
    )
    for problem in problems[:4]:
        text += f"\n      {problem}"
    return Check(
        "controls: revoked, cancelled and expired jobs end so for good, REVOKED, nothing after",
        not problems,
        text,
    )


def _result_backend(e: Evidence) -> Check:
    """Every finished job's Celery state agrees with its row: done -> SUCCESS with the same
    result, failed -> FAILURE, revoked or cancelled -> REVOKED. A done job with nothing stored
    whose process was SIGKILLed right after marking it done is counted apart (tolerated)."""
    if e.backend is None:
        return Check("result backend agrees", True, "no result backend configured")
    agree: Counter[str] = Counter()
    total: Counter[str] = Counter()
    examples: list[str] = []
    unstored: list[str] = []
    for job_id in e.modes:
        job = e.jobs.get(job_id)
        if job is None or job.state not in CELERY_STATE:
            continue
        want = CELERY_STATE[job.state]
        total[want] += 1
        got = e.backend.get(job_id)
        same = got is not None and got.status == want
        if same and want == "SUCCESS":
            same = got is not None and got.result == job.result
        nothing = got is None or got.status == "PENDING"
        if same:
            agree[want] += 1
        elif want == "SUCCESS" and nothing and killed_after_done(e, job_id):
            unstored.append(job_id)
        else:
            seen = "nothing" if got is None else f"{got.status} {_short(got.result)}"
            examples.append(f"{job_id}: table {job.state} (result {job.result!r}), backend {seen}")
    bad = sum(total.values()) - sum(agree.values()) - len(unstored)
    e.figures.update(
        backend_disagree=bad, backend_checked=sum(total.values()), backend_unstored=len(unstored)
    )
    text = (
        f"SUCCESS with the same result {agree['SUCCESS']}/{total['SUCCESS']} done, FAILURE "
        f"{agree['FAILURE']}/{total['FAILURE']} failed, REVOKED {agree['REVOKED']}/"
        f"{total['REVOKED']} revoked or cancelled; {bad} disagree; {len(unstored)} done with "
        f"nothing stored, their process SIGKILLed <= {UNSTORED_WINDOW:g} s after it marked "
        f"them done (the window README 'Guarantees' leaves open; tolerated)"
        + (f": {', '.join(unstored[:3])}" if unstored else "")
    )
    for example in examples[:3]:
        text += f"\n      {example}"
    return Check("result backend agrees with the table", bad == 0, text)


def _callbacks(e: Evidence) -> Check:
    """Callbacks agree with the table: a done job's ``link`` ran exactly once, with its
    result, and no errback; a failed job's errback ran exactly once and no ``link``; a
    revoked or cancelled job had neither. Every callback job ended done. A done job with no
    call whose process was SIGKILLed right after marking it done is counted apart."""
    if e.callbacks is None:
        return Check("callbacks agree", True, "no callback log recorded")
    links: dict[str, list[Callback]] = {}
    errbacks: Counter[str] = Counter()
    for call in e.callbacks:
        if call.kind == "link":
            links.setdefault(call.job_id, []).append(call)
        else:
            errbacks[call.job_id] += 1
    once = wrong = unsent = 0
    examples: list[str] = []
    done_jobs = failed_jobs = failed_once = 0
    for job_id in e.modes:
        job = e.jobs.get(job_id)
        if job is None or job.state not in FINISHED:
            continue
        calls = links.get(job_id, [])
        want_links = 1 if job.state == DONE else 0
        want_errbacks = 1 if job.state == FAILED else 0
        done_jobs += job.state == DONE
        failed_jobs += job.state == FAILED
        good_links = len(calls) == want_links and all(
            json.loads(c.detail) == job.result for c in calls
        )
        if good_links and errbacks[job_id] == want_errbacks:
            once += job.state == DONE
            failed_once += job.state == FAILED
        elif not calls and not errbacks[job_id] and killed_after_done(e, job_id):
            unsent += 1
        else:
            wrong += 1
            examples.append(
                f"{job_id}: {job.state}, link called {len(calls)} time(s) "
                f"{[c.detail for c in calls]}, errback {errbacks[job_id]} time(s)"
            )
    callback_states = Counter(e.jobs[i].state if i in e.jobs else "lost" for i in e.callback_jobs)
    not_done = len(e.callback_jobs) - callback_states[DONE]
    if not_done:
        examples.append(f"callback jobs not done: {dict(callback_states)}")
    e.figures.update(
        callbacks_wrong=wrong, callbacks_unsent=unsent, callback_jobs=len(e.callback_jobs)
    )
    text = (
        f"link once with the result for {once}/{done_jobs} done jobs, errback once for "
        f"{failed_once}/{failed_jobs} failed ones, {wrong} jobs whose callbacks disagree; "
        f"{unsent} done jobs whose link was never sent, their process SIGKILLed <= "
        f"{UNSTORED_WINDOW:g} s after it marked them done (tolerated, as for the result "
        f"backend); callback jobs {callback_states[DONE]}/{len(e.callback_jobs)} done"
    )
    for example in examples[:3]:
        text += f"\n      {example}"
    return Check("callbacks agree with the table", wrong == 0 and not_done == 0, text)


def _nothing_after_end(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """No unit of a job started after its end, and none committed after it but the unit in
    flight of an at-least-once run (its write is not fenced)."""
    started = in_flight = beyond = 0
    examples: list[str] = []
    for job_id in e.modes:
        late_start, late_flight, late_beyond = _late_units(e, job_id, rows_by_job.get(job_id, []))
        started += len(late_start)
        in_flight += len(late_flight)
        beyond += len(late_beyond)
        job = e.jobs.get(job_id)
        for row in [*late_start, *late_beyond][:1]:
            end = job.finished_at if job is not None and job.finished_at is not None else 0.0
            examples.append(
                f"{job_id}: {job.state if job else '?'} at {end:.3f}; unit {row.unit} (token "
                f"{row.token}) started +{row.started_at - end:.2f}s"
                + ("" if row.ended_at is None else f", committed +{row.ended_at - end:.2f}s")
            )
    e.figures.update(after_end_started=started, after_end_in_flight=in_flight, after_end=beyond)
    text = (
        f"{started} units started after their job ended, {beyond} committed after it beyond "
        f"the unit in flight, {in_flight} in-flight at-least-once units committed after it "
        f"(allowed)"
    )
    for example in examples[:3]:
        text += f"\n      {example}"
    return Check(
        "nothing ran after an end: no unit started or committed after its job ended",
        started == 0 and beyond == 0,
        text,
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _committed_counts(rows: Iterable[Unit]) -> Counter[int]:
    return Counter(r.unit for r in rows if r.committed)


def _done(e: Evidence, job_id: str) -> bool:
    return job_id in e.jobs and e.jobs[job_id].state == DONE


def _exactly_once(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """Every unit of a done job committed exactly once; no unit of any job (a stopped one
    included) committed twice."""
    ids = [i for i, mode in e.modes.items() if mode == EXACTLY_ONCE]
    done = [i for i in ids if _done(e, i)]
    once = missing = duplicated = 0
    for job_id in ids:
        counts = _committed_counts(rows_by_job.get(job_id, []))
        for unit in range(e.units):
            n = counts.get(unit, 0)
            if job_id in done:
                once += int(n == 1)
                missing += int(n == 0)
            duplicated += max(n - 1, 0)
        duplicated += sum(n for unit, n in counts.items() if not 0 <= unit < e.units)
    expected = len(done) * e.units
    e.figures.update(eo_units=expected, eo_once=once, eo_missing=missing, eo_duplicated=duplicated)
    return Check(
        "exactly-once: every unit recorded exactly once",
        missing == 0 and duplicated == 0 and once == expected,
        f"{once}/{expected} units of {len(done)} done jobs (missing {missing}); duplicated "
        f"{duplicated} in all {len(ids)} jobs (the {len(ids) - len(done)} not done included)",
    )


def runs_by_token(rows: list[Unit]) -> list[list[Unit]]:
    """The runs of one job's unit rows, oldest claim first, each in start order."""
    runs: dict[str, list[Unit]] = {}
    for row in sorted(rows, key=lambda r: (r.started_at, r.unit)):
        runs.setdefault(row.run, []).append(row)
    return sorted(runs.values(), key=lambda run: (run[0].token or 0, run[0].started_at))


def _at_least_once(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """Every unit of a done job committed; at most one unit redone per interruption in any
    job (a stopped one included)."""
    ids = [i for i, mode in e.modes.items() if mode == AT_LEAST_ONCE]
    done = [i for i in ids if _done(e, i)]
    recorded = missing = redone_total = redone_max = 0
    interruptions = sum(max(e.jobs[i].attempts - 1, 0) for i in ids if i in e.jobs)
    for job_id in ids:
        rows = rows_by_job.get(job_id, [])
        counts = _committed_counts(rows)
        if job_id in done:
            recorded += sum(1 for unit in range(e.units) if counts.get(unit))
            missing += sum(1 for unit in range(e.units) if not counts.get(unit))
        seen: set[int] = set()
        for run in runs_by_token(rows):
            committed = {r.unit for r in run if r.committed}
            redone = len(committed & seen)
            redone_total += redone
            redone_max = max(redone_max, redone)
            seen |= committed
    expected = len(done) * e.units
    e.figures.update(
        alo_units=expected,
        alo_recorded=recorded,
        alo_missing=missing,
        alo_redone_total=redone_total,
        alo_redone_max=redone_max,
        alo_interruptions=interruptions,
    )
    return Check(
        "at-least-once: every unit recorded, at most 1 redone per interruption",
        missing == 0 and redone_max <= 1 and recorded == expected,
        f"{recorded}/{expected} units of {len(done)} done jobs recorded (missing {missing}); "
        f"redone per interruption in all {len(ids)} jobs: max {redone_max}, total "
        f"{redone_total} over {interruptions} interruptions (attempts after the first)",
    )


def _fencing(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """A superseded attempt commits nothing after a newer attempt of its job started (in
    at-least-once mode, only the unit it had in flight, whose write is not fenced), and no two
    attempts' committed units overlap in time."""
    late_eo = late_alo = beyond_alo = overlaps = 0
    examples: list[str] = []
    for job_id, rows in rows_by_job.items():
        mode = e.modes.get(job_id)
        runs = runs_by_token(rows)
        for index, run in enumerate(runs):
            later = [r[0].started_at for r in runs[index + 1 :]]
            if not later:
                continue
            superseded_at = min(later)
            late = [r for r in run if r.committed and (r.ended_at or 0) > superseded_at]
            if mode == AT_LEAST_ONCE:
                allowed = [r for r in late if r is run[-1]]
                late_alo += len(allowed)
                beyond_alo += len(late) - len(allowed)
            else:
                late_eo += len(late)
            if late and (mode != AT_LEAST_ONCE or len(late) > 1 or late[0] is not run[-1]):
                examples.append(f"{job_id} token {run[0].token}: units {[r.unit for r in late]}")
        fenced = [
            r for run in runs for r in run if r.committed and not _allowed_late(r, run, runs, mode)
        ]
        fenced.sort(key=lambda r: r.started_at)
        for a, b in itertools.pairwise(fenced):
            if a.run != b.run and (a.ended_at or 0) > b.started_at:
                overlaps += 1
                examples.append(
                    f"{job_id}: unit {a.unit} (token {a.token}) overlaps unit "
                    f"{b.unit} (token {b.token})"
                )
    e.figures.update(
        fencing_late_eo=late_eo,
        fencing_late_alo=late_alo,
        fencing_beyond_alo=beyond_alo,
        fencing_overlaps=overlaps,
    )
    text = (
        f"exactly-once: {late_eo} units committed by a superseded attempt; overlapping committed "
        f"units of two attempts: {overlaps}; at-least-once: {late_alo} in-flight units finished "
        f"by a superseded attempt (unfenced write, allowed), {beyond_alo} beyond those"
    )
    for example in examples[:3]:
        text += f"\n      {example}"
    return Check(
        "fencing: no two attempts' committed units overlap",
        late_eo == 0 and beyond_alo == 0 and overlaps == 0,
        text,
    )


def _allowed_late(row: Unit, run: list[Unit], runs: list[list[Unit]], mode: str | None) -> bool:
    """The in-flight unit of a superseded at-least-once attempt (checked separately)."""
    if mode != AT_LEAST_ONCE or row is not run[-1] or run is runs[-1]:
        return False
    later = [r[0].started_at for r in runs[runs.index(run) + 1 :]]
    return (row.ended_at or 0) > min(later)


def _checkpoints(e: Evidence) -> Check:
    by_job: dict[str, list[CheckpointRow]] = {}
    for row in e.checkpoints:
        if row.job_id in e.modes:  # not the callback jobs'
            by_job.setdefault(row.job_id, []).append(row)
    backwards = stale_token = repeated = 0
    examples: list[str] = []
    for job_id, rows in by_job.items():
        for a, b in itertools.pairwise(rows):
            if (b.next or 0) < (a.next or 0):
                backwards += 1
                examples.append(
                    f"{job_id}: next {a.next} (token {a.token}) -> {b.next} (token {b.token})"
                )
            elif b.next == a.next:
                repeated += 1
            if b.token < a.token:
                stale_token += 1
                examples.append(f"{job_id}: token {b.token} saved after token {a.token}")
    done = [i for i in e.modes if _done(e, i)]
    final_ok = sum(
        1
        for i in done
        if by_job.get(i)
        and by_job[i][-1].next == e.units
        and e.jobs[i].checkpoint == {"next": e.units}
    )
    saved = sum(len(rows) for rows in by_job.values())
    e.figures.update(
        checkpoints=saved,
        checkpoints_backwards=backwards,
        checkpoints_stale_token=stale_token,
        checkpoints_repeated=repeated,
    )
    text = (
        f"{saved} checkpoints committed, {backwards} moved backwards, {stale_token} "
        f"by a superseded token after a newer one, {repeated} repeated (same value saved again); "
        f"{final_ok}/{len(done)} done jobs end at next={e.units}"
    )
    for example in examples[:3]:
        text += f"\n      {example}"
    return Check(
        "no checkpoint ever moved backwards",
        backwards == 0 and stale_token == 0 and final_ok == len(done),
        text,
    )


def _table_rows(e: Evidence) -> Check:
    e.figures.update(table_rows=e.table_rows)
    return Check(
        "jobs table rows match jobs submitted",
        e.table_rows == len(e.modes),
        f"{e.table_rows} rows of the chaos tasks, {len(e.modes)} jobs submitted "
        f"(and {len(e.callback_jobs)} callback jobs)",
    )
