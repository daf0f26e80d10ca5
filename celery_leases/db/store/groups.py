"""The store's operations on job groups: admitting a group's oldest waiting jobs within its
limit and its rate, and the groups an operator or the reaper looks at."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ...errors import CorruptJob
from ...message import Message
from .. import rows
from .base import StoreBase

#: Seconds ahead an admission may take a token of a group's bucket (at least one token's
#: time): the job is published at once with a countdown to it, and its claim waits for it.
RATE_HORIZON = 1.0


@dataclass(frozen=True)
class Admitted:
    """A job just admitted in its group: its message, to publish, and the seconds until it
    may run (its token's time, or its own countdown)."""

    id: str
    message: Message
    due_in: float


@dataclass(frozen=True)
class GroupRow:
    """A group as ``leases groups`` shows it: its limit (None: none), rate (admissions a
    second, None: none), bucket's tokens now, jobs admitted and live, jobs waiting."""

    name: str
    limit: int | None
    rate: float | None
    tokens: float
    admitted: int
    waiting: int


class Groups(StoreBase):
    """Admitting the jobs of groups."""

    def admit(
        self,
        group: str,
        *,
        limit: int | None = None,
        rate: float | None = None,
        define: bool = False,
        most: int | None = None,
    ) -> list[Admitted]:
        """Admit the oldest waiting jobs of ``group`` (first in, first out) while it has fewer
        than its limit admitted and live, and its bucket has a token due within
        ``RATE_HORIZON`` seconds; at most ``most``. One transaction, the group's row locked
        first: two admissions of a group never overlap, whoever runs them. ``define``: write
        ``limit`` and ``rate`` (None: none) as the group's first (a client recording a job
        of it); else the group's row keeps what the last client wrote."""
        settings = self.settings
        wait = float(settings.queued_timeout or settings.reap_grace)
        if not self._schema_ready:
            self.check_schema()

        def run(c: Connection) -> list[Admitted]:
            return self._admit(c, group, limit, rate, define, most, wait)

        return self.db.run(run, single=False, direct=True)  # type: ignore[no-any-return]

    def _admit(
        self,
        c: Connection,
        group: str,
        limit: int | None,
        rate: float | None,
        define: bool,
        most: int | None,
        wait: float,
    ) -> list[Admitted]:
        sql = self.sql.groups
        named = {"b_group": group}
        if define:
            c.execute(sql.define, named | {"b_limit": limit, "b_rate": rate})
        elif c.execute(sql.lock, named).first() is None:
            return []
        found = c.execute(sql.facts, named).first()
        if found is None:
            return []
        now, limit, rate, tokens, refilled_at, live = found
        now = float(now)
        if rate:  # refilled since it was last counted, at most one token (Celery's bucket)
            tokens = min(1.0, float(tokens) + (now - float(refilled_at)) * float(rate))
        free = math.inf if limit is None else int(limit) - int(live)
        if most is not None:
            free = min(free, most)
        if free <= 0:
            return []
        ids = [r[0] for r in c.execute(sql.oldest_waiting, named | {"b_n": min(free, 1000)}).all()]
        delays: list[float] = []
        tokens = float(tokens)
        for _ in ids:
            delay = 0.0
            if rate:
                delay = max(1.0 - tokens, 0.0) / float(rate)
                if delay > max(RATE_HORIZON, 1.0 / float(rate)) + 1e-9:
                    break
                tokens -= 1.0
            delays.append(delay)
        if not delays:
            return []
        admitted = ids[: len(delays)]
        for job_id, delay in zip(admitted, delays, strict=True):
            due_at = float(now) + delay
            c.execute(sql.admit, {"b_id": job_id, "b_due_at": due_at, "b_wait": wait})
        c.execute(sql.take_tokens, named | {"b_tokens": tokens, "b_at": now})
        order = {job_id: n for n, job_id in enumerate(admitted)}
        out: list[Admitted] = []
        for job_id, text, due_in in c.execute(sql.admitted, {"b_ids": admitted}).all():
            try:
                message = rows.load_message(text, job_id)
            except CorruptJob:
                continue  # the reaper fails it when its wait ends
            out.append(Admitted(job_id, message, max(float(due_in or 0.0), 0.0)))
        return sorted(out, key=lambda a: order[a.id])

    def groups_waiting(self, *, batch: int) -> list[str]:
        """Groups with jobs waiting for their admission, the longest since an admission first
        (a reaper pass admits them round-robin)."""
        with_waiting = self.sql.groups.with_waiting
        found = self._run(lambda c: c.execute(with_waiting, {"b_batch": batch}).all())
        return [r[0] for r in found]

    def groups(self, *, names: list[str] | None = None) -> list[GroupRow]:
        """Every group, or those named ``names``, by name: its limit, rate, tokens now,
        admitted and waiting jobs (``leases groups``, the admin)."""
        sql = self.sql.groups
        if names is None:
            return self._group_rows(sql.listing, {})
        return self._group_rows(sql.listing_of, {"b_names": list(names)}) if names else []

    def busiest_groups(self, n: int) -> list[GroupRow]:
        """The ``n`` groups with the most jobs waiting, then admitted (the metrics')."""
        return self._group_rows(self.sql.groups.busiest, {"b_n": n})

    def count_groups(self) -> int:
        """How many groups there are."""
        return int(self._run(lambda c: c.execute(self.sql.groups.count).scalar_one()))

    def _group_rows(self, statement: Any, values: dict[str, Any]) -> list[GroupRow]:
        found: Any = self._run(lambda c: c.execute(statement, values).all())
        return [
            GroupRow(
                name,
                None if limit is None else int(limit),
                None if rate is None else float(rate),
                float(tokens),
                int(admitted),
                int(waiting),
            )
            for name, limit, rate, tokens, admitted, waiting in found
        ]


__all__ = ["RATE_HORIZON", "Admitted", "GroupRow", "Groups"]
