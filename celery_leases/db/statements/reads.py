"""Reading jobs, the clock and the table's revision."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..schema import LIVE_STATES, version_table
from .common import Parts, param

#: Columns a reader never sees (internals of the claim and the key index).
_HIDDEN = ("duration", "schema_version", "followup", "live_key")


class Reads:
    """The statements that read."""

    def __init__(self, p: Parts) -> None:
        t, now = p.table, p.now
        #: The database clock.
        self.now = sa.select(now)
        #: The table's migration revision, read once by a process's first operation.
        self.schema_revision = sa.select(version_table(t.metadata, t.name).c.version_num)
        #: A job as ``rows.job`` reads it: its columns, and its ages by the database clock.
        self.job_columns = [
            *(c for c in t.columns if c.name not in _HIDDEN),
            (p.lease_end - now).label("expires_in"),
            (now - t.c.checkpoint_at).label("checkpoint_age"),
            (now - t.c.created_at).label("age"),
        ]
        #: The job ``b_id``.
        self.job_by_id = self.select_jobs(p.by_id)
        #: Ids starting with ``b_prefix`` (a pattern of ``Dialect.prefix_pattern``), through an
        #: index; maybe also ids in another case.
        self.ids_starting_with = (
            sa.select(t.c.id)
            .where(p.dialect.id_prefix(t.c.id, param("prefix")))
            .order_by(t.c.id)
            .limit(param("limit", sa.Integer()))
        )
        #: How many jobs each state has (the whole table).
        self.count_by_state = sa.select(t.c.state, sa.func.count()).group_by(t.c.state)
        #: How many jobs each live state has (through the state index: the live jobs only).
        self.count_live = (
            sa.select(t.c.state, sa.func.count())
            .where(t.c.state.in_(sa.bindparam("live", list(LIVE_STATES), literal_execute=True)))
            .group_by(t.c.state)
        )
        #: How many jobs state ``b_state`` has, counting at most ``b_cap`` (through its index).
        self.count_up_to = sa.select(sa.func.count()).select_from(
            sa.select(t.c.id)
            .where(t.c.state == param("state"))
            .limit(param("cap", sa.Integer()))
            .subquery()
        )
        newest, limit = t.c.created_at.desc(), param("limit", sa.Integer())
        #: The newest ``b_limit`` jobs of state ``b_state``.
        self.newest = self.select_jobs(t.c.state == param("state")).order_by(newest).limit(limit)
        #: The newest ``b_limit`` jobs of state ``b_state`` and task ``b_task``.
        self.newest_of_task = (
            self.select_jobs(t.c.task == param("task"), t.c.state == param("state"))
            .order_by(newest)
            .limit(limit)
        )

        #: The newest ``b_limit`` jobs of state ``b_state`` in group ``b_group``.
        self.newest_of_group = (
            self.select_jobs(t.c.lease_group == param("group"), t.c.state == param("state"))
            .order_by(newest)
            .limit(limit)
        )

    def select_jobs(self, *where: Any) -> sa.Select[Any]:
        """A SELECT of whole jobs (as ``rows.job`` reads them)."""
        return sa.select(*self.job_columns).where(*where)
