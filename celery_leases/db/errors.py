"""Database errors: the one place that tells them apart, and wraps them once at the storage
wing's boundary.

Every driver error is one of four kinds (:class:`Kind`), each handled one way:

- ``gone``: the connection is lost (a restart, a failover, an idle timeout, a cut network):
  the operation runs once more on a fresh connection (``Database.run``); raised as
  :class:`~celery_leases.StoreUnavailable` if that fails too;
- ``conflict``: a concurrent transaction won (a serialization failure under snapshot
  isolation, a deadlock, a lock timeout): the store's own operations run again (each is
  fenced, so running it again is safe), after a short random pause, up to
  ``CONFLICT_RERUNS`` times (once after a lock timeout, which waited already: ``rerun``);
  in a caller's transaction it is raised as
  :class:`~celery_leases.WriteConflict` (run the transaction again), never as an outage;
- ``refused``: the database refuses this write for good (too large for its packet, a value
  too long, a constraint): raised at once with the database's own message, as the error of
  the operation (``ArgumentsError`` for a message, ``CheckpointError`` for a checkpoint);
- ``unavailable``: anything else operational (cannot connect, out of resources):
  :class:`~celery_leases.StoreUnavailable`; other errors are :class:`LeaseError`.

A connection on which a statement was interrupted by something that is not a database error
(a soft time limit, ``KeyboardInterrupt``, a gevent timeout, ``SystemExit``) is in an unknown
state: it is closed, never used again (``interrupted``).
"""

from __future__ import annotations

import contextlib
import enum
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import sqlalchemy as sa

from ..errors import LeaseError, StoreUnavailable, WriteConflict
from .dialects import Dialect, all_dialects

T = TypeVar("T")

#: Times a store's own operation runs again after a deadlock or a serialization failure:
#: under contention (many triggers of one key while it settles, on MariaDB) the rerun can
#: meet the same transactions again, and lose again.
CONFLICT_RERUNS = 4
#: Seconds of the longest random pause before the first rerun of a conflict, doubled at each
#: rerun (full jitter: two transactions that deadlocked do not start again at one moment).
CONFLICT_PAUSE = 0.002


class Kind(enum.Enum):
    """What a database error means for the operation that met it."""

    GONE = "gone"
    CONFLICT = "conflict"
    REFUSED = "refused"
    UNAVAILABLE = "unavailable"
    OTHER = "other"


def kind_of(exc: BaseException, dialect: Dialect | None = None) -> Kind:
    """The kind of ``exc`` (SQLAlchemy's error, or the driver's), as ``dialect`` tells it
    (any dialect when None)."""
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return Kind.GONE
    orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    for family in [dialect] if dialect is not None else all_dialects():
        found = family.error_kind(orig)
        if found is not None:
            return Kind(found)
    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError | sa.exc.TimeoutError):
        return Kind.UNAVAILABLE
    return Kind.OTHER


def rerun(
    run: Callable[[], T],
    dialect: Dialect,
    *,
    lost: Callable[[sa.exc.DBAPIError], None] | None = None,
) -> T:
    """``run()``, run again once on a connection the server had closed (``gone``), and up
    to ``CONFLICT_RERUNS`` times, each after a short random pause, when a concurrent
    transaction won (``conflict``; once only after a lock timeout, which waited already).
    ``lost(exc)`` is called before each rerun. Every other error, and the last, is raised.
    Only for operations that are safe to run again: the store's own, each fenced."""
    gone = conflicts = 0
    while True:
        try:
            return run()
        except sa.exc.DBAPIError as exc:
            found = kind_of(exc, dialect)
            if found is Kind.GONE and not gone:
                gone = 1
            elif found is Kind.CONFLICT and conflicts < (
                1 if dialect.waited_out(exc.orig) else CONFLICT_RERUNS
            ):
                conflicts += 1
                time.sleep(random.uniform(0, CONFLICT_PAUSE * 2**conflicts))
            else:
                raise
            if lost is not None:
                lost(exc)


class Wrapped:
    """A context manager that turns driver errors into celery-leases' errors (``Kind``).
    ``refused``: the error a refused write raises (the operation's own)."""

    def __init__(
        self,
        safe_url: str,
        what: str,
        dialect: Dialect | None = None,
        refused: type[LeaseError] = LeaseError,
    ) -> None:
        self.what = what
        self.safe_url = safe_url
        self.dialect = dialect
        self.refused = refused

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if not isinstance(exc, sa.exc.SQLAlchemyError):
            return
        found = kind_of(exc, self.dialect)
        prefix = f"{self.what}, " if self.what else ""
        where = f"leases database {self.safe_url}"
        if found in (Kind.GONE, Kind.UNAVAILABLE):
            raise StoreUnavailable(f"{prefix}{where} is unavailable: {first_line(exc)}") from exc
        if found is Kind.CONFLICT:
            raise WriteConflict(
                f"{prefix}a concurrent transaction won in {where} ({first_line(exc)}); "
                f"run the transaction again"
            ) from exc
        if found is Kind.REFUSED:
            raise self.refused(f"{prefix}{where} refuses it: {first_line(exc)}") from exc
        raise LeaseError(f"{prefix}{where} error: {first_line(exc)}") from exc


class interrupted:  # lower case: used as the function it was, ``with interrupted(...)``
    """Run a statement; if anything but a database error (SQLAlchemy's, or the driver's
    ``driver_errors``) interrupts it (a soft time limit, a ``KeyboardInterrupt``, a gevent
    timeout), call ``discard()`` (the connection is in an unknown state: closed, never used
    again) and let the interruption go on. A class, not a generator: every statement of the
    hot path enters it (a third of the time)."""

    __slots__ = ("discard", "driver_errors")

    def __init__(self, discard: Any, driver_errors: Any = ()) -> None:
        self.discard = discard
        self.driver_errors = driver_errors

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is None or issubclass(kind, (sa.exc.SQLAlchemyError, LeaseError)):
            return
        if self.driver_errors and issubclass(kind, self.driver_errors):
            return
        with contextlib.suppress(Exception):
            self.discard()


def cancel_statement(dbapi_connection: Any) -> None:
    """Ask the server to stop the statement running on ``dbapi_connection`` (psycopg's
    ``cancel()``, sqlite3's ``interrupt()``), before the connection is closed: closing alone
    leaves a statement waiting on a lock to run, and commit, once it gets it. Best effort:
    PyMySQL has no such call (the statement ends when the server sees the socket gone)."""
    cancel = getattr(dbapi_connection, "cancel", None) or getattr(
        dbapi_connection, "interrupt", None
    )
    if callable(cancel):
        with contextlib.suppress(Exception):
            cancel()


def first_line(exc: BaseException) -> str:
    """The first line of a driver error's own message."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return text[0] if text else type(orig).__name__


def ended_idle_transaction(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from: SQLAlchemy's, the driver's, Django's)
    is the database ending a transaction that sat idle too long (``Dialect.
    ended_idle_transaction``: PostgreSQL's idle-in-transaction timeout, a MariaDB connection
    the server closed)."""
    dialects = all_dialects()
    return any(any(d.ended_idle_transaction(orig) for d in dialects) for orig in _chain(exc))


def conflict_in(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a ``conflict`` (:class:`Kind`): a
    serialization failure, a deadlock or a lock timeout, whichever library raised it."""
    if isinstance(exc, WriteConflict):
        return True
    dialects = all_dialects()
    return any(any(d.error_kind(orig) == "conflict" for d in dialects) for orig in _chain(exc))


def _chain(exc: BaseException) -> Iterator[Any]:
    """``exc``'s driver errors: its own, and those of the errors it was raised from
    (SQLAlchemy's error wraps the driver's; another library's, Django's, is raised from it)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        orig = error.orig if isinstance(error, sa.exc.DBAPIError) else error
        if orig is not None:
            yield orig
        error = error.__cause__


__all__ = [
    "Kind",
    "Wrapped",
    "conflict_in",
    "ended_idle_transaction",
    "first_line",
    "interrupted",
    "kind_of",
    "rerun",
]
