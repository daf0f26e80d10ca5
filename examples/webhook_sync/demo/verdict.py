"""The demo's verdict: each check computed from the data (the synced table, the leases table, the
receiver's deliveries, the upstream's counters), never from what the demo printed."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import sqlalchemy as sa

from celery_leases import Job
from celery_leases.db.schema import jobs_table

from .. import deliveries, sink
from .upstream import generate_events


@dataclass
class Delivered:
    """A webhook the demo delivered, and the receiver's answer."""

    delivery_id: str
    status: int
    answer: Any
    #: The database clock just after the answer (epoch seconds).
    at_db: float

    @property
    def job(self) -> str | None:
        found = self.answer.get("job") if isinstance(self.answer, dict) else None
        return None if found is None else str(found)


@dataclass
class Seen:
    """What the demo did and saw, for the verdict."""

    sync_id: str = ""
    followup_id: str = ""
    #: The webhooks of the burst, the first one (that started the sync) included.
    burst: list[Delivered] = field(default_factory=list)
    retried: Delivered | None = None
    forged: Delivered | None = None
    started_sync: float = 0.0
    victim: str = ""
    killed_at_wall: float | None = None
    killed_at_db: float | None = None
    checkpoint_at_kill: dict[str, Any] = field(default_factory=dict)
    attempts_at_kill: int = 0
    resumed_by: str = ""
    resumed_at_db: float | None = None
    #: Each job as it ended.
    final: dict[str, Job] = field(default_factory=dict)


Check = tuple[bool, str]


def judge(
    example: ModuleType,
    seen: Seen,
    stats: dict[str, Any],
    *,
    account: str,
    seed: str,
    events: int,
    added: int,
) -> list[Check]:
    """The checks of a demo run that synced the ``events`` events of ``account`` (from the
    upstream's ``seed``), then ``added`` more that arrived during the sync."""
    engine = sink.engine(example.DATABASE)
    sync, followup = seen.final.get(seen.sync_id), seen.final.get(seen.followup_id)
    jobs = jobs_of_key(engine, example, f"account:{account}")
    return [
        stored_once(engine, example, stats, account, seed, events + added),
        one_sync_one_followup(seen, jobs),
        one_at_a_time(sync, followup),
        after_the_burst(seen, followup),
        retried_once(engine, example, seen, jobs),
        forged_refused(engine, example, seen, jobs),
        resumed(seen, stats),
        followup_from_the_cursor(sync, followup, events, added),
        fetched_again(stats),
    ]


def stored_once(
    engine: Any, example: ModuleType, stats: dict[str, Any], account: str, seed: str, total: int
) -> Check:
    ids = sink.stored_ids(engine, example.EVENTS, account)
    expected = {e["id"] for e in generate_events(seed, account, total)}
    stored = set(ids)
    missing, unknown = len(expected - stored), len(stored - expected)
    upstream = stats.get("accounts", {}).get(account)
    ok = len(ids) == len(stored) == len(expected) == upstream and not missing and not unknown
    return ok, (
        f"every event stored exactly once: {len(ids):,} rows, {len(stored):,} distinct ids, "
        f"{upstream or 0:,} upstream, {missing} missing"
    )


def jobs_of_key(engine: Any, example: ModuleType, key: str) -> list[str]:
    """The ids of every job of lease key ``key`` in the leases table."""
    table = jobs_table(sa.MetaData(), example.LEASES_TABLE)
    with engine.connect() as connection:
        query = sa.select(table.c.id).where(table.c.lease_key == key).order_by(table.c.created_at)
        return [str(job_id) for job_id in connection.scalars(query)]


def one_sync_one_followup(seen: Seen, jobs: list[str]) -> Check:
    answered = [d.job for d in seen.burst if d.status == 202]
    served = sorted(set(filter(None, answered)), key=answered.index)
    expected = [seen.sync_id, seen.followup_id]
    ok = (
        len(answered) == len(seen.burst)
        and served == expected == jobs
        and all(seen.final.get(j) is not None and seen.final[j].state == "done" for j in jobs)
    )
    counts = ", ".join(f"{short(j)} x{answered.count(j)}" for j in served)
    states = ", ".join(
        f"{short(j)} {seen.final[j].state if j in seen.final else '?'}" for j in jobs
    )
    return ok, (
        f"{len(seen.burst)} webhooks, one sync and one follow-up: answered {counts}; the "
        f"account's jobs in the leases table: {states}"
    )


def one_at_a_time(sync: Job | None, followup: Job | None) -> Check:
    if sync is None or followup is None or sync.finished_at is None or not followup.claimed_at:
        return False, "never two runs at once: a job did not end"
    gap = followup.claimed_at - sync.finished_at
    return gap >= 0, (
        f"never two runs at once: the follow-up was claimed {gap:.2f} s after the sync "
        "ended (DB clock)"
    )


def after_the_burst(seen: Seen, followup: Job | None) -> Check:
    if followup is None or not followup.claimed_at or not seen.burst:
        return False, "the follow-up started after the last webhook: it never started"
    gap = followup.claimed_at - seen.burst[-1].at_db
    return gap > 0, (
        f"the follow-up started after the last webhook of the burst: {gap:.2f} s after (DB clock)"
    )


def retried_once(engine: Any, example: ModuleType, seen: Seen, jobs: list[str]) -> Check:
    retry = seen.retried
    if retry is None:
        return False, "a provider's retry of a delivery: not sent"
    recorded = deliveries.count(engine, example.DELIVERIES, retry.delivery_id)
    duplicate = isinstance(retry.answer, dict) and retry.answer.get("duplicate") is True
    first = next((d for d in seen.burst if d.delivery_id == retry.delivery_id), None)
    ok = (
        retry.status == 200
        and duplicate
        and recorded == 1
        and first is not None
        and retry.job == first.job
        and len(jobs) == 2
    )
    return ok, (
        f"a provider's retry of {retry.delivery_id}, once the account was idle: answered "
        f"{retry.status}{' (a duplicate)' if duplicate else ''}, recorded {recorded} time(s), "
        f"the account still has {len(jobs)} jobs"
    )


def forged_refused(engine: Any, example: ModuleType, seen: Seen, jobs: list[str]) -> Check:
    forged = seen.forged
    if forged is None:
        return False, "a delivery with a bad signature: not sent"
    recorded = deliveries.count(engine, example.DELIVERIES, forged.delivery_id)
    error = forged.answer.get("error") if isinstance(forged.answer, dict) else forged.answer
    return forged.status == 401 and recorded == 0 and len(jobs) == 2, (
        f"a delivery signed with another secret: answered {forged.status} ({error}), recorded "
        f"{recorded} time(s), the account still has {len(jobs)} jobs"
    )


def resumed(seen: Seen, stats: dict[str, Any]) -> Check:
    if seen.killed_at_wall is None:
        return False, "resumed after the kill: the sync ended before the kill"
    if not (seen.resumed_by and seen.resumed_at_db and seen.killed_at_db):
        return False, f"resumed after the kill of {seen.victim}: never"
    served_after = [
        t for page in stats["pages"] for t in page["fetched_at"] if t > seen.killed_at_wall
    ]
    text = f"resumed on {seen.resumed_by} after the kill of {seen.victim}: claimed "
    text += f"{seen.resumed_at_db - seen.killed_at_db:.2f} s later (DB clock)"
    if served_after:
        text += f", next page {min(served_after) - seen.killed_at_wall:.2f} s later"
    return seen.resumed_by != seen.victim, text


def followup_from_the_cursor(
    sync: Job | None, followup: Job | None, events: int, added: int
) -> Check:
    first = sync.result if sync is not None and isinstance(sync.result, dict) else {}
    then = followup.result if followup is not None and isinstance(followup.result, dict) else {}
    ok = (
        first.get("events") == events
        and then.get("events") == added
        and then.get("started_after") is not None
        and then.get("started_after") == first.get("ended_after")
    )
    return ok, (
        f"the follow-up synced only the new events: {then.get('events', 0):,} in "
        f"{then.get('pages', 0)} page(s), from the cursor the sync ({first.get('events', 0):,} "
        f"events) left, {then.get('started_after')}"
    )


def fetched_again(stats: dict[str, Any]) -> Check:
    again = stats["pages_served_more_than_once"]
    extra = sum(page["served"] - 1 for page in again)
    which = ", ".join(f"page {page['page']} x{page['served']}" for page in again)
    return extra <= 1, (
        f"pages fetched again: {extra}" + (f" ({which})" if which else "") + ", at most 1 expected"
    )


def short(job_id: str | None) -> str:
    return (job_id or "-")[:8]
