"""Reading several leases databases as one: what each answered, merged, and a warning for each
that did not (``list``, ``watch``, ``groups``, ``purge``, ``init-db``, ``upgrade``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import heartbeat
from ..db import Store
from ..db.rows import Job, StateCounts
from ..errors import LeaseError, StoreUnavailable

T = TypeVar("T")


def ask(
    stores: Sequence[tuple[str, Store]], read: Callable[[Store], T]
) -> tuple[list[tuple[str, T]], list[str]]:
    """``read`` of each database: (name, answer) of those that answered, and a warning for
    each that did not. The error itself when none did (the only one's, as without routes)."""
    answers: list[tuple[str, T]] = []
    failed: list[tuple[str, LeaseError]] = []
    for name, store in stores:
        try:
            answers.append((name, read(store)))
        except LeaseError as exc:
            failed.append((name, exc))
    if failed and not answers:
        if len(failed) == 1:
            raise failed[0][1]
        raise StoreUnavailable(
            "no leases database answered: " + "; ".join(f"{name}: {exc}" for name, exc in failed)
        )
    return answers, [f"database {name} did not answer: {exc}" for name, exc in failed]


@dataclass
class Listing:
    """The newest jobs of one or more databases, newest first (each database's clock)."""

    jobs: list[Job]
    #: The database of each job, in the same order.
    databases: list[str]
    #: Jobs by state, summed over the databases that answered (None: not asked).
    counts: StateCounts | None
    #: What to warn: the reaper's silences (each once), then the databases that did not
    #: answer (``unanswered`` of them).
    warnings: list[str]
    unanswered: int = 0


def read_jobs(
    app: Any,
    stores: Sequence[tuple[str, Store]],
    *,
    limit: int,
    count_cap: int | None,
    states: Iterable[str] = (),
    task: str | None = None,
    group: str | None = None,
) -> Listing:
    """The newest ``limit`` jobs of ``stores`` together (filtered as ``Store.list_jobs``),
    and their states counted up to ``count_cap`` when it is given."""
    states = tuple(states)

    def read(store: Store) -> tuple[list[Job], StateCounts | None, str | None]:
        jobs = store.list_jobs(states=states, task=task, group=group, limit=limit)
        counts = None if count_cap is None else store.count_states(cap=count_cap)
        return jobs, counts, reaper_warning(app, store)

    answers, silent = ask(stores, read)
    newest = sorted(
        ((job, name) for name, (jobs, _, _) in answers for job in jobs),
        key=lambda pair: pair[0].created_at,
        reverse=True,
    )[:limit]
    counts = [c for _, (_, c, _) in answers if c is not None]
    return Listing(
        jobs=[job for job, _ in newest],
        databases=[name for _, name in newest],
        counts=summed(counts) if count_cap is not None else None,
        warnings=[*dict.fromkeys(w for _, (_, _, w) in answers if w), *silent],
        unanswered=len(silent),
    )


def summed(counts: Sequence[StateCounts]) -> StateCounts:
    """The counts of several databases added up; a state capped in any is capped."""
    total: dict[str, int] = {}
    for found in counts:
        for state, n in found.counts.items():
            total[state] = total.get(state, 0) + n
    return StateCounts(total, frozenset().union(*(c.capped for c in counts)))


def reaper_warning(app: Any, store: Store) -> str | None:
    """The warning to show when no reaper pass happened for a while (``heartbeat.silence``);
    None when one did, or when the table cannot say."""
    try:
        return heartbeat.silence(app, store)
    except LeaseError:
        return None


__all__ = ["Listing", "ask", "read_jobs", "reaper_warning", "summed"]
