"""The store's operations on job groups: admitting a group's oldest waiting jobs within its
limit and its rate, and the groups an operator or the reaper looks at."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ...errors import CorruptJob
from ...message import Message
from .. import rows
from .base import CLOCK_SLACK, RATE_HORIZON, Limits, StoreBase, token_horizon

logger = logging.getLogger("celery_leases")


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


class GroupOps(StoreBase):
    """Admitting the jobs of groups."""

    def admit(
        self,
        group: str,
        *,
        limits: Limits | None = None,
        define: bool = False,
        most: int | None = None,
    ) -> list[Admitted]:
        """Admit the oldest waiting jobs of ``group`` that are due (first in, first out) while
        it has fewer than its limit admitted and live, and its bucket has a token due within
        ``RATE_HORIZON`` seconds; at most ``most``. One transaction, the group's row locked
        first: two admissions of a group never overlap, whoever runs them.

        ``limits``: the group's (limit, rate) as the caller knows them (None: none). With
        ``define`` they become the group's (a client recording a job of it writes what its
        call says); without, they make the group's row only where it has none (a group whose
        jobs no client recorded), and an existing row keeps its own. Without ``limits``, a
        group with no row admits nothing."""
        settings = self.settings
        wait = float(settings.queued_timeout or settings.reap_grace)
        if not self._schema_ready:
            self.check_schema()

        def run(c: Connection) -> list[Admitted]:
            return self._admit(c, group, limits, define, most, wait)

        return self.db.run(run, single=False, direct=True)  # type: ignore[no-any-return]

    def define_group(self, group: str, limits: Limits, *, define: bool = True) -> None:
        """Write ``limits`` as group ``group``'s (``define``), or make its row with them if it
        has none; one statement. A client does it before it records a job of the group, so
        that no waiting job is ever left without its group's row."""
        sql = self.sql.groups
        params = {"b_group": group, "b_limit": limits[0], "b_rate": limits[1]}
        stmt = sql.define if define else sql.ensure
        self._hot(lambda c: self.dialect.upserted(c, stmt, params))

    def _admit(
        self,
        c: Connection,
        group: str,
        limits: Limits | None,
        define: bool,
        most: int | None,
        wait: float,
    ) -> list[Admitted]:
        sql = self.sql.groups
        named = {"b_group": group}
        if limits is not None:
            params = named | {"b_limit": limits[0], "b_rate": limits[1]}
            c.execute(sql.define if define else sql.ensure, params)
        elif c.execute(sql.lock, named).first() is None:
            return []
        found = c.execute(sql.facts, named).first()
        if found is None:
            return []
        now, limit, rate, tokens, refilled_at, live = found
        now, tokens, refilled_at = float(now), float(tokens), float(refilled_at)
        if refilled_at > now + CLOCK_SLACK:
            logger.warning(
                "group %s: the database clock stepped back %.3f s behind its bucket's last "
                "count; its bucket refills from now on",
                group,
                refilled_at - now,
            )
            refilled_at = now
        if rate:  # refilled since it was last counted, at most one token (Celery's bucket)
            tokens = min(1.0, tokens + max(now - refilled_at, 0.0) * float(rate))
        free = math.inf if limit is None else int(limit) - int(live)
        if most is not None:
            free = min(free, most)
        if free <= 0:
            return []
        ids = [r[0] for r in c.execute(sql.oldest_waiting, named | {"b_n": min(free, 1000)}).all()]
        delays: list[float] = []
        for _ in ids:
            delay = 0.0
            if rate:
                delay = max(1.0 - tokens, 0.0) / float(rate)
                if delay > token_horizon(float(rate)) + 1e-9:
                    break
                tokens -= 1.0
            delays.append(delay)
        if not delays:
            return []
        admitted = ids[: len(delays)]
        for job_id, delay in zip(admitted, delays, strict=True):
            due_at = now + delay
            c.execute(sql.admit, {"b_id": job_id, "b_due_at": due_at, "b_wait": wait})
        c.execute(sql.take_tokens, named | {"b_tokens": tokens, "b_at": max(now, refilled_at)})
        order = {job_id: n for n, job_id in enumerate(admitted)}
        out: list[Admitted] = []
        for job_id, text, due_in in c.execute(sql.admitted, {"b_ids": admitted}).all():
            try:
                message = rows.load_message(text, job_id)
            except CorruptJob:
                continue  # the reaper fails it when its wait ends
            out.append(Admitted(job_id, message, max(float(due_in or 0.0), 0.0)))
        return sorted(out, key=lambda a: order[a.id])

    def groups_with_room(self, *, batch: int) -> list[str]:
        """Groups an admission would admit a job of now (a waiting job due, room under the
        limit, a token within ``RATE_HORIZON``), the longest since an admission first: a
        reaper pass admits them round-robin, and never reads a full group in vain."""
        with_room = self.sql.groups.with_room
        params = {"b_batch": batch, "b_horizon": RATE_HORIZON}
        found = self._run(lambda c: c.execute(with_room, params).all())
        return [r[0] for r in found]

    def orphan_groups(self, *, batch: int) -> list[tuple[str, str]]:
        """(group, task) of waiting jobs whose group has no row (left by an earlier release):
        up to ``batch`` groups, each with the name of a task of its waiting jobs."""
        orphans = self.sql.groups.orphans
        found = self._run(lambda c: c.execute(orphans, {"b_batch": batch}).all())
        return [(str(group), str(task)) for group, task in found]

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


__all__ = [
    "CLOCK_SLACK",
    "RATE_HORIZON",
    "Admitted",
    "GroupOps",
    "GroupRow",
    "Limits",
    "token_horizon",
]
