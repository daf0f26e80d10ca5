"""Reading jobs, the clock and the table's revision."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..schema import version_table
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
        #: Ids starting with ``b_prefix_like`` (a LIKE pattern).
        self.ids_starting_with = (
            sa.select(t.c.id)
            .where(t.c.id.like(param("prefix_like"), escape="\\"))
            .order_by(t.c.id)
            .limit(param("limit"))
        )
        #: How many jobs each state has.
        self.count_by_state = sa.select(t.c.state, sa.func.count()).group_by(t.c.state)

    def select_jobs(self, *where: Any) -> sa.Select[Any]:
        """A SELECT of whole jobs (as ``rows.job`` reads them)."""
        return sa.select(*self.job_columns).where(*where)
