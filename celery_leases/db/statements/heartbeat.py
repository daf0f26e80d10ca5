"""The reaper's heartbeat: its last pass, a reserved row of the holders' table.

The row ``reaper`` of ``<table>_holders`` (a keeper's id is 32 hex digits: none is ``reaper``)
has the database clock of the last pass in ``renewed_at`` and who ran it in ``owner``. It is
bound to no session (``session`` NULL), so the search for holders whose session is gone never
reads it, and no job is ever bound to it, so nothing takes its ``expires_at`` for a lease's
end; the daily prune of idle holders deletes it only after a day without a pass (the pass that
comes next writes it again). No schema change: the table and its columns are revision 0003's.
"""

from __future__ import annotations

import sqlalchemy as sa

from .common import Parts, param
from .renew import HOLDER_COLUMNS

#: The holders' row of the reaper's heartbeat.
REAPER_ROW = "reaper"


class Heartbeat:
    """The statements of the reaper's heartbeat (``db/store/heartbeat.py``)."""

    def __init__(self, p: Parts) -> None:
        h, d, now = p.holders, p.dialect, p.now
        row = sa.select(
            sa.literal(REAPER_ROW, h.c.id.type),
            param("owner", h.c.owner.type),
            sa.cast(sa.null(), sa.BigInteger()),
            now,
            now,
            now,
            sa.null(),
        )
        #: A reaper pass ended now, run by ``b_owner``.
        self.record = d.upsert(
            h,
            row,
            HOLDER_COLUMNS,
            "id",
            update=lambda new: {c: new[c] for c in ("owner", "renewed_at", "expires_at")},
        )
        #: Who ran the last pass, and how long ago (seconds, database clock); no row: none.
        self.last = sa.select(h.c.owner, now - h.c.renewed_at).where(h.c.id == REAPER_ROW)
