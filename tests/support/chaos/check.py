"""The invariants of a chaos run, computed from the jobs table, the unit log and the checkpoint
log once every process is stopped. Each check gives one line with its figures.

A *run* is one execution of a task body: the unit rows sharing a ``run`` value. Each run holds
one claim, so runs of a job are ordered by their token. A unit is *committed* when its row's
``ended_at`` is set.
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


@dataclass(frozen=True)
class JobRow:
    id: str
    state: str
    attempts: int
    token: int
    result: Any
    checkpoint: Any
    error: str | None


@dataclass(frozen=True)
class CheckpointRow:
    """One committed checkpoint write, in commit order (the trigger's serial id)."""

    job_id: str
    token: int
    checkpoint: str | None

    @property
    def next(self) -> int | None:
        state = json.loads(self.checkpoint) if self.checkpoint else None
        return state.get("next") if isinstance(state, dict) else None


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    text: str

    def line(self) -> str:
        return f"  [{'ok' if self.ok else 'FAILED'}] {self.name}: {self.text}"


@dataclass
class Evidence:
    units: int
    #: job id -> mode, for every job submitted
    modes: dict[str, str]
    jobs: dict[str, JobRow]
    table_rows: int
    unit_rows: list[Unit]
    checkpoints: list[CheckpointRow]
    figures: dict[str, Any] = field(default_factory=dict)


def check_all(e: Evidence) -> list[Check]:
    """Every invariant, in the order they are printed; figures also land in ``e.figures``."""
    rows_by_job: dict[str, list[Unit]] = {}
    for row in e.unit_rows:
        rows_by_job.setdefault(row.job_id, []).append(row)
    return [
        _every_job_done(e),
        _exactly_once(e, rows_by_job),
        _at_least_once(e, rows_by_job),
        _fencing(e, rows_by_job),
        _checkpoints(e),
        _table_rows(e),
    ]


def _every_job_done(e: Evidence) -> Check:
    states = Counter(e.jobs[i].state if i in e.jobs else "lost" for i in e.modes)
    wrong = [
        i
        for i in e.modes
        if i in e.jobs and e.jobs[i].state == "done" and e.jobs[i].result != e.units
    ]
    stuck = states["queued"] + states["running"]
    failed = states["failed"] + states["cancelled"]
    done = states["done"] - len(wrong)
    attempts = [e.jobs[i].attempts for i in e.modes if i in e.jobs]
    e.figures.update(
        jobs=len(e.modes),
        done=done,
        stuck=stuck,
        failed=failed,
        lost=states["lost"],
        attempts=sum(attempts),
        max_attempts=max(attempts, default=0),
    )
    text = (
        f"{done}/{len(e.modes)} done, {stuck} stuck, {failed} failed, {states['lost']} lost, "
        f"{len(wrong)} with a wrong result; attempts {sum(attempts)} "
        f"(max {max(attempts, default=0)} for one job)"
    )
    bad = [e.jobs[i] for i in e.modes if i in e.jobs and e.jobs[i].state != "done"][:3]
    for job in bad:
        text += f"\n      {job.id}: {job.state}, attempts {job.attempts}, error {job.error!r}"
    return Check("every job done", done == len(e.modes), text)


def _committed_counts(rows: Iterable[Unit]) -> Counter[int]:
    return Counter(r.unit for r in rows if r.committed)


def _exactly_once(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    ids = [i for i, mode in e.modes.items() if mode == EXACTLY_ONCE]
    once = missing = duplicated = 0
    for job_id in ids:
        counts = _committed_counts(rows_by_job.get(job_id, []))
        done = job_id in e.jobs and e.jobs[job_id].state == "done"
        for unit in range(e.units):
            n = counts.get(unit, 0)
            once += int(n == 1)
            missing += int(n == 0 and done)
            duplicated += max(n - 1, 0)
        duplicated += sum(n for unit, n in counts.items() if not 0 <= unit < e.units)
    expected = len(ids) * e.units
    e.figures.update(eo_units=expected, eo_once=once, eo_missing=missing, eo_duplicated=duplicated)
    return Check(
        "exactly-once: every unit recorded exactly once",
        missing == 0 and duplicated == 0 and once == expected,
        f"{once}/{expected} units of {len(ids)} jobs (missing {missing}, duplicated {duplicated})",
    )


def runs_by_token(rows: list[Unit]) -> list[list[Unit]]:
    """The runs of one job's unit rows, oldest claim first, each in start order."""
    runs: dict[str, list[Unit]] = {}
    for row in sorted(rows, key=lambda r: (r.started_at, r.unit)):
        runs.setdefault(row.run, []).append(row)
    return sorted(runs.values(), key=lambda run: (run[0].token or 0, run[0].started_at))


def _at_least_once(e: Evidence, rows_by_job: dict[str, list[Unit]]) -> Check:
    ids = [i for i, mode in e.modes.items() if mode == AT_LEAST_ONCE]
    recorded = missing = redone_total = redone_max = 0
    interruptions = sum(max(e.jobs[i].attempts - 1, 0) for i in ids if i in e.jobs)
    for job_id in ids:
        rows = rows_by_job.get(job_id, [])
        counts = _committed_counts(rows)
        done = job_id in e.jobs and e.jobs[job_id].state == "done"
        recorded += sum(1 for unit in range(e.units) if counts.get(unit))
        if done:
            missing += sum(1 for unit in range(e.units) if not counts.get(unit))
        seen: set[int] = set()
        for run in runs_by_token(rows):
            committed = {r.unit for r in run if r.committed}
            redone = len(committed & seen)
            redone_total += redone
            redone_max = max(redone_max, redone)
            seen |= committed
    expected = len(ids) * e.units
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
        f"{recorded}/{expected} units of {len(ids)} jobs recorded (missing {missing}); "
        f"redone per interruption: max {redone_max}, total {redone_total} over "
        f"{interruptions} interruptions (attempts after the first)",
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
    done = [i for i in e.modes if i in e.jobs and e.jobs[i].state == "done"]
    final_ok = sum(
        1
        for i in done
        if by_job.get(i)
        and by_job[i][-1].next == e.units
        and e.jobs[i].checkpoint == {"next": e.units}
    )
    e.figures.update(
        checkpoints=len(e.checkpoints),
        checkpoints_backwards=backwards,
        checkpoints_stale_token=stale_token,
        checkpoints_repeated=repeated,
    )
    text = (
        f"{len(e.checkpoints)} checkpoints committed, {backwards} moved backwards, {stale_token} "
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
        f"{e.table_rows} rows, {len(e.modes)} jobs submitted",
    )
