"""Keeping leases: a keeper renews its one holder row; the jobs it holds are bound to it."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..schema import RUNNING
from .common import Parts, param

#: A holder's columns, as an upsert writes them.
HOLDER_COLUMNS = ["id", "owner", "session", "renewed_at", "expires_at", "created_at", "server"]


class Renew:
    """The statements of a keeper (``worker/keeper.py``).

    A keeper's renew tick writes one row, its holder's, whatever number of jobs it holds: the
    running jobs bound to it (``holder``) last while it renews. It never writes a job's row,
    so a transaction of the task's on that row (a checkpoint in the task's transaction, under
    snapshot isolation) never meets a renewal.
    """

    def __init__(self, p: Parts) -> None:
        t, h, d, now = p.table, p.holders, p.dialect, p.now
        pid = param("pid", sa.BigInteger())
        server = d.server_started()

        def holder(session: sa.ColumnElement[int] | None, server: Any) -> sa.Insert:
            row = sa.select(
                param("holder", h.c.id.type),
                param("owner", h.c.owner.type),
                session if session is not None else sa.cast(sa.null(), sa.BigInteger()),
                now,
                now + param("shortest", sa.Double()),
                now,
                server if server is not None else sa.null(),
            )
            return d.upsert(  # type: ignore[no-any-return]
                h,
                row,
                HOLDER_COLUMNS,
                "id",
                update=lambda new: {
                    c: new[c] for c in ("owner", "session", "renewed_at", "expires_at", "server")
                },
            )

        #: The holder ``b_holder`` renewed (made if missing) on its keeper's session, bound
        #: to that session; it lasts ``b_shortest`` seconds (its shortest lease) if it stops.
        self.bound = holder(d.holder_session(pid), server)
        #: The same through any connection, bound to no session (behind a pooler, or
        #: leases_bind_session off): it lasts by its renewals only.
        self.unbound = holder(None, None)
        #: A lease of this keeper's the claim could not bind to it (its holder row was
        #: missing, or its session was cut): bound now.
        self.bind = d.with_returning(
            sa.update(t)
            .where(p.by_token, t.c.holder.is_(None))
            .ordered_values(
                (
                    t.c.expires_at,
                    sa.case((p.bound_holder.is_(None), t.c.expires_at), else_=sa.null()),
                ),
                (t.c.holder, p.bound_holder),
            ),
            t.c.holder,
        )
        #: The running jobs bound to the holder ``b_holder`` whose last claim or checkpoint is
        #: over ``b_margin`` seconds old: (id, token). Its keeper detaches those it does not
        #: hold (an attempt that ended without recording its end), or they would last as long
        #: as it renews.
        self.bound_to = sa.select(t.c.id, t.c.token).where(
            t.c.holder == param("holder", h.c.id.type),
            t.c.state == RUNNING,
            t.c.renewed_at < now - param("margin", sa.Double()),
        )
        #: The holder of the lease ``b_token`` of job ``b_id`` (read back).
        self.holder_of = sa.select(t.c.holder).where(p.by_token)
        #: A stalled lease left to end by itself: no longer kept by its holder, it ends when
        #: its holder's last renewal (or its own) runs out.
        self.detach = (
            sa.update(t)
            .where(p.by_token, t.c.holder.is_not(None))
            .ordered_values((t.c.expires_at, p.lease_end), (t.c.holder, None))
        )
        #: The holder ``b_holder`` gone (its keeper stops), unless it still holds a running job
        #: (one it could not hand back: the reaper lets it go when its lease runs out).
        self.drop = sa.delete(h).where(
            h.c.id == param("holder", h.c.id.type),
            ~sa.exists().where(t.c.holder == h.c.id, t.c.state == RUNNING),
        )
