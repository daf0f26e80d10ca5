"""A keeper's session: the connection its process's leases are bound to."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from .dbapi import Direct
from .errors import rerun

if TYPE_CHECKING:
    from .engine import Database

T = TypeVar("T")
logger = logging.getLogger("celery_leases.database")


class Session:
    """One connection held open by a keeper, outside the pool's reach, for its renewals.

    While the process lives its session does: the reaper takes a job whose holder's session
    ended (the process died, a host went away) as abandoned at once, instead of waiting for
    the lease to expire (``Dialect.session_gone``). Thread safe: the keeper renews on it while
    attempts read its ``ident``. ``shared``: the process runs one task at a time (a prefork
    pool process), whose statements then take turns on this connection, the only one the
    process keeps open."""

    def __init__(self, db: Database, *, shared: bool = False) -> None:
        self.db = db
        self.shared = shared
        self._direct: Direct | None = None
        self._ident: int | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._warned = False
        #: Called (no arguments) when an interrupted statement ended the session (the keeper
        #: renews its holder on a new one at once, so the reaper never finds it gone).
        self.on_lost: Callable[[], None] | None = None

    def ident(self) -> int | None:
        """The session's id as the reaper sees it (``Dialect.session_ident``), connecting
        first if needed. None behind a connection pooler (``Database.pooler``): there the
        session is not this process's, so nothing is bound to it and leases end at their
        expiry."""
        known = self.db.dialect.connectionless_ident()
        if known is not None:
            return known
        with self._lock, self.db.wrapped_errors():
            if self.db.pooler is None:
                self._open()
            if self.db.pooler is None:
                return self._ident
            self._close()
            if not self._warned:
                self._warned = True
                logger.warning(
                    "celery-leases: %s sits between this process and PostgreSQL (%s): leases "
                    "are not bound to database sessions, so a dead worker's jobs wait for "
                    "their lease to expire (set leases_bind_session = False to say so)",
                    self.db.pooler,
                    self.db.safe_url,
                )
            return None

    def run(self, operation: Callable[[Any], T], *, single: bool = False) -> T:
        """Run ``operation`` on the session's connection (``dbapi.Direct``): in autocommit
        where one statement tells its outcome (``single``: it is one statement, as a renew
        tick's upsert), else in a transaction; run again on a new connection if the server
        had closed it, or after a concurrent transaction won (``errors.rerun``). Any other
        error (a statement timeout, say) leaves the session alive."""

        def lost(exc: sa.exc.DBAPIError) -> None:
            if exc.connection_invalidated:
                self._close()

        with self._lock, self.db.wrapped_errors():
            return rerun(lambda: self._execute(operation, single), self.db.dialect, lost=lost)

    def _execute(self, operation: Callable[[Any], T], single: bool) -> T:
        direct = self._open()
        if single or self.db.dialect.autocommit:
            return operation(direct)
        direct.begin()
        try:
            result = operation(direct)
            direct.commit()
            return result
        except BaseException:
            direct.rollback()
            raise

    def _open(self) -> Direct:
        if self._direct is not None and self._direct.broken:
            self._close()  # a statement on it failed or was interrupted: a new session
        if self._direct is not None and self._pid == os.getpid():
            return self._direct
        self._pid = os.getpid()
        direct = self.db.direct.open()
        try:
            self._ident = self.db.dialect.session_ident(direct)
        except BaseException:
            direct.close()
            raise
        self._direct = direct
        direct.on_discard = self._discarded
        if self.shared:
            self.db.direct.share(direct, self._lock)
        return direct

    def _discarded(self) -> None:
        """A statement on the session's connection was interrupted, and the connection closed
        (``dbapi.Direct.discard``): the session is gone; tell ``on_lost``."""
        if self.on_lost is not None:
            self.on_lost()

    def close(self) -> None:
        """Give the connection up (the session, and anything it holds, end with it)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            self.db.direct.share(None, self._lock)
            direct.close()  # never back to a pool: what the session holds must go too


__all__ = ["Session"]
