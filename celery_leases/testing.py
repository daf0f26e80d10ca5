"""Test that your own LeasedTask resumes correctly after a crash, without workers or Docker.

:func:`run_with_crashes` runs the task eagerly, in this process, against the app's real
leases database; the attempt "dies" right after its Nth checkpoint is saved (it raises
:class:`SimulatedCrash`, a ``BaseException`` that your ``except Exception`` will not catch,
and keeps its lease like a killed process would). The lease is then expired in the database
and the task runs again, resuming from the checkpoint, until it finishes.

:func:`assert_resumable` compares a run with crashes against a run without: the same result
and the same sequence of committed checkpoints. A task that ignores ``self.lease.checkpoint``
and starts over, or skips work, fails it.

A resume is judged by what committed: a checkpoint written inside the caller's transaction (a
Django ``transaction.atomic()`` block on the leases' database, ``connection=``) is rolled back
with it by the crash that follows it, as when a process is killed before its commit, and the
next attempt resumes from the checkpoint before. Such a checkpoint is in
:attr:`CrashRun.rolled_back`, not in :attr:`CrashRun.checkpoints`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.utils import uuid

from . import lifecycle
from .db.joined import ambient
from .db.rows import Job, dumps
from .errors import ConfigurationError
from .lease import Lease
from .signals import checkpoint_saved

__all__ = ["CrashRun", "SimulatedCrash", "assert_resumable", "run_with_crashes"]


class SimulatedCrash(BaseException):
    """The attempt died here, as if its process was killed right after the checkpoint.

    A BaseException that is not SystemExit: the attempt keeps its lease, as a killed process
    would, and ``except Exception`` in the task does not catch it.
    """


@dataclass
class CrashRun:
    """What happened across the attempts of one job."""

    job_id: str
    result: Any
    attempts: int
    #: Every checkpoint that committed, in order, across all attempts.
    checkpoints: list[Any] = field(default_factory=list)
    #: The checkpoints written, then rolled back with the caller's transaction by a crash.
    rolled_back: list[Any] = field(default_factory=list)
    #: For each attempt, the checkpoint it started from (None for a fresh start).
    resumed_from: list[Any] = field(default_factory=list)
    job: Job | None = None


def run_with_crashes(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    crash_after: Iterable[int] = (1,),
    job_id: str | None = None,
    max_attempts: int = 100,
) -> CrashRun:
    """Run ``task`` to the end, crashing attempt i after its ``crash_after[i]``-th checkpoint.

    ``crash_after=(2, 1)`` kills the first attempt after its 2nd checkpoint and the second
    attempt after its 1st; later attempts run to the end. The task's exception, if the last
    attempt raises one, propagates.
    """
    job_id = job_id or uuid()
    plan = list(crash_after)
    run = CrashRun(job_id=job_id, result=None, attempts=0)
    written: list[Any] = []  # this attempt's checkpoints, committed or not

    def on_checkpoint(sender: Any, lease: Lease, **_: Any) -> None:
        if sender.name != task.name:
            return
        written.append(lease.checkpoint)
        index = run.attempts - 1
        if index < len(plan) and len(written) == plan[index]:
            raise SimulatedCrash(f"simulated crash after checkpoint {len(written)}")

    store = task.lease_store
    if ambient(store) is not None:
        raise ConfigurationError(
            f"run_with_crashes({task.name}) runs inside a transaction on the leases database "
            f"(a Django TestCase's, pytest-django's django_db without transaction=True): its "
            f"attempts would never commit, and a crash could not be told from a rollback. Run "
            f"it in a TransactionTestCase, or with @pytest.mark.django_db(transaction=True)"
        )
    checkpoint_saved.connect(on_checkpoint, weak=False)
    try:
        while run.attempts < max_attempts:
            before = store.get(job_id)
            run.resumed_from.append(before.checkpoint if before is not None else None)
            run.attempts += 1
            written.clear()
            try:
                outcome = task.apply(args=list(args), kwargs=kwargs or {}, task_id=job_id)
            except SimulatedCrash:
                _committed(run, written, store.get(job_id))
                lifecycle.end_lease(store, job_id)
                continue
            run.checkpoints.extend(written)
            run.result = outcome.get(propagate=True, disable_sync_subtasks=False)
            break
        else:
            raise AssertionError(f"job {job_id} did not finish in {max_attempts} attempts")
    finally:
        checkpoint_saved.disconnect(on_checkpoint)
    run.job = store.get(job_id)
    return run


def _committed(run: CrashRun, written: list[Any], job: Job | None) -> None:
    """Sort a crashed attempt's checkpoints ``written`` into the run's committed and rolled
    back ones: those up to the one the job holds now committed (the job's checkpoint is the
    last that did), the rest rolled back with the caller's transaction."""
    stored = None if job is None else job.checkpoint
    kept = 0
    for index, checkpoint in enumerate(written):
        if checkpoint == stored:
            kept = index + 1
    run.checkpoints.extend(written[:kept])
    run.rolled_back.extend(written[kept:])


def assert_resumable(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    crash_after: Iterable[int] = (1,),
    reset: Callable[[], None] | None = None,
    compare_result: bool = True,
) -> CrashRun:
    """Assert that crashing ``task`` and resuming it has the same outcome as not crashing it.

    Runs the task once without a crash and once with ``crash_after`` crashes (calling
    ``reset()`` before each run to clear your own side effects), then checks that both runs
    committed the same sequence of checkpoints (a checkpoint rolled back with its
    ``atomic()`` block by the crash does not count) and returned the same result. For a task with a
    lease key, both runs start from the key's cursor as it was before the first one (it is
    set back in between), and must leave the same cursor.
    """
    store = task.lease_store
    key = task.key_for(list(args), kwargs or {})

    def key_cursor() -> Any:
        return None if key is None else store.cursor(key)

    if reset is not None:
        reset()
    cursor = key_cursor()
    reference = run_with_crashes(task, args, kwargs, crash_after=())
    reference_cursor = key_cursor()
    set_back = None if cursor is None else dumps(cursor)
    if key is not None and not store.set_cursor(key, set_back):
        raise AssertionError(f"lease key {key!r} is held by a job: its cursor was not set back")
    if reset is not None:
        reset()
    crashed = run_with_crashes(task, args, kwargs, crash_after=crash_after)
    if crashed.checkpoints != reference.checkpoints:
        raise AssertionError(
            f"{task.name} does not resume from its checkpoint: without a crash it committed "
            f"the checkpoints {_short(reference.checkpoints)}, with crashes after checkpoints "
            f"{list(crash_after)} it committed {_short(crashed.checkpoints)} "
            f"(attempts started from {_short(crashed.resumed_from)})"
        )
    if compare_result and crashed.result != reference.result:
        raise AssertionError(
            f"{task.name} returned {crashed.result!r} after crashes, {reference.result!r} without"
        )
    crashed_cursor = key_cursor()
    if crashed_cursor != reference_cursor:
        raise AssertionError(
            f"{task.name} left the cursor of {key!r} at {crashed_cursor!r} after crashes, "
            f"{reference_cursor!r} without"
        )
    return crashed


def _short(values: list[Any], limit: int = 12) -> str:
    text = ", ".join(repr(v) for v in values[:limit])
    return f"[{text}{', ...' if len(values) > limit else ''}]"
