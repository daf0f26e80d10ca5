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

A *keyed* job has a lease key (its row's ``lease_key``): the driver's *triggers* (calls of the
keyed task, as a webhook receiver makes them, recorded by the client with the database clock
read just before each call) create keyed jobs, or, while a job holds the key, wait on the key
(``keys.pending_id``: every waiting trigger's call is answered with the first one's id). When
the job holding the key ends, the waiting triggers are *served* by a run of the key that
started after the latest of them (recorded as a row of their own, ``served_by`` naming that
run, no attempt of its own), or a *follow-up* run is started for them under their id. A keyed
row is thus a *run* (it was claimed and ran) or a *served* row. A key's *cursor* is written in
the transaction of each unit its jobs commit (the cursor log holds every committed write, in
commit order).

A run's *start* is its first claim (the row's ``started_at``, which is also what the library
compares with a trigger's time), checked against the unit log (its first unit started after).
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
#: A job of a newest-wins key that gave way to a newer trigger (REVOKED in Celery).
SUPERSEDED = "superseded"
FINISHED = (DONE, FAILED, CANCELLED, REVOKED, "replaced", SUPERSEDED)
LIVE = ("queued", "running")
#: The Celery state the result backend must hold for a job that ended in each table state.
CELERY_STATE = {
    DONE: "SUCCESS",
    FAILED: "FAILURE",
    CANCELLED: "REVOKED",
    REVOKED: "REVOKED",
    SUPERSEDED: "REVOKED",
}
#: Seconds a debounced run's claim (database clock) may precede its due time computed from
#: the trigger log's readings (database clock too, read just before each call).
DEBOUNCE_ALLOWANCE = 0.1
#: Seconds after a job was marked done within which a SIGKILL of the process that marked it
#: leaves its result unstored and its callbacks unsent, as the docs' guarantees page says ("A worker
#: killed between the moment its attempt marks the job done and the moment Celery stores the
#: result ... leaves the result unstored"): tolerated, and counted apart. The time a process
#: was stopped (a freeze) does not count (``unstored_within``).
UNSTORED_WINDOW = 1.0
#: Seconds after a revoke that terminated a job's attempt (SIGTERM to its pool process, the
#: job ended ``revoked`` at once in the worker's main process) in which that attempt may still
#: start a unit, never committed: its own unfenced write of the unit's start, before the
#: signal ends the process.
TERMINATING_WINDOW = 1.0


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
    #: The lease key of a keyed job, else None.
    key: str | None = None
    #: When its first attempt claimed it (database clock); None if none ever did.
    started_at: float | None = None
    #: The run that served this row's triggers (a served row), else None.
    served_by: str | None = None
    #: Its recorded message carries ``expires``.
    expires: bool = False


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
class Trigger:
    """One call of the keyed task, as the client recorded it: the key, the task id the call
    gave, the id of the job ``apply_async`` returned (the call's own job, or the job of the key
    that serves it; None when the call raised: not a trigger the library took), and ``at``,
    the database clock (epoch seconds) read just before the call."""

    key: str
    id: str
    served: str | None
    at: float
    #: The database clock once the call returned (None: not recorded).
    answered: float | None = None


@dataclass(frozen=True)
class CursorRow:
    """One committed write of a key's cursor, in commit order: the job and token of the
    attempt that wrote it, the cursor (JSON text) and when (database clock, epoch seconds)."""

    key: str
    job_id: str
    token: int
    cursor: str | None
    at: float = 0.0

    @property
    def units(self) -> int | None:
        state = json.loads(self.cursor) if self.cursor else None
        return state.get("units") if isinstance(state, dict) else None


#: The kinds of the admission log's rows (``Admission.kind``): an admission; a start no
#: admission let in (a message sent by name: its claim created the job running, counted in its
#: group, no token taken); a return of an admitted job to its group's queue (a retry, a
#: hand-back, an expired lease), after which its next start waits for a new admission.
ADMITTED, CLAIMED, RELEASED = "admitted", "claimed", "released"
#: The key of the checkpoint a job saves with the unit after which it asks for a retry.
RETRY_MARK = "retry"


@dataclass(frozen=True)
class Admission:
    """One row of the admission log, in commit order: for an admission (``ADMITTED``) ``at`` is
    its ``admitted_at`` and ``due`` the ``run_after`` it wrote, its token's time; for a start by
    a claim (``CLAIMED``) ``at`` is the claim's time and ``due`` None; for a return to the
    group's queue (``RELEASED``) ``at`` is when it happened (database clock, epoch seconds)."""

    job_id: str
    group: str
    at: float
    due: float | None = None
    kind: str = ADMITTED


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
class Pause:
    """Processes the driver stopped (SIGSTOP: a freeze, or a worker that froze itself inside a
    transaction) from ``start`` to ``end`` (epoch seconds)."""

    pids: tuple[int, ...]
    start: float
    end: float


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
    #: the triggers of the keyed jobs, in the order they were sent (None: no keyed jobs)
    triggers: list[Trigger] | None = None
    #: units of a keyed job
    key_units: int = 0
    #: the keys whose triggers are debounced, with ``debounce`` (quiet, max_wait) in seconds,
    #: and the keys whose newest trigger wins; their runs' checkpoints carry ``marker``, the id
    #: of the trigger whose arguments they ran with
    debounced_keys: set[str] = field(default_factory=set)
    newest_keys: set[str] = field(default_factory=set)
    debounce: tuple[float, float] = (0.0, 0.0)
    #: job id -> its group, for the jobs sent in a job group (``--grouped-jobs``); each
    #: group's limit (None: none) and rate (admissions a second, None: none); the admission
    #: log (None: not recorded)
    groups: dict[str, str] = field(default_factory=dict)
    group_limits: dict[str, int | None] = field(default_factory=dict)
    group_rates: dict[str, float | None] = field(default_factory=dict)
    admissions: list[Admission] | None = None
    #: the grouped jobs sent by name (``send_task``: no client recorded them), and job id ->
    #: the unit after which it asks for a retry once (its checkpoint of that unit carries
    #: ``RETRY_MARK``), for the grouped jobs sent so
    by_name: set[str] = field(default_factory=set)
    group_retries: dict[str, int] = field(default_factory=dict)
    #: when each job sent by name was sent, and when the broker restarted losing its queue
    #: (epoch seconds): a message sent by name that the broker lost before any claim leaves
    #: no row (:func:`lost_by_the_broker`)
    by_name_sent: dict[str, float] = field(default_factory=dict)
    broker_restarts: list[float] = field(default_factory=list)
    #: the cursor of each key at the end (key -> JSON value), and the cursor log
    cursors: dict[str, Any] = field(default_factory=dict)
    cursor_log: list[CursorRow] = field(default_factory=list)
    #: the revokes and cancels the driver sent to keyed jobs or to the id triggers wait under
    key_controls: list[Control] = field(default_factory=list)
    #: trigger id -> its ``expires`` (epoch seconds), for the triggers sent with one
    key_expires: dict[str, float] = field(default_factory=dict)
    #: key -> the id of the triggers still waiting on it at the end
    pending: dict[str, str] = field(default_factory=dict)
    #: keyed row id -> what the result backend holds (every trigger's result id)
    key_backend: dict[str, Outcome] | None = None
    #: job id -> its soft time limit (seconds), for the jobs sent with one
    soft_limited: dict[str, float] = field(default_factory=dict)
    #: counts read from the worker logs (``LOG_COUNTS`` in the driver): where soft limits
    #: landed, conflicts run again
    log_counts: dict[str, int] = field(default_factory=dict)
    #: worker log lines that break an invariant, by kind: ``reuse`` (a connection used again
    #: after a statement on it was interrupted), ``conflict_as_outage`` (a serialization
    #: failure reported as the database being unavailable)
    log_errors: dict[str, list[str]] = field(default_factory=dict)
    #: the calls of the clients the driver killed: call id -> whether the call returned
    #: (None: no client killed)
    client_calls: dict[str, bool] | None = None
    #: processes the driver stopped, and when PostgreSQL restarted (epoch seconds)
    pauses: list[Pause] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    #: jobs whose worker logged that renewals failed until their lease expired
    lost_renewals: set[str] = field(default_factory=set)
    #: (job, token, when: epoch seconds) of each attempt that found at its checkpoint that
    #: another attempt held its job (its worker's log): it ran while that one did
    lost_to_another: list[tuple[str, int, float]] = field(default_factory=list)
    lease_seconds: float = 3.0
    #: one lock for the whole database (SQLite): a stopped writer blocks every process
    global_lock: bool = False
    #: seconds a job may stay claimed after its attempt's last unit when that attempt died or
    #: gave up: the lease, a reaper pass (which may wait behind a whole job in the queue) and
    #: a margin; None: not checked
    hold_slack: float | None = None
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
        _one_attempt_at_a_time(e, rows_by_job),
        _no_lease_outlives_its_attempt(e, rows_by_job),
        _interrupts(e),
        _dying_clients(e),
        _keyed_jobs(e, rows_by_job),
        _one_run_per_key(e, rows_by_job),
        _triggers_followed(e, rows_by_job),
        _no_trigger_lost(e),
        _keyed_controls(e),
        _cursors(e, rows_by_job),
        _debounce(e, rows_by_job),
        _newest(e, rows_by_job),
        _group_limit(e, rows_by_job),
        _group_rate(e),
        _grouped_jobs(e),
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
    token), sent at most ``UNSTORED_WINDOW`` seconds after the job was marked done, not
    counting the time any process was stopped meanwhile (``unstored_within``); None if there
    was none."""
    job = e.jobs.get(job_id)
    if job is None or job.state != DONE or job.finished_at is None:
        return None
    final = [r for r in e.unit_rows if r.job_id == job_id and r.token == job.token]
    if not final:
        return None
    pid = final[-1].pid
    for kill in e.kills:
        if pid in kill.pids and unstored_within(e, job.finished_at, kill.at):
            return kill
    return None


def unstored_within(e: Evidence, done_at: float, killed_at: float) -> bool:
    """Whether a SIGKILL at ``killed_at`` of the process that marked a job done at ``done_at``
    came within ``UNSTORED_WINDOW`` of it, not counting the time any process was stopped
    meanwhile (a freeze): a process stopped inside a write of the result backend (one SQLite
    file, shared by every worker) holds its lock, and every other store of a result waits
    for it, so the window lasts as long as the freeze."""
    if killed_at < done_at:
        return False
    stopped, until = 0.0, done_at
    for pause in sorted(e.pauses, key=lambda p: p.start):
        start, end = max(pause.start, until), min(pause.end, killed_at)
        if end > start:
            stopped += end - start
            until = end
    return killed_at - done_at - stopped <= UNSTORED_WINDOW


def killed_after_served(e: Evidence, job_id: str) -> Kill | None:
    """For a served row (the triggers a run of their key served, recorded done with that
    run's result and a notice for the result backend): the SIGKILL, sent at most
    ``UNSTORED_WINDOW`` seconds after the row was recorded, of a process that may have taken
    its notice and died before storing it (``take_notices`` hands a notice to one caller):
    the serving run's own, whose worker settles the key's triggers as the run ends and tells
    the backend at once, or, for a row recorded longer than that after the run ended (a
    reaper pass settled them, in whichever pool process ran it), any. None if there was none.
    """
    job = e.jobs.get(job_id)
    run = e.jobs.get(job.served_by or "") if job is not None else None
    if job is None or job.finished_at is None or run is None:
        return None
    at = job.finished_at
    if run.finished_at is not None and at - run.finished_at <= UNSTORED_WINDOW:
        final = [r for r in e.unit_rows if r.job_id == run.id and r.token == run.token]
        pids: set[int] | None = {final[-1].pid} if final else None
    else:
        pids = None
    for kill in e.kills:
        if unstored_within(e, at, kill.at) and (pids is None or pids & set(kill.pids)):
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
    started = [
        r for r in rows if r.started_at > end and not _terminating(e, job_id, job.state, r, end)
    ]
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


def _terminating(e: Evidence, job_id: str, state: str, row: Unit, end: float) -> bool:
    """``row`` was started by the attempt a revoke was terminating, in the moments before the
    signal ended its process: the job ended ``revoked`` by that revoke, the unit never
    committed, started within ``TERMINATING_WINDOW`` of the end."""
    terminated = any(
        c.kind == "revoke" and c.detail is not None for c in controls_by_job(e).get(job_id, [])
    )
    return (
        terminated
        and state == REVOKED
        and not row.committed
        and row.started_at - end <= TERMINATING_WINDOW
    )


def lost_by_the_broker(e: Evidence, job_id: str) -> bool:
    """Whether job ``job_id`` has no row because the broker lost its message: it was sent by
    name, so nothing recorded it before its first claim (docs/guarantees.md, "Register"), and
    the broker restarted, losing its queue, after it was sent. The library never saw that job;
    plain Celery loses such a message the same way (``apply_async`` is what the reaper covers)."""
    if job_id in e.jobs or job_id not in e.by_name:
        return False
    sent = e.by_name_sent.get(job_id)
    return sent is not None and any(restart >= sent for restart in e.broker_restarts)


def _every_job_done(e: Evidence) -> Check:
    """Every job without a control ended done with the full result; every controlled one
    ended as its control allows; none stuck (queued or running) or lost (no row), but a job
    sent by name whose message the broker lost before any claim (:func:`lost_by_the_broker`,
    counted apart)."""
    broker_lost = [i for i in e.modes if lost_by_the_broker(e, i)]
    states = Counter(
        e.jobs[i].state if i in e.jobs else "lost" for i in e.modes if i not in broker_lost
    )
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
        lost_by_the_broker=len(broker_lost),
        ended_otherwise=len(otherwise),
        attempts=sum(attempts),
        max_attempts=max(attempts, default=0),
    )
    text = (
        f"{done}/{len(e.modes)} done, {as_decided} revoked or cancelled as decided "
        f"({states[REVOKED]} revoked, {states[CANCELLED]} cancelled); {stuck} stuck, "
        f"{states[FAILED]} failed, {states['lost']} lost, {len(otherwise)} ended otherwise "
        f"than allowed (failed included), {len(wrong_result)} with a wrong result; attempts "
        f"{sum(attempts)} (max {max(attempts, default=0)} for one job); sent by name and lost "
        f"by the broker before any claim (a restart that lost its queue; allowed) "
        f"{len(broker_lost)}"
    )
    bad = [
        i
        for i in e.modes
        if (i not in e.jobs and i not in broker_lost)
        or i in otherwise
        or i in wrong_result
        or (i in e.jobs and e.jobs[i].state in LIVE)
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
        f"nothing stored, their process SIGKILLed <= {UNSTORED_WINDOW:g} s (freezes not "
        f"counted) after it marked them done (the window the docs' guarantees page leaves "
        f"open; tolerated)" + (f": {', '.join(unstored[:3])}" if unstored else "")
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
        f"{UNSTORED_WINDOW:g} s (freezes not counted) after it marked them done (tolerated, "
        f"as for the result "
        f"backend); callback jobs {callback_states[DONE]}/{len(e.callback_jobs)} done"
    )
    for example in examples[:3]:
        text += f"\n      {example}"
    return Check("callbacks agree with the table", wrong == 0 and not_done == 0, text)


def _nothing_after_end(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """No unit of a job started after its end, and none committed after it but the unit in
    flight of an at-least-once run (its write is not fenced). A unit the attempt a revoke was
    terminating started, uncommitted, in the moment before the signal ended its process is
    not counted (``_terminating``): the end is recorded when the signal is sent."""
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
    broker_lost = [i for i in e.modes if lost_by_the_broker(e, i)]
    return Check(
        "jobs table rows match jobs submitted",
        e.table_rows == len(e.modes) - len(broker_lost),
        f"{e.table_rows} rows of the chaos tasks, {len(e.modes)} jobs submitted "
        f"(and {len(e.callback_jobs)} callback jobs), {len(broker_lost)} of them sent by name "
        f"and lost by the broker before any claim",
    )


# -- attempts, interrupts, dying clients ---------------------------------------------------------

#: Seconds around a PostgreSQL restart within which a lease may be lost to it.
RESTART_MARGIN = 10.0


def claims_by_job(e: Evidence) -> dict[str, list[tuple[int, float]]]:
    """Each job's claims from the state log: (token, when), the first time each token ran."""
    found: dict[str, dict[int, float]] = {}
    for row in e.history or []:
        if row.state == "running":
            found.setdefault(row.job_id, {}).setdefault(row.token, row.at)
    return {job: sorted(tokens.items()) for job, tokens in found.items()}


def superseded_excuse(e: Evidence, job_id: str, pid: int | None, at: float) -> str | None:
    """Why an attempt of ``job_id`` in process ``pid`` could still run at ``at``, after a newer
    attempt claimed the job, without the library taking a live lease: its process was stopped
    not long before (its lease expired meanwhile); a stopped process held the whole
    database's lock (SQLite: every renewal waited); PostgreSQL restarted; its own worker logged
    that renewals failed until the lease expired. None: no excuse."""
    window = e.hold_slack or 2 * e.lease_seconds + 10.0
    for pause in e.pauses:
        recent = pause.start <= at and pause.end >= at - window
        if recent and (e.global_lock or pid is None or pid in pause.pids):
            return (
                "its process was stopped"
                if pid is not None and pid in pause.pids
                else "a stopped process held the database's lock"
            )
    if any(at - 2 * e.lease_seconds - RESTART_MARGIN <= r <= at for r in e.restarts):
        return "the database restarted"
    if job_id in e.lost_renewals:
        return "its renewals failed until its lease expired"
    return None


def _one_attempt_at_a_time(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """No attempt of a job ran while a newer attempt held it, unless the older one's lease
    was taken for a reason outside the library (:func:`superseded_excuse`): no unit of the
    older run started after the newer claim (the state log), and no attempt found at its
    checkpoint that another held its job (its worker's log) while its process ran unstopped.
    A reaper that takes a live holder for dead (another PID namespace, a reused pid) makes
    two attempts run at once even where fencing keeps their commits apart."""
    name = "never two attempts at once: no superseded attempt went on unless it was stopped"
    if e.history is None:
        return Check(name, True, "no state log recorded")
    claims = claims_by_job(e)
    problems: list[str] = []
    excused: Counter[str] = Counter()
    superseded = 0
    for job_id, rows in sorted(rows_by_job.items()):
        for run in runs_by_token(rows):
            token = run[0].token or 0
            later = [at for t, at in claims.get(job_id, []) if t > token]
            if not later:
                continue
            superseded += 1
            claimed = min(later)
            late = [r for r in run if r.started_at > claimed]
            if not late:
                continue
            excuse = superseded_excuse(e, job_id, run[0].pid, late[0].started_at)
            if excuse is not None:
                excused[excuse] += 1
                continue
            problems.append(
                f"{job_id}: the run of token {token} (pid {run[0].pid}) started unit "
                f"{late[0].unit} {late[0].started_at - claimed:+.2f}s after a newer token's "
                f"claim, its process never stopped"
            )
    for job_id, token, at in e.lost_to_another:
        pids = {r.pid for r in rows_by_job.get(job_id, []) if r.token == token}
        pid = next(iter(pids)) if len(pids) == 1 else None
        excuse = superseded_excuse(e, job_id, pid, at)
        if excuse is not None:
            excused[excuse] += 1
            continue
        problems.append(
            f"{job_id}: its attempt of token {token} (pid {pid if pid else '?'}) was still "
            f"running when another attempt held the job (its checkpoint found so), its "
            f"process never stopped"
        )
    e.figures.update(
        superseded_runs=superseded,
        superseded_went_on=len(problems),
        superseded_excused=sum(excused.values()),
    )
    text = (
        f"{superseded} runs superseded by a newer claim, {len(e.lost_to_another)} attempts that "
        f"found another holding their job; {sum(excused.values())} ran beside a newer one for a "
        f"reason outside the library ("
        + (", ".join(f"{k} {v}" for k, v in sorted(excused.items())) or "none")
        + f"), {len(problems)} with no such reason"
    )
    for problem in problems[:3]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


def paused_within(e: Evidence, pids: set[int], start: float, end: float) -> float:
    """Seconds of ``start``-``end`` during which one of ``pids`` (any process, when ``pids`` is
    empty or the database has one lock) was stopped."""
    spans = sorted(
        (max(p.start, start), min(p.end, end))
        for p in e.pauses
        if (e.global_lock or not pids or pids & set(p.pids)) and p.start < end and p.end > start
    )
    total, reached = 0.0, start
    for low, high in spans:
        low = max(low, reached)
        if high > low:
            total += high - low
            reached = high
    return total


def _no_lease_outlives_its_attempt(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """No job stayed claimed (``running`` under a token, in the state log) longer than
    ``hold_slack`` after its attempt's last sign of life (its last unit started or committed, or
    the claim), time its process was stopped left out, unless PostgreSQL restarted meanwhile:
    an attempt that died, or gave up its lease "to expire as a crash would", frees its job
    within a lease and a reaper pass. A lease that its holder keeps renewing for an attempt
    that no longer runs (its process running other tasks) breaks this."""
    name = "no lease outlives its attempt: a claimed job is freed soon after its attempt ends"
    if e.history is None or e.hold_slack is None:
        return Check(name, True, "not checked (no state log, or no slack given)")
    by_job: dict[str, list[StateRow]] = {}
    for row in e.history:
        by_job.setdefault(row.job_id, []).append(row)
    problems: list[str] = []
    longest = 0.0
    excused = 0
    for job_id, rows in sorted(by_job.items()):
        for row, after in itertools.pairwise(rows):
            if row.state != "running":
                continue
            units = [u for u in rows_by_job.get(job_id, []) if u.token == row.token]
            last = max([row.at, *(u.ended_at or u.started_at for u in units)])
            if any(last - e.lease_seconds <= r <= after.at for r in e.restarts):
                excused += 1
                continue
            held = after.at - last - paused_within(e, {u.pid for u in units}, last, after.at)
            longest = max(longest, held)
            if held > e.hold_slack:
                problems.append(
                    f"{job_id}: token {row.token} still claimed {held:.1f} s after its attempt's "
                    f"last unit (pid {units[-1].pid if units else '?'}), until it went "
                    f"{after.state} (token {after.token})"
                )
    e.figures.update(lease_held_after_attempt_max=round(longest, 1), leases_outlived=len(problems))
    text = (
        f"the longest a job stayed claimed after its attempt's last sign of life: {longest:.1f} s "
        f"(allowed {e.hold_slack:g} s; {excused} claims around a database restart left out); "
        f"{len(problems)} over it"
    )
    for problem in problems[:3]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


def _interrupts(e: Evidence) -> Check:
    """No connection was used again after a statement on it was interrupted (a soft time limit
    inside a statement: the driver's error, ``another command is already in progress``, in a
    worker log), and no conflict (a serialization failure) was reported as the database being
    unavailable. The tasks' own connections are closed after an interrupt (``chaos.app``): a
    reused one is the library's."""
    name = "interrupts: no connection used again after one, no conflict reported as an outage"
    reuse = e.log_errors.get("reuse", [])
    outage = e.log_errors.get("conflict_as_outage", [])
    c = e.log_counts
    sites = {
        k.removeprefix("soft limit in "): v for k, v in c.items() if k.startswith("soft limit in ")
    }
    e.figures.update(
        soft_limited_jobs=len(e.soft_limited),
        soft_limits_caught=sum(sites.values()),
        soft_limits_in_library_statements=sites.get("library statement", 0),
        connections_reused=len(reuse),
        conflicts_reported_as_outage=len(outage),
    )
    text = (
        f"{len(e.soft_limited)} jobs sent with a soft time limit: {sum(sites.values())} limits "
        f"caught by the task ("
        + (", ".join(f"in {k} {v}" for k, v in sorted(sites.items())) or "none")
        + f"), {c.get('soft limits escaped', 0)} escaped it; {len(reuse)} errors of a connection "
        f"used again after an interrupt; write conflicts run again by the task "
        f"{c.get('conflicts run again by the task', 0)}, by the library "
        f"{c.get('conflicts run again by the library', 0)}, {len(outage)} reported as an outage"
    )
    for line in [*reuse[:3], *outage[:2]]:
        text += f"\n      {_short(line, 200)}"
    return Check(name, not reuse and not outage, text)


def _dying_clients(e: Evidence) -> Check:
    """Every job a killed client recorded (a row of its call's id) ran and ended done, or as
    a control of it allows, none left live: a recorded job its client never published is
    re-published by the reaper (keyed ones too, with the default settings)."""
    name = "dying clients: every job a killed client recorded ran, none left queued"
    if e.client_calls is None:
        return Check(name, True, "no client killed in this run")
    by_job = controls_by_job(e)
    recorded = [i for i in e.client_calls if i in e.jobs]
    interrupted = [i for i in recorded if not e.client_calls[i]]
    problems: list[str] = []
    for job_id in recorded:
        job = e.jobs[job_id]
        if job.key is not None:
            allowed = keyed_allowed_ends(e, job)
        else:
            allowed = allowed_ends(e, job_id, by_job.get(job_id, []))
        if job.state not in allowed:
            problems.append(
                f"{job_id}: {job.state} (may end {'/'.join(sorted(allowed))}), attempts "
                f"{job.attempts}"
                + (
                    "; its client was killed before the call returned"
                    if job_id in interrupted
                    else ""
                )
            )
    e.figures.update(
        client_calls=len(e.client_calls),
        client_recorded=len(recorded),
        client_interrupted_after_record=len(interrupted),
    )
    text = (
        f"{len(e.client_calls)} calls started by killed clients, {len(recorded)} recorded a "
        f"row of their id, {len(interrupted)} of those by a call the kill interrupted (recorded, "
        f"its publish unconfirmed); {len(recorded) - len(problems)}/{len(recorded)} ended as "
        f"allowed"
    )
    for problem in problems[:3]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


# -- keyed jobs ------------------------------------------------------------------------------

NO_KEYS = "no keyed jobs in this run"


def jobs_by_key(e: Evidence) -> dict[str, list[str]]:
    """Every keyed row's id (runs and served rows), by key, in id order."""
    found: dict[str, list[str]] = {}
    for job in sorted(e.jobs.values(), key=lambda j: j.id):
        if job.key is not None:
            found.setdefault(job.key, []).append(job.id)
    return found


def runs_by_key(e: Evidence) -> dict[str, list[str]]:
    """The keyed rows that are runs (not served rows), by key, in id order."""
    found: dict[str, list[str]] = {}
    for key, ids in jobs_by_key(e).items():
        runs = [i for i in ids if e.jobs[i].served_by is None]
        if runs:
            found[key] = runs
    return found


def first_start(rows: list[Unit]) -> float | None:
    """When the first unit of a job started (any attempt), or None if none did."""
    return min((r.started_at for r in rows), default=None)


def run_start(e: Evidence, job_id: str, rows_by_job: dict[str, list[Unit]]) -> float | None:
    """When run ``job_id`` started: its first claim (the row's ``started_at``), else its first
    unit; None if it never did."""
    job = e.jobs.get(job_id)
    if job is not None and job.started_at is not None:
        return job.started_at
    return first_start(rows_by_job.get(job_id, []))


def key_controls_by_job(e: Evidence) -> dict[str, list[Control]]:
    found: dict[str, list[Control]] = {}
    for control in e.key_controls:
        found.setdefault(control.job_id, []).append(control)
    return found


def keyed_allowed_ends(e: Evidence, job: JobRow) -> set[str]:
    """The states keyed row ``job`` may end in: ``done``; ``revoked`` if the driver revoked its
    id (a revoke only flags the id in the live workers: ``done`` stays allowed) or it is a run
    recorded with ``expires`` (its own call's); ``cancelled`` if a cancel of its id found it
    queued (or the cancel call failed); ``superseded`` on a newest-wins key. A served row only
    ``done``: the run that served it
    started after every trigger it answers for."""
    allowed = {DONE}
    if job.served_by is not None:
        return allowed
    if job.key in e.newest_keys:
        allowed.add(SUPERSEDED)  # a newer trigger of its key asked it to stop
    for control in key_controls_by_job(e).get(job.id, []):
        if control.kind == "revoke":
            allowed.add(REVOKED)
        elif control.kind == "cancel" and control.detail in ("queued", "uncertain"):
            allowed.add(CANCELLED)
    if job.expires and job.id in e.key_expires and not followup_after_call(e, job.id):
        allowed.add(REVOKED)
    return allowed


def followup_after_call(e: Evidence, job_id: str) -> float | None:
    """Seconds after the call of trigger ``job_id`` returned that its row was inserted: a
    follow-up run, recorded for triggers that waited, not the row its own call recorded; None
    when it was inserted before (or either moment is unknown)."""
    answered = next((t.answered for t in e.triggers or [] if t.id == job_id), None)
    inserted = next((r.at for r in e.history or [] if r.job_id == job_id), None)
    if answered is None or inserted is None or inserted <= answered:
        return None
    return inserted - answered


def stopped_for(e: Evidence, trigger: Trigger, job: JobRow) -> bool:
    """Whether ``job``, the result id of ``trigger``, may have ended stopped (revoked or
    cancelled) for that trigger's caller: by its own call's ``expires``, by a cancel of that id
    sent once the call was under way, or by a revoke of that id whenever it was sent. A revoke
    is of an id, for good (Celery's): the documented rule (docs/keys.md, "The rules of a
    trigger") is that revoking the id waiting triggers share revokes their run, for every
    trigger that shares it, those that join it after the revoke included."""
    if job.state == DONE or job.state not in keyed_allowed_ends(e, job):
        return False
    if job.state == SUPERSEDED:  # a newer trigger's run follows (the newest-wins check)
        return True
    if job.state == REVOKED and job.expires and job.id == trigger.id:
        return True
    controls = key_controls_by_job(e).get(job.id, [])
    if job.state == REVOKED:
        return any(c.kind == "revoke" for c in controls)
    return any(c.kind == "cancel" and c.at >= trigger.at for c in controls)


def _keyed_jobs(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """Every keyed run ended done with its full result (or as a control of its own id or its
    own ``expires`` allows), each of its units committed exactly once (the unit, its cursor
    write and its checkpoint share one transaction); every served row mirrors the run that
    served it: a run of its key, no attempt of its own, ``done`` with that run's result."""
    name = "keyed jobs: every run done, each unit committed exactly once"
    if e.triggers is None:
        return Check(name, True, NO_KEYS)
    keyed = [job for job in e.jobs.values() if job.key is not None]
    runs = [job for job in keyed if job.served_by is None]
    served = [job for job in keyed if job.served_by is not None]
    states = Counter(job.state for job in runs)
    problems: list[str] = []
    once = duplicated = missing = 0
    for job in sorted(runs, key=lambda j: j.id):
        counts = _committed_counts(rows_by_job.get(job.id, []))
        twice = {u: n for u, n in sorted(counts.items()) if n > 1 or not 0 <= u < e.key_units}
        duplicated += sum(n - 1 if 0 <= u < e.key_units else n for u, n in twice.items())
        absent = [u for u in range(e.key_units) if not counts.get(u)] if job.state == DONE else []
        missing += len(absent)
        if job.state == DONE:
            once += sum(1 for u in range(e.key_units) if counts.get(u) == 1)
        allowed = keyed_allowed_ends(e, job)
        wrong_result = job.state == DONE and job.result != e.key_units
        if job.state not in allowed or wrong_result or twice or absent:
            problems.append(
                f"{job.id} ({job.key}): {job.state} (may end {'/'.join(sorted(allowed))}), "
                f"attempts {job.attempts}, result {job.result!r}, error {job.error!r}; units "
                f"committed more than once {twice or 'none'}, missing {absent or 'none'}"
            )
    for job in sorted(served, key=lambda j: j.id):
        run = e.jobs.get(job.served_by or "")
        if run is None or run.served_by is not None or run.key != job.key:
            what = "no row" if run is None else f"key {run.key}, served by {run.served_by}"
            problems.append(
                f"{job.id} ({job.key}): served by {job.served_by}, not a run of its key ({what})"
            )
            continue
        mirrored = job.state == (DONE if run.state == DONE else FAILED) and (
            job.state != DONE or job.result == run.result
        )
        if not mirrored or job.attempts != 0 or rows_by_job.get(job.id):
            problems.append(
                f"{job.id} ({job.key}): served by {run.id} ({run.state}, result "
                f"{run.result!r}) but {job.state}, result {job.result!r}, attempts "
                f"{job.attempts}, {len(rows_by_job.get(job.id, []))} units of its own"
            )
    expected = states[DONE] * e.key_units
    attempts = sum(job.attempts for job in runs)
    again = sum(max(job.attempts - 1, 0) for job in runs)
    e.figures.update(
        keyed_jobs=len(runs),
        keyed_done=states[DONE],
        keyed_served_rows=len(served),
        keyed_duplicated=duplicated,
        keyed_attempts=attempts,
    )
    text = (
        f"{states[DONE]}/{len(runs)} keyed runs done ({dict(sorted(states.items()))}), "
        f"{len(served)} served rows; {once}/{expected} of the done runs' units committed exactly "
        f"once, {missing} missing, {duplicated} committed again; attempts {attempts} "
        f"({again} after an interruption)"
    )
    for problem in problems[:3]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


def _one_run_per_key(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """Never two runs of one key at once, from the unit log: no committed units of two jobs of
    one key overlap in time, and no run of a key's job started while another job of the key had
    a run that started before it and committed a unit after (its first unit start to its last
    commit). And from the state log: no two runs of one key were live (queued or running) at
    once (from the row's insert to its end). Served rows are no runs: they are left out."""
    name = "one run per key: never two runs of one key at once"
    if e.triggers is None:
        return Check(name, True, NO_KEYS)
    overlaps: list[str] = []
    inside: list[str] = []
    live: list[str] = []
    keys = runs_by_key(e)
    for key, job_ids in keys.items():
        committed = sorted(
            (r for j in job_ids for r in rows_by_job.get(j, []) if r.committed),
            key=lambda r: r.started_at,
        )
        latest: dict[str, Unit] = {}  # per job, its committed unit that ended last so far
        for b in committed:
            for job_id, a in latest.items():
                if job_id != b.job_id and (a.ended_at or 0.0) > b.started_at:
                    overlaps.append(
                        f"{key}: unit {a.unit} of {a.job_id} (token {a.token}, "
                        f"{a.started_at:.3f}-{a.ended_at:.3f}) overlaps unit {b.unit} of "
                        f"{b.job_id} (token {b.token}, {b.started_at:.3f}-{b.ended_at:.3f})"
                    )
            if b.job_id not in latest or (b.ended_at or 0.0) > (latest[b.job_id].ended_at or 0.0):
                latest[b.job_id] = b
        spans = []  # (job, token, first start, last commit) of every run that committed
        starts = []  # (job, token, first start) of every run
        for job_id in job_ids:
            for run in runs_by_token(rows_by_job.get(job_id, [])):
                starts.append((job_id, run[0].token, run[0].started_at))
                ends = [r.ended_at for r in run if r.ended_at is not None]
                if ends:
                    spans.append((job_id, run[0].token, run[0].started_at, max(ends)))
        for job_id, token, started in starts:
            for other, other_token, first, last in spans:
                if other != job_id and first <= started < last:
                    inside.append(
                        f"{key}: {job_id}'s run (token {token}) started at {started:.3f}, "
                        f"while {other}'s run (token {other_token}) ran from {first:.3f} and "
                        f"committed until {last:.3f}"
                    )
        intervals = []
        for job_id in job_ids:
            history = [r for r in e.history or [] if r.job_id == job_id]
            if not history:
                continue
            end = next((r.at for r in history if r.state in FINISHED), float("inf"))
            intervals.append((job_id, history[0].at, end))
        for (one, one_from, one_to), (two, two_from, two_to) in itertools.combinations(
            intervals, 2
        ):
            if one_from < two_to and two_from < one_to:
                live.append(
                    f"{key}: {one} live {one_from:.3f}-{one_to:.3f} and {two} live "
                    f"{two_from:.3f}-{two_to:.3f} (state log)"
                )
    e.figures.update(
        keys=len(keys),
        key_overlaps=len(overlaps),
        key_runs_inside=len(inside),
        key_live_overlaps=len(live),
    )
    text = (
        f"{len(keys)} keys, {sum(len(j) for j in keys.values())} keyed runs: {len(overlaps)} "
        f"committed units of two jobs of a key overlapping, {len(inside)} runs started while "
        f"another job of the key had a run that committed later, {len(live)} pairs of runs of "
        f"a key live at once" + ("" if e.history is not None else " (no state log recorded)")
    )
    for problem in [*overlaps[:2], *inside[:2], *live[:2]]:
        text += f"\n      {problem}"
    return Check(name, not overlaps and not inside and not live, text)


def serving_run(e: Evidence, trigger: Trigger) -> JobRow | None:
    """The run that serves ``trigger``: its result id's job when that is a run, the run that
    served it when it is a served row; None when the result id has no row of its key."""
    job = e.jobs.get(trigger.served or "")
    if job is None or job.key != trigger.key:
        return None
    if job.served_by is not None:
        run = e.jobs.get(job.served_by)
        return run if run is not None and run.key == trigger.key else None
    return job


def _triggers_followed(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """For every trigger, the run that serves it (its call's result id, or the run its served
    row names) started after it (its first claim, and its first unit, after the database clock
    read just before the call) and ended done: a run that saw everything the trigger announced.
    A trigger whose result id has no row of its key (lost: see the next check) needs some done
    run of its key that started after it; one whose result id is a run a control of that very
    id (or its own call's ``expires``) stopped is not to be followed (counted apart)."""
    name = "every trigger followed by a run of its key that started after it and ended done"
    if e.triggers is None:
        return Check(name, True, NO_KEYS)
    keys = runs_by_key(e)
    taken = [t for t in e.triggers if t.served is not None]
    unfollowed: list[str] = []
    waits: list[float] = []
    stopped = 0
    for t in taken:
        run = serving_run(e, t)
        if run is not None and run.id == t.served and stopped_for(e, t, run):
            stopped += 1
            continue
        if run is not None:
            started = run_start(e, run.id, rows_by_job)
            unit = first_start(rows_by_job.get(run.id, []))
            after = started is not None and started > t.at and (unit is None or unit > t.at)
            if run.state == DONE and after and started is not None:
                waits.append(started - t.at)
                continue
            via = f"{t.served} served by " if run.id != t.served else ""
            when = "never started" if started is None else f"started {started - t.at:+.2f}s"
            first = "" if unit is None else f", first unit {unit - t.at:+.2f}s"
            unfollowed.append(
                f"trigger {t.id} of {t.key} at {t.at:.3f}: served by {via}{run.id}, "
                f"{run.state}, {when}{first} after it"
            )
            continue
        starts = {j: run_start(e, j, rows_by_job) for j in keys.get(t.key, [])}
        after_it = [
            s for j, s in starts.items() if e.jobs[j].state == DONE and s is not None and s > t.at
        ]
        if after_it:
            waits.append(min(after_it) - t.at)
            continue
        seen = sorted((j for j, s in starts.items() if s is not None), key=lambda j: starts[j] or 0)
        last = ", ".join(
            f"{j} {e.jobs[j].state} started {(starts[j] or 0.0) - t.at:+.2f}s" for j in seen[-2:]
        )
        unfollowed.append(
            f"trigger {t.id} of {t.key} at {t.at:.3f} (served by {t.served}): no done run of "
            f"the key started after it; its last runs: {last or 'none ran'}"
        )
    e.figures.update(
        triggers=len(taken),
        triggers_failed_calls=len(e.triggers) - len(taken),
        triggers_unfollowed=len(unfollowed),
        trigger_to_run_max=round(max(waits, default=0.0), 2),
    )
    text = (
        f"{len(waits)}/{len(taken) - stopped} triggers followed by a done run of their key that "
        f"started after them (the longest wait for that start {max(waits, default=0.0):.1f} s), "
        f"{stopped} stopped by a control of their own id; {len(e.triggers) - len(taken)} calls "
        f"raised (sent again as new calls)"
    )
    for problem in unfollowed[:3]:
        text += f"\n      {problem}"
    return Check(name, not unfollowed, text)


def _no_trigger_lost(e: Evidence) -> Check:
    """Every trigger's result id (its own job, the id of the triggers it waited with: their
    follow-up run or their served row) is a row of its key that ended done, or as a control
    of that very id allows; the result backend says so (SUCCESS with the run's result, or
    REVOKED); and no trigger is left waiting on a key at the end."""
    name = "no trigger lost: every call's result id is a job of its key that ended done"
    if e.triggers is None:
        return Check(name, True, NO_KEYS)
    taken = [t for t in e.triggers if t.served is not None]
    lost: list[str] = []
    stopped = 0
    for t in taken:
        job = e.jobs.get(t.served or "")
        if job is None:
            lost.append(f"trigger {t.id} of {t.key}: served by {t.served}, which has no row")
            continue
        allowed = keyed_allowed_ends(e, job)
        if job.key != t.key or job.state not in allowed:
            why = f", served by {job.served_by}" if job.served_by else ""
            lost.append(
                f"trigger {t.id} of {t.key}: served by {t.served}, {job.state}{why} (key "
                f"{job.key}; may end {'/'.join(sorted(allowed))}): {job.error or ''}".rstrip(": ")
            )
        elif job.state != DONE and not stopped_for(e, t, job):
            lost.append(
                f"trigger {t.id} of {t.key} at {t.at:.3f}: answered with {t.served}, which a "
                f"control had stopped ({job.state}) before the call"
            )
        elif job.state != DONE:
            stopped += 1
    backend_wrong: list[str] = []
    unstored = 0
    if e.key_backend is not None:
        for job_id in sorted({t.served for t in taken if t.served in e.jobs}):
            job = e.jobs[job_id or ""]
            want = CELERY_STATE.get(job.state)
            got = e.key_backend.get(job.id)
            same = got is not None and got.status == want
            if same and want == "SUCCESS":
                same = got is not None and got.result == job.result
            if same:
                continue
            nothing = got is None or got.status == "PENDING"
            killed = killed_after_served if job.served_by else killed_after_done
            if want == "SUCCESS" and nothing and killed(e, job.id):
                unstored += 1
            else:
                seen = "nothing" if got is None else f"{got.status} {_short(got.result)}"
                backend_wrong.append(f"{job.id}: table {job.state}, backend {seen}")
    waiting = [f"{key}: triggers still waiting as {i}" for key, i in sorted(e.pending.items())]
    own = sum(1 for t in taken if t.served == t.id)
    served_by = len({t.served for t in taken})
    e.figures.update(
        triggers_lost=len(lost),
        trigger_jobs=served_by,
        triggers_stopped_by_their_control=stopped,
        triggers_waiting_at_end=len(waiting),
        keyed_backend_disagree=len(backend_wrong),
        keyed_backend_unstored=unstored,
    )
    text = (
        f"{len(taken) - len(lost)}/{len(taken)} triggers' result ids ended done or as a control "
        f"of that id allowed ({stopped} of them stopped so); {served_by} ids answered them "
        f"({own} calls answered with their own id, {len(taken) - own} with another's); "
        f"{len(waiting)} keys with triggers still waiting at the end"
        + (
            ""
            if e.key_backend is None
            else f"; {len(backend_wrong)} result ids whose backend state disagrees, {unstored} "
            f"done with nothing stored, the process that would store it SIGKILLed <= "
            f"{UNSTORED_WINDOW:g} s (freezes not counted) after it marked them done (tolerated, "
            f"as for the result backend)"
        )
    )
    for problem in [*lost[:3], *waiting[:2], *backend_wrong[:2]]:
        text += f"\n      {problem}"
    return Check(name, not lost and not waiting and not backend_wrong, text)


def _keyed_controls(e: Evidence) -> Check:
    """Controls of keyed jobs stop only the job they name: a run whose message carries
    ``expires`` is one its own call recorded with it (sent with ``expires``, inserted before
    that call returned), never a follow-up (which runs without the trigger's expires or
    countdown); a run revoked by its ``expires`` alone ended after it. (That the other triggers
    of a stopped job's key are still served is the previous checks'.)"""
    name = "keyed controls: follow-ups run without the trigger's expires, expiry only after it"
    if e.triggers is None:
        return Check(name, True, NO_KEYS)
    problems: list[str] = []
    controls = key_controls_by_job(e)
    tally: Counter[str] = Counter()
    for control in e.key_controls:
        job = e.jobs.get(control.job_id)
        tally[f"{control.kind}_{control.detail}"] += 1
        tally[f"{control.kind}_{control.detail}_{job.state if job else 'no row'}"] += 1
    for job in sorted(e.jobs.values(), key=lambda j: j.id):
        if job.key is None or job.served_by is not None:
            continue
        if job.expires:
            tally["runs_with_expires"] += 1
            late = followup_after_call(e, job.id)
            if job.id not in e.key_expires:
                problems.append(
                    f"{job.id}: carries expires, and no call of that id was sent with one"
                )
            elif late is not None:
                problems.append(
                    f"{job.id}: a follow-up (inserted {late:+.2f}s after its trigger's call "
                    f"returned) carrying that trigger's expires"
                )
        revoke = any(c.kind == "revoke" for c in controls.get(job.id, []))
        if job.state == REVOKED and job.expires and not revoke:
            tally["expired"] += 1
            expires = e.key_expires.get(job.id)
            if expires is not None and job.finished_at is not None and job.finished_at < expires:
                problems.append(
                    f"{job.id}: revoked {expires - job.finished_at:.1f} s before its expires, "
                    f"with no revoke"
                )
    e.figures.update({f"key_controls_{k}": v for k, v in sorted(tally.items())})
    t = tally
    text = (
        f"revoke of a queued job {t['revoke_queued']} ({t['revoke_queued_revoked']} revoked), of "
        f"the id triggers waited under {t['revoke_pending']} ({t['revoke_pending_revoked']} "
        f"revoked); cancel of a queued job {t['cancel_queued']} ({t['cancel_queued_cancelled']} "
        f"cancelled), that found nothing to cancel {t['cancel_none']}; triggers sent with "
        f"expires {len(e.key_expires)}, runs recorded with it {t['runs_with_expires']} "
        f"({t['expired']} revoked by it)"
    )
    for problem in problems[:3]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


def _cursors(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """Each key's cursor equals the units its jobs committed, and the cursor log shows it
    written only with them: one write per committed unit, by that unit's job and token, each
    write one more than the one before (none lost, repeated or by a stale attempt)."""
    name = "cursors: each key's cursor counts its jobs' committed units, written only with them"
    if e.triggers is None:
        return Check(name, True, NO_KEYS)
    problems: list[str] = []
    keys = jobs_by_key(e)
    logged: dict[str, list[CursorRow]] = {}
    for row in e.cursor_log:
        logged.setdefault(row.key, []).append(row)
    writes = 0
    for key in sorted(set(keys) | set(logged) | set(e.cursors)):
        units = [r for j in keys.get(key, []) for r in rows_by_job.get(j, []) if r.committed]
        final = e.cursors.get(key)
        count = final.get("units") if isinstance(final, dict) else None
        if (count or 0) != len(units):
            problems.append(f"{key}: cursor {final!r}, its jobs committed {len(units)} units")
        rows = logged.get(key, [])
        writes += len(rows)
        previous = 0
        for number, row in enumerate(rows, start=1):
            if row.units != previous + 1:
                problems.append(
                    f"{key}: write #{number} by {row.job_id} (token {row.token}) set units="
                    f"{row.units} after {previous}"
                )
            previous = row.units if isinstance(row.units, int) else previous
        # A write with no job (an operator's) sorts with the rest: it matches no unit.
        by_writer: Counter[tuple[str | None, int | None]] = Counter(
            (r.job_id, r.token) for r in rows
        )
        by_unit: Counter[tuple[str | None, int | None]] = Counter(
            (r.job_id, r.token) for r in units
        )
        for (job_id, token), n in sorted((by_writer - by_unit).items(), key=str):
            problems.append(
                f"{key}: {job_id} (token {token}) wrote the cursor {n} more time(s) than it "
                f"committed units ({by_unit[(job_id, token)]})"
            )
        for (job_id, token), n in sorted((by_unit - by_writer).items(), key=str):
            problems.append(
                f"{key}: {job_id} (token {token}) committed {n} unit(s) with no cursor write"
            )
    e.figures.update(cursor_writes=writes, cursor_problems=len(problems))
    text = (
        f"{len(keys)} keys; {writes} cursor writes logged, {len(e.cursors)} cursors saved "
        f"({', '.join(f'{k} {v}' for k, v in sorted(e.cursors.items()))}); {len(problems)} "
        f"disagreements with the unit log"
    )
    for problem in problems[:4]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


# -- debounce and newest wins -----------------------------------------------------------------

NO_DEBOUNCE = "no debounced keys in this run"
NO_NEWEST = "no newest-wins keys in this run"


def markers_by_job(e: Evidence) -> dict[str, dict[int, set[str]]]:
    """job id -> token -> the markers its checkpoints saved (the ids of the triggers whose
    arguments each attempt ran with), from the checkpoint log."""
    found: dict[str, dict[int, set[str]]] = {}
    for row in e.checkpoints:
        state = json.loads(row.checkpoint) if row.checkpoint else None
        if isinstance(state, dict) and state.get("marker") is not None:
            found.setdefault(row.job_id, {}).setdefault(row.token, set()).add(state["marker"])
    return found


def taken_by_key(e: Evidence) -> dict[str, list[Trigger]]:
    """The triggers the library took (their call returned an id), by key, in send order."""
    found: dict[str, list[Trigger]] = {}
    for t in e.triggers or []:
        if t.served is not None:
            found.setdefault(t.key, []).append(t)
    return found


def _ran_with(markers: dict[int, set[str]]) -> set[str]:
    return set().union(*markers.values()) if markers else set()


def _debounce(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """For every run of a debounced key that served a burst (the triggers answered with its
    id before it started): every attempt ran with the arguments of the burst's last trigger,
    and the run was not claimed before its due time, ``min(last trigger + quiet, first
    trigger + max_wait)`` (less ``DEBOUNCE_ALLOWANCE``), on the database clock. A follow-up
    (recorded for the triggers that waited while a run went on, with the first one's id) is a
    burst of those triggers: the newest one's arguments, due ``quiet`` after it and never
    later than ``max_wait`` after the first (docs/keys.md, "the follow-up debounced too"). How
    late runs started after that due time, and after ``max_wait``, is reported, not checked
    (faults, a busy queue and, for a follow-up, the run before it delay them), with the
    triggers that moved into a job already past its max wait (none since a burst closes at its
    due time: before, each re-published the job's message and the copy already queued became
    a stale version). One run at a time and no trigger lost are the keyed checks' (they cover
    these keys)."""
    name = "debounce: a burst runs once, after its quiet period, with its last trigger's arguments"
    if e.triggers is None or not e.debounced_keys:
        return Check(name, True, NO_DEBOUNCE)
    quiet, max_wait = e.debounce
    markers = markers_by_job(e)
    taken = taken_by_key(e)
    keys = runs_by_key(e)
    problems: list[str] = []
    bursts = followups = past_max = overdue = 0
    sizes: list[int] = []
    late: list[tuple[float, str]] = []
    for key in sorted(e.debounced_keys):
        for run_id in keys.get(key, []):
            run = e.jobs[run_id]
            started = run_start(e, run_id, rows_by_job)
            if started is None:
                continue
            burst = [t for t in taken.get(key, []) if t.served == run_id and t.at < started]
            if not burst:
                continue
            ran = _ran_with(markers.get(run_id, {}))
            followup = followup_after_call(e, run_id) is not None
            if followup:
                followups += 1
            else:
                bursts += 1
                sizes.append(len(burst))
            expected = burst[-1].id
            first = next((t for t in burst if t.id == run_id), burst[0])
            due = min(burst[-1].at + quiet, first.at + max_wait)
            if started < due - DEBOUNCE_ALLOWANCE:
                problems.append(
                    f"{run_id} ({key}): claimed at {started:.3f}, {due - started:.2f} s "
                    f"before its due time (last of {len(burst)} triggers {burst[-1].id} "
                    f"at {burst[-1].at:.3f} + quiet {quiet:g}, first at {first.at:.3f} + "
                    f"max wait {max_wait:g})"
                )
            late.append((started - due, run_id))
            if started > first.at + max_wait + DEBOUNCE_ALLOWANCE:
                past_max += 1
            # Triggers that rewrote the job's message after its max wait had passed: each
            # one makes the message already queued a stale version (dropped at its claim).
            overdue += sum(1 for t in burst if t.at > first.at + max_wait)
            if ran and ran != {expected}:
                what = f"the last of {len(burst)}" + (" that waited" if followup else "")
                problems.append(
                    f"{run_id} ({key}, {run.state}): ran with the arguments of "
                    f"{', '.join(sorted(ran))}; {what} before it started was {expected}"
                )
            elif not ran and run.state == DONE:
                problems.append(f"{run_id} ({key}): done, and no checkpoint says what it ran with")
    worst = max(late, default=(0.0, ""))
    e.figures.update(
        debounce_bursts=bursts,
        debounce_followups=followups,
        debounce_largest_burst=max(sizes, default=0),
        debounce_past_max_wait=past_max,
        debounce_triggers_after_max_wait=overdue,
        debounce_latest_start=round(worst[0], 2),
        debounce_problems=len(problems),
    )
    text = (
        f"{len(e.debounced_keys)} keys: {bursts} debounced runs served bursts of "
        f"{sum(sizes)} triggers (up to {max(sizes, default=0)}), {followups} follow-ups; "
        f"started after their due time by at most {worst[0]:.2f} s"
        + (f" ({worst[1]})" if worst[1] else "")
        + f", {past_max} later than max wait ({max_wait:g} s) after their first trigger, "
        f"{overdue} triggers moved into a job past its max wait (reported, not checked); "
        f"{len(problems)} problems"
    )
    for problem in problems[:4]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


def superseding_call(e: Evidence, job: JobRow) -> Trigger | None:
    """The first trigger that may have superseded ``job``: of its key, answered with another
    id, its call returned after the job was recorded (its first state-log row); None if
    none."""
    inserted = next((r.at for r in e.history or [] if r.job_id == job.id), None)
    if inserted is None:
        return None
    found = [
        t
        for t in e.triggers or []
        if t.key == job.key
        and t.served is not None
        and t.served != job.id
        and t.answered is not None
        and t.answered > inserted
    ]
    return min(found, key=lambda t: t.answered or 0.0, default=None)


def _newest(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """On every newest-wins key: every trigger's result id ended done, or superseded (REVOKED
    in Celery), or as a control allows; every done run ran with the arguments of the newest
    trigger answered with its id (or with a served row naming it) before it started; the key's
    last run started after its last trigger, ended done and ran with that trigger's arguments;
    a superseded job was superseded by a newer trigger (one answered with another id once it
    was recorded), and after that call returned each of its attempts committed at most the unit
    in flight (it stops at its next checkpoint). One run at a time and the cursor are the keyed
    checks' (they cover these keys)."""
    name = "newest wins: superseded jobs stop at their checkpoint, the last run has the newest"
    if e.triggers is None or not e.newest_keys:
        return Check(name, True, NO_NEWEST)
    markers = markers_by_job(e)
    taken = taken_by_key(e)
    keys = runs_by_key(e)
    problems: list[str] = []
    superseded = after_units = stopped_last = 0
    ends: Counter[str] = Counter()
    for key in sorted(e.newest_keys):
        triggers = taken.get(key, [])
        for t in triggers:
            job = e.jobs.get(t.served or "")
            ends[job.state if job is not None else "no row"] += 1
        starts: list[tuple[float, str]] = []
        for run_id in keys.get(key, []):
            run = e.jobs[run_id]
            started = run_start(e, run_id, rows_by_job)
            if started is not None:
                starts.append((started, run_id))
            ran = _ran_with(markers.get(run_id, {}))
            if run.state == DONE and started is not None:
                # Answered with its id, or with a served row naming it (the newest of those is
                # the one whose arguments every caller's result must come from).
                answered = {run_id} | {
                    j.id for j in e.jobs.values() if j.served_by == run_id and j.key == key
                }
                before = [t for t in triggers if t.served in answered and t.at < started]
                if before and ran != {before[-1].id}:
                    problems.append(
                        f"{run_id} ({key}): done, ran with the arguments of "
                        f"{', '.join(sorted(ran)) or 'nothing recorded'}; the newest of its "
                        f"{len(before)} triggers was {before[-1].id}"
                    )
            if run.state != SUPERSEDED:
                continue
            superseded += 1
            call = superseding_call(e, run)
            if call is None or call.answered is None:
                problems.append(f"{run_id} ({key}): superseded, and no newer trigger came")
                continue
            committed = [r for r in rows_by_job.get(run_id, []) if r.committed]
            for token in sorted({r.token or 0 for r in committed}):
                later = [
                    r for r in committed if r.token == token and (r.ended_at or 0) > call.answered
                ]
                after_units += len(later)
                if len(later) > 1:
                    problems.append(
                        f"{run_id} ({key}, token {token}): superseded by {call.id} (answered "
                        f"{call.answered:.3f}), then committed units "
                        f"{[r.unit for r in later]} (at most the one in flight)"
                    )
        if not triggers:
            continue
        last = triggers[-1]
        job = e.jobs.get(last.served or "")
        if job is not None and job.state != DONE and stopped_for(e, last, job):
            stopped_last += 1  # a control stopped the last trigger's run
            continue
        started, final = max(starts, default=(None, None))
        ran = _ran_with(markers.get(final or "", {}))
        if (
            final is None
            or started is None
            or started <= last.at
            or e.jobs[final].state != DONE
            or ran != {last.id}
        ):
            state = "none" if final is None else f"{final}, {e.jobs[final].state}"
            when = "" if started is None else f", started {started - last.at:+.2f}s after it"
            problems.append(
                f"{key}: last trigger {last.id} at {last.at:.3f}; the key's last run {state}"
                f"{when}, ran with {', '.join(sorted(ran)) or 'nothing recorded'}"
            )
    e.figures.update(
        newest_superseded=superseded,
        newest_units_after_supersede=after_units,
        newest_problems=len(problems),
    )
    text = (
        f"{len(e.newest_keys)} keys: triggers' result ids ended {dict(sorted(ends.items()))}; "
        f"{superseded} jobs superseded, {after_units} units they committed after the call that "
        f"superseded them (in flight); {stopped_last} keys whose last trigger a control "
        f"stopped; {len(problems)} problems"
    )
    for problem in problems[:4]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


# -- job groups -------------------------------------------------------------------------------

NO_GROUPS = "no grouped jobs in this run"
#: Seconds a grouped job's first claim may precede its token's time (both on the database
#: clock; the claim compares them in SQL): rounding only.
RATE_ALLOWANCE = 0.01


def admissions_by_job(e: Evidence) -> dict[str, list[Admission]]:
    """Each job's rows of the admission log (its admissions, starts by claim and returns to
    its group's queue), in commit order."""
    found: dict[str, list[Admission]] = {}
    for admission in e.admissions or []:
        found.setdefault(admission.job_id, []).append(admission)
    return found


def end_after(e: Evidence, job_id: str, at: float) -> float:
    """When job ``job_id`` reached a finished state after ``at`` (the state log, else its
    row's ``finished_at``); infinity while it did not."""
    for row in e.history or []:
        if row.job_id == job_id and row.state in FINISHED and row.at >= at:
            return row.at
    job = e.jobs.get(job_id)
    if e.history is None and job is not None and job.finished_at is not None:
        return job.finished_at
    return float("inf")


def admitted_spans(
    e: Evidence, job_id: str, rows: list[Admission]
) -> list[tuple[Admission, float]]:
    """Each admission or start by claim of job ``job_id`` (its admission log ``rows``), with
    the moment its place in the group ended: the job's next return to its group's queue, or
    its end."""
    spans = []
    for n, admission in enumerate(rows):
        if admission.kind == RELEASED:
            continue
        released = next((r.at for r in rows[n + 1 :] if r.kind == RELEASED), float("inf"))
        spans.append((admission, min(released, end_after(e, job_id, admission.at))))
    return spans


def claims_of(e: Evidence, job_id: str) -> list[float]:
    """When each claim of job ``job_id`` happened (the state log's ``running`` rows)."""
    return [r.at for r in e.history or [] if r.job_id == job_id and r.state == "running"]


def most_at_once(spans: list[tuple[str, float, float]]) -> tuple[int, float]:
    """The most distinct jobs whose spans (job, from, to) cover one moment, and the first
    moment it happens (an end at the moment another span starts does not overlap it)."""
    events = sorted(
        [(start, 1, job) for job, start, _ in spans] + [(end, -1, job) for job, _, end in spans],
        key=lambda event: (event[0], event[1]),
    )
    live: Counter[str] = Counter()
    most, when = 0, 0.0
    for at, step, job in events:
        live[job] += step
        count = sum(1 for n in live.values() if n > 0)
        if count > most:
            most, when = count, at
    return most, when


def _group_limit(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    """Never more than a group's limit of its jobs at once where an admission decides: each
    admission finds at most ``limit - 1`` others of the group admitted and live (from an
    admission to the job's next return to the queue or end: the admission and state logs),
    counting the jobs sent by name that run at once in their group (from their claim's first
    unit, when their claim had surely committed); nor more than the limit running (from the
    unit log: committed units, each clipped to an admission's span, of distinct jobs). A job
    sent by name starts when its message comes, whatever the group holds (docs/keys.md): its
    start by claim may take the group over its limit, never an admission."""
    name = "group limit: never more than a group's limit of its jobs admitted or running at once"
    if not e.groups or e.admissions is None:
        return Check(name, True, NO_GROUPS if not e.groups else "no admission log recorded")
    logged = admissions_by_job(e)
    problems: list[str] = []
    parts: list[str] = []
    for group in sorted(set(e.groups.values())):
        limit = e.group_limits.get(group)
        jobs = sorted(j for j, g in e.groups.items() if g == group)
        spans = [(j, a, end) for j in jobs for a, end in admitted_spans(e, j, logged.get(j, []))]
        counted = []
        for j, a, end in spans:
            start: float | None = a.at
            if a.kind == CLAIMED:
                units = [r.started_at for r in rows_by_job.get(j, []) if a.at <= r.started_at < end]
                start = min(units, default=None)
            if start is not None:
                counted.append((j, start, end))
        running = [
            (j, max(r.started_at, a.at), min(r.ended_at or r.started_at, end))
            for j, a, end in spans
            if a.kind == ADMITTED
            for r in rows_by_job.get(j, [])
            if r.committed and r.started_at < end and (r.ended_at or 0.0) > a.at
        ]
        most_admitted, _ = most_at_once([(j, a.at, end) for j, a, end in spans])
        most_running, at_running = most_at_once(running)
        by_claim = sum(1 for _, a, _ in spans if a.kind == CLAIMED)
        e.figures[f"group_{group}_most_admitted"] = most_admitted
        e.figures[f"group_{group}_most_running"] = most_running
        parts.append(
            f"{group} (limit {limit if limit is not None else 'none'}): {len(jobs)} jobs, "
            f"{by_claim} started by their claim (sent by name), at most {most_admitted} admitted "
            f"and {most_running} running at once"
        )
        if limit is None:
            continue
        for j, a, _ in spans:
            live = {k for k, begin, end in counted if begin <= a.at < end} | {j}
            if a.kind == ADMITTED and len(live) > limit:
                problems.append(
                    f"{group}: {len(live)} jobs admitted and live at {a.at:.3f} (limit {limit})"
                )
        if most_running > limit:
            problems.append(
                f"{group}: {most_running} jobs running committed units at {at_running:.3f} "
                f"(limit {limit})"
            )
    e.figures["group_limit_problems"] = len(problems)
    text = "; ".join(parts) + f"; {len(problems)} problems"
    for problem in problems[:4]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


def _group_rate(e: Evidence) -> Check:
    """A group with a rate admits as its token bucket (one token at most, ``rate`` a second)
    allows: the tokens' times its admissions wrote (``run_after``) number at most ``rate *
    window + 1`` in any window, a retry's re-admission counted as any other (Celery's own
    ``rate_limit`` counts retried executions); and no admitted start came before its token's
    time (less ``RATE_ALLOWANCE``): each admission's next claim (the state log; without it, the
    first admission's, the row's ``started_at``). A start by claim (sent by name) takes no
    token. How many admissions waited for a token, how many were a job's second or later,
    and the most first claims within one second, are reported."""
    name = "group rate: admissions follow the group's token bucket and wait for their token"
    if not e.groups or e.admissions is None:
        return Check(name, True, NO_GROUPS if not e.groups else "no admission log recorded")
    logged = admissions_by_job(e)
    problems: list[str] = []
    parts: list[str] = []
    for group in sorted(g for g, rate in e.group_rates.items() if rate):
        rate = float(e.group_rates[group] or 0.0)
        rows = [a for a in e.admissions if a.group == group and a.kind == ADMITTED]
        dues = sorted(a.due if a.due is not None else a.at for a in rows)
        worst = (0.0, 0, 0.0)  # (excess, tokens, window)
        for j, last in enumerate(dues):
            for i in range(j):
                excess = (j - i + 1) - (rate * (last - dues[i]) + 1)
                if excess > 1e-6 and excess > worst[0]:
                    worst = (excess, j - i + 1, last - dues[i])
        if worst[1]:
            problems.append(
                f"{group} ({rate:g}/s): {worst[1]} admissions' tokens within {worst[2]:.3f} s "
                f"(at most {rate * worst[2] + 1:.2f})"
            )
        early = []
        again = 0
        for job_id in sorted(j for j, g in e.groups.items() if g == group):
            job, claims = e.jobs.get(job_id), claims_of(e, job_id)
            spans = [(a, end) for a, end in admitted_spans(e, job_id, logged.get(job_id, []))]
            again += sum(1 for a, _ in spans[1:] if a.kind == ADMITTED)
            for n, (a, end) in enumerate(spans):
                if a.kind != ADMITTED:
                    continue
                if e.history is not None:
                    claim = next((c for c in claims if a.at <= c < end), None)
                elif n == 0 and job is not None:
                    claim = job.started_at
                else:
                    continue
                due = a.due if a.due is not None else a.at
                if claim is not None and claim < due - RATE_ALLOWANCE:
                    early.append(f"{job_id}: claimed at {claim:.3f}, token {due:.3f}")
        problems += [f"{group}: {problem}" for problem in early]
        waited = sum(1 for a in rows if a.due is not None and a.due > a.at + 1e-3)
        starts = sorted(
            job.started_at
            for j, g in e.groups.items()
            if g == group and (job := e.jobs.get(j)) is not None and job.started_at is not None
        )
        busiest = max(
            (sum(1 for s in starts[n:] if s < start + 1.0) for n, start in enumerate(starts)),
            default=0,
        )
        e.figures[f"group_{group}_admissions"] = len(rows)
        e.figures[f"group_{group}_readmissions"] = again
        e.figures[f"group_{group}_waited_for_token"] = waited
        parts.append(
            f"{group} ({rate:g}/s): {len(rows)} admissions ({again} of a job admitted before), "
            f"{waited} waited for a token, at most {busiest} first claims within 1 s, "
            f"{len(early)} claimed before their token"
        )
    e.figures["group_rate_problems"] = len(problems)
    text = ("; ".join(parts) or "no group with a rate") + f"; {len(problems)} problems"
    for problem in problems[:4]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)


def unadmitted_claims(e: Evidence, job_id: str, rows: list[Admission]) -> list[float]:
    """The claims of job ``job_id`` (the state log) that no admission of their own let in:
    each claim takes the place of the job's last admission or start by claim logged at or
    before it, unless a return to the queue or an earlier claim took it first."""
    events = sorted(
        [(a.at, 0, a.kind) for a in rows] + [(at, 1, "claim") for at in claims_of(e, job_id)],
        key=lambda event: (event[0], event[1]),
    )
    placed, found = False, []
    for at, is_claim, kind in events:
        if not is_claim:
            placed = kind != RELEASED
        elif placed:
            placed = False
        else:
            found.append(at)
    return found


def retried_at(e: Evidence, job_id: str) -> float | None:
    """When job ``job_id`` committed the checkpoint after which it asked for its retry (the
    checkpoint log), None if it did not."""
    for row in e.checkpoints:
        state = json.loads(row.checkpoint) if row.job_id == job_id and row.checkpoint else None
        if isinstance(state, dict) and state.get(RETRY_MARK):
            return row.at
    return None


def _grouped_jobs(e: Evidence) -> Check:
    """No grouped job lost: every one ended, done (admitted first: an admission logged before
    its first claim) or as its control decided; none left waiting for its admission or live.
    Every start is an admission's: each claim of a grouped job (the state log) takes an
    admission of its own, made since the job's last claim or return to its group's queue (a
    retry, a hand-back, an expired lease); only a job sent by name starts by its claim. Its
    units are the exactly-once check's. How long jobs waited for their admission (from the
    row's insert, the state log), how many were sent by name, and how many asked for a retry
    and were admitted again after it, are reported."""
    name = "no grouped job lost: every grouped job admitted and ended done or as decided"
    if not e.groups:
        return Check(name, True, NO_GROUPS)
    admitted = admissions_by_job(e)
    by_job = controls_by_job(e)
    problems: list[str] = []
    states: Counter[str] = Counter()
    waits: list[float] = []
    inserted: dict[str, float] = {}
    asked = readmitted = 0
    for row in e.history or []:
        inserted.setdefault(row.job_id, row.at)
    for job_id in sorted(e.groups):
        job = e.jobs.get(job_id)
        group = e.groups[job_id]
        states[job.state if job else "lost"] += 1
        rows = admitted.get(job_id, [])
        first = next((a for a in rows if a.kind != RELEASED), None)
        if first is not None and job_id in inserted:
            waits.append(first.at - inserted[job_id])
        retry = retried_at(e, job_id) if job_id in e.group_retries else None
        if retry is not None:
            asked += 1
            readmitted += any(a.kind == ADMITTED and a.at > retry for a in rows)
        if job is None:
            if not lost_by_the_broker(e, job_id):
                problems.append(f"{job_id}: no row (lost)")
        elif job.state in LIVE:
            what = "waiting for its admission" if first is None else "admitted, still live"
            problems.append(f"{job_id} ({group}): {job.state}, {what}")
        elif job.state not in allowed_ends(e, job_id, by_job.get(job_id, [])):
            problems.append(f"{job_id} ({group}): ended {job.state}")
        elif e.admissions is not None and job.started_at is not None and first is None:
            problems.append(f"{job_id} ({group}): ran, never admitted")
        elif (
            job.started_at is not None
            and first is not None
            and first.kind == ADMITTED
            and job.started_at < first.at
        ):
            # (A start by claim is its own admission: one statement sets both times, reading
            # the clock for each, so its started_at may precede its admitted_at by microseconds.)
            problems.append(
                f"{job_id} ({group}): claimed at {job.started_at:.3f}, admitted at {first.at:.3f}"
            )
        if job_id not in e.by_name and any(a.kind == CLAIMED for a in rows):
            problems.append(
                f"{job_id} ({group}): started by its claim, though a client recorded it"
            )
        if e.admissions is not None and e.history is not None:
            problems += [
                f"{job_id} ({group}): claimed at {at:.3f} with no admission of its own"
                for at in unadmitted_claims(e, job_id, rows)
            ]
    e.figures.update(
        grouped_jobs=len(e.groups),
        grouped_done=states[DONE],
        grouped_by_name=len(e.by_name),
        grouped_retries_asked=asked,
        grouped_retries_readmitted=readmitted,
        grouped_longest_wait=round(max(waits, default=0.0), 2),
        grouped_problems=len(problems),
    )
    text = (
        f"{len(e.groups)} jobs in {len(set(e.groups.values()))} groups: {states[DONE]} done, "
        f"{states[REVOKED] + states[CANCELLED]} revoked or cancelled, {len(e.by_name)} sent by "
        f"name ({sum(1 for j in e.groups if lost_by_the_broker(e, j))} lost by the broker "
        f"before any claim, allowed), {asked} of {len(e.group_retries)} asked for a retry "
        f"({readmitted} admitted again after it), waited for admission up to "
        f"{max(waits, default=0.0):.2f} s; {len(problems)} problems"
    )
    for problem in problems[:4]:
        text += f"\n      {problem}"
    return Check(name, not problems, text)
