"""A checkpoint: the state to resume from, saved by the attempt holding the lease; it renews
the lease too."""

from __future__ import annotations

import sqlalchemy as sa

from .common import Parts, param


class Checkpoint:
    """The statements that save a checkpoint, fenced by the lease's token; the job's stop
    request (cancel, preempt) comes back with it, so the attempt sees it at once."""

    def __init__(self, p: Parts) -> None:
        t, d, now = p.table, p.dialect, p.now
        # A checkpoint renews the lease: its holder's renewals go on from it, and a lease no
        # holder keeps ends a lease's length after it.
        saved = {
            "checkpoint": param("checkpoint", t.c.checkpoint.type),
            "checkpoint_at": now,
            "renewed_at": now,
            "expires_at": sa.case((t.c.holder.is_(None), now + t.c.duration), else_=sa.null()),
        }
        progress = saved | {
            "progress_done": param("done", sa.BigInteger()),
            "progress_total": param("total", sa.BigInteger()),
        }
        plain = sa.update(t).where(p.by_token).values(saved)
        with_progress = sa.update(t).where(p.by_token).values(progress)
        stop = t.c.stop_requested
        #: A checkpoint, on the store's own connection.
        self.save = d.with_returning(plain, stop)
        #: A checkpoint with progress (done, total).
        self.save_progress = d.with_returning(with_progress, stop)
        #: A checkpoint in a transaction of the caller's, bounding how long that transaction
        #: may then sit idle (the lease's length), so a worker frozen before its commit cannot
        #: hold the row's lock, and the job, for longer than its lease.
        self.save_in_tx = d.with_returning(d.with_idle_guard(plain, "leases_idle_guard"), stop)
        #: The same, with progress.
        self.save_progress_in_tx = d.with_returning(
            d.with_idle_guard(with_progress, "leases_idle_guard"), stop
        )
        #: The stop request of the row a checkpoint saved, read back where there is no
        #: RETURNING.
        self.stop_of = sa.select(stop).where(p.by_token)
        # A checkpoint first writes only a row with no stop request, returning nothing: one
        # statement in the usual case, and no result to read (a RETURNING's row costs its
        # round trip more than the renewal's columns: benchmarks.md section 16). A row it
        # skipped is then saved as above, and its request returned or read back.
        unstopped = sa.and_(p.by_token, stop.is_(None))
        plain_unstopped = sa.update(t).where(unstopped).values(saved)
        progress_unstopped = sa.update(t).where(unstopped).values(progress)
        guarded = d.with_idle_guard
        #: Each checkpoint statement's write of a row with no stop request.
        self.unstopped = {
            self.save: plain_unstopped,
            self.save_in_tx: guarded(plain_unstopped, "leases_idle_guard"),
            self.save_progress: progress_unstopped,
            self.save_progress_in_tx: guarded(progress_unstopped, "leases_idle_guard"),
        }
