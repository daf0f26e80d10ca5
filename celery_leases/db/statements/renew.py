"""Renewing leases: a keeper's tick, one statement for every lease its process holds."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from .common import Parts, param


class Renew:
    """The statements of a keeper's renew tick.

    A row locked by an open transaction (a checkpoint in a transaction of the task's) is
    skipped, not waited for: one locked job must not hold up the renewal of the process's other
    leases; its checkpoint renews it when that transaction commits. A keeper renews on its
    session's own connection and binds the leases to it; a renewal without a keeper leaves
    them unbound (expiry only).
    """

    def __init__(self, p: Parts) -> None:
        t, d = p.table, p.dialect
        pid = param("pid", sa.BigInteger())

        def renewing(rows: sa.Select[Any], session: Any) -> Any:
            renew = d.update_unlocked(t, rows).values(
                expires_at=p.now + t.c.duration, renewed_at=p.now, session=session
            )
            return d.with_returning(renew, t.c.id, t.c.stop_requested)

        # Several leases (a threads or gevent pool): ``b_ids`` / ``b_tokens`` / ``b_leases``.
        many = d.leases_held(t, p.held)
        #: The leases of a process, renewed on its keeper's session and bound to it.
        self.bound = d.planned_per_call(renewing(many, d.holder_session(pid)))
        #: The same through any connection: the leases are left unbound.
        self.unbound = d.planned_per_call(renewing(many, None))
        #: Which of the leases are held (rows skipped, or read back): (id, stop request).
        self.held = d.planned_per_call(many.with_only_columns(t.c.id, t.c.stop_requested))
        # One lease (what a prefork pool process holds): the lease as two scalars, so the
        # statement is prepared once and no list is expanded on the client at each tick.
        one = sa.select(t.c.id).where(p.by_token)
        #: One lease, renewed on its keeper's session and bound to it.
        self.one_bound = renewing(one, d.holder_session(pid))
        #: One lease, renewed through any connection, left unbound.
        self.one_unbound = renewing(one, None)
        #: Whether the one lease is held: (id, stop request).
        self.one_held = sa.select(t.c.id, t.c.stop_requested).where(p.by_token)
