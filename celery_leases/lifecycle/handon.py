"""What follows a job's end, decided in one place whatever ended it: the triggers waiting on its
lease key settled (served, or a follow-up run started), the next jobs of its group admitted,
and the result backend told of ends no attempt recorded.

Every end calls :func:`hand_on` with what it knows (:class:`Ended`): an attempt's finish,
failure, stop or replace, a hand-back that met a cancel, an operator's cancel, Celery's revoke in
a worker's main process, a superseded job, the reaper's expiries and give-ups. Each step is a
statement or a transaction of its own after the end's, and a step that fails is logged, never
raised: the reaper's pass (:func:`catch_up`) does what any end left undone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .. import groups, metrics
from ..db.store.base import Limits
from ..db.store.groups import Admitted
from ..errors import ArgumentsError
from ..message import Message
from ..notice import announce_pending

logger = logging.getLogger("celery_leases")


@dataclass(frozen=True)
class Ended:
    """A job that ended, or gave up its place in its group (a hand-back of a job of a group
    waits for a new admission), and what that hands on.

    ``key``: its lease key, whose waiting triggers are settled. ``group``: the group it held
    a place in, whose next due jobs are admitted (``task``: its task, whose options give the
    group's limits where the group has no row yet). ``connection``: the transaction of the
    caller it ended in (an attempt that started inside one): the key is settled in it, and
    the group is left to its next end or the reaper (its admission would wait on that
    transaction's locks). ``notices``: it ended outside any attempt, and the result backend
    is to be told (``notice.announce_pending``)."""

    key: str | None = None
    group: str | None = None
    task: str | None = None
    connection: Any = None
    notices: bool = False


def hand_on(app: Any, store: Any, ended: Ended) -> None:
    """Do what ``ended`` hands on: settle its key, admit its group's next jobs, tell the result
    backend. Never raises: what fails is the reaper's to do."""
    if ended.key is not None:
        settle(app, store, ended.key, connection=ended.connection)
    if ended.group is not None and ended.connection is None:
        admit(app, store, ended.group, task=ended.task)
    if ended.notices:
        announce(app, store)


def announce(app: Any, store: Any) -> list[str]:
    """Tell the result backend of the ends no attempt recorded (one batch); a failure is the
    reaper's to retry."""
    try:
        return announce_pending(app, store, batch=store.settings.reap_batch, max_batches=1)
    except Exception as exc:
        logger.error("cannot tell the result backend of ended jobs (the reaper will): %r", exc)
        return []


def limits_of(app: Any) -> Any:
    """``limits(task, group)``: a group's (limit, rate) as ``task``'s options give them in
    ``app`` (``lease_group_limit``, ``lease_group_rate``), or None where ``app`` does not know
    the task: for the row of a group no client has recorded a job of (sent by name, a key's
    follow-up, an operator's retry)."""

    def limits(task_name: str, group: str) -> Limits | None:
        task = app.tasks.get(task_name)
        if task is None or not getattr(task, "__celery_leases__", False):
            return None
        try:
            return (
                groups.limit_of(task.lease_group_limit, group),
                groups.rate_of(task.lease_group_rate),
            )
        except ArgumentsError as exc:
            logger.error("group %s: %s", group, exc)
            return None

    return limits


def settle(app: Any, store: Any, key: str, *, connection: Any = None) -> bool:
    """Settle the triggers waiting on ``key`` (``Store.settle``) now that no job holds it:
    start the run recorded for them (published, due after a debounce's quiet; a run of a
    group waits for its admission), or tell their callers the end of the run that served
    them; True when they were settled."""
    try:
        settled = store.settle(key, connection=connection, limits=limits_of(app))
        followup = settled.followup
        if followup is not None and followup.group is not None and settled.due_in <= 0:
            # Waiting in its group: its admission publishes it.
            admit(app, store, followup.group, task=followup.task)
        elif followup is not None:
            # Due now, or its message comes when it is due (a debounce's quiet), and asks for
            # its admission then if it has a group.
            followup.send(app, countdown=settled.due_in or None)
            logger.info(
                "lease key %s: the triggers that waited on it run as job %s%s",
                key,
                followup.id,
                f", in {settled.due_in:.2f} s" if settled.due_in > 0 else "",
            )
        if settled.served:
            announce(app, store)
    except Exception as exc:
        logger.error(
            "lease key %s: could not settle the triggers waiting on it (the reaper will): %r",
            key,
            exc,
        )
        return False
    return settled.followup is not None or settled.served


def admit(
    app: Any,
    store: Any,
    group: str,
    *,
    task: str | None = None,
    most: int | None = None,
    limits: Limits | None = None,
    define: bool = False,
) -> list[Admitted]:
    """Admit the oldest due waiting jobs of ``group`` its limit and bucket allow
    (``Store.admit``) and publish them, each with a countdown to its token's time; the jobs
    admitted. ``limits``/``define``: as ``Store.admit`` (a client's call); else ``task``'s
    options give the limits of a group that has no row. A failure is logged, never raised:
    the reaper admits them at its next pass, and a job admitted but not published is
    re-published once its wait has passed."""
    if limits is None and task is not None:
        limits = limits_of(app)(task, group)
    try:
        admitted = store.admit(group, limits=limits, define=define, most=most)
    except Exception as exc:
        logger.error("group %s: could not admit its waiting jobs (the reaper will): %r", group, exc)
        return []
    publish(app, group, admitted)
    return list(admitted)


def publish(app: Any, group: str, admitted: list[Admitted]) -> list[str]:
    """Publish the jobs ``admitted`` in ``group``; the ids sent."""
    sent: list[str] = []
    for job in admitted:
        try:
            job.message.send(app, countdown=job.due_in if job.due_in > 0 else None)
        except Exception as exc:  # admitted: the reaper re-publishes it after its wait
            logger.error("job %s: admitted in group %s, publish failed: %r", job.id, group, exc)
            continue
        sent.append(job.id)
        metrics.count("admitted", task=job.message.task)
        logger.info(
            "job %s: admitted in group %s%s",
            job.id,
            group,
            f", runs in {job.due_in:.2f} s" if job.due_in > 0 else "",
        )
    return sent


def wake(app: Any, message: Message, due_in: float) -> None:
    """Send ``message``, a job of a group that waits unadmitted until it is due (a countdown,
    a debounce, a retry's), for its due time: its claim then finds it waiting and asks for its
    group's admission (:func:`admit`). A lost one is the reaper's: its pass admits due jobs."""
    try:
        message.send(app, countdown=due_in if due_in > 0 else None)
    except Exception as exc:
        logger.error(
            "job %s: waits in group %s until it is due; its message could not be sent (the "
            "reaper admits it when it is due): %r",
            message.id,
            message.group,
            exc,
        )


def admit_round_robin(app: Any, store: Any, *, batch: int) -> list[str]:
    """The reaper's admission: the groups an admission would admit a job of now (a due job
    waiting, room under the limit, a token: full groups are never read in vain), the longest
    since an admission first, one job of each in turn until none admits more; the ids
    published. It serves groups whose job ended where nothing admitted the next (its worker
    died, it ended outside any attempt), and jobs whose due time has come."""
    try:
        waiting = store.groups_with_room(batch=batch)
    except Exception as exc:
        logger.error("cannot read the groups with room: %r", exc)
        return []
    sent: list[str] = []
    for _ in range(batch):
        if not waiting:
            break
        still = []
        for group in waiting:
            try:
                admitted = store.admit(group, most=1)
            except Exception as exc:
                logger.error("group %s: could not admit its waiting jobs: %r", group, exc)
                continue
            if admitted:
                sent += publish(app, group, admitted)
                still.append(group)
        waiting = still
    return sent


def repair_orphans(app: Any, store: Any, *, batch: int) -> list[str]:
    """Make the rows of groups whose waiting jobs have none (an earlier release's: a client
    that died between recording and admitting, a message sent by name) from their task's
    options, and admit them; the ids published."""
    sent: list[str] = []
    try:
        orphans = store.orphan_groups(batch=batch)
    except Exception as exc:
        logger.error("cannot look for groups without a row: %r", exc)
        return sent
    for group, task in orphans:
        limits = limits_of(app)(task, group)
        if limits is None:
            logger.warning(
                "group %s has waiting jobs and no row, and this process does not know task %s "
                "to read its limits: a worker that knows it admits them",
                group,
                task,
            )
            continue
        logger.warning("group %s had waiting jobs and no row: made from %s's options", group, task)
        sent += [job.id for job in admit(app, store, group, limits=limits)]
    return sent


def settle_pending(app: Any, store: Any, *, batch: int) -> list[str]:
    """Settle the triggers waiting on lease keys whose job ended without settling them (its
    attempt died first, it ended outside any, a settle failed), and start the follow-ups
    older releases kept on ended jobs; the keys settled and the jobs started."""
    done = [key for key in store.pending_keys(batch=batch) if settle(app, store, key)]
    for job_id in store.followups_pending(batch=batch):
        started = start_legacy_followup(app, store, job_id)
        if started is not None:
            done.append(started)
    return done


def start_legacy_followup(app: Any, store: Any, job_id: str) -> str | None:
    """Record and send the follow-up a celery-leases before revision 0003 kept on the ended job
    ``job_id``; its id, or None. A failure is logged: the reaper tries again."""
    try:
        followup = store.start_followup(job_id)
        if followup is None:
            return None
        followup.send(app)
    except Exception as exc:
        logger.error("job %s: could not start the follow-up of its key: %r", job_id, exc)
        return None
    logger.info("job %s: ended; the follow-up run of its key is job %s", job_id, followup.id)
    return str(followup.id)


__all__ = [
    "Ended",
    "admit",
    "admit_round_robin",
    "announce",
    "hand_on",
    "limits_of",
    "publish",
    "repair_orphans",
    "settle",
    "settle_pending",
    "start_legacy_followup",
    "wake",
]
