"""Database errors, wrapped once at the storage wing's boundary, and told apart.

An unreachable or restarting server becomes :class:`StoreUnavailable`, any other driver error
a :class:`LeaseError`, each ``from`` the driver's error.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..errors import LeaseError, StoreUnavailable
from .dialects import all_dialects


class Wrapped:
    """A context manager that turns driver errors into LeaseError / StoreUnavailable."""

    def __init__(self, safe_url: str, what: str) -> None:
        self.prefix = f"{what}, " if what else ""
        self.safe_url = safe_url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError | sa.exc.TimeoutError):
            raise StoreUnavailable(
                f"{self.prefix}leases database {self.safe_url} is unavailable: {first_line(exc)}"
            ) from exc
        if isinstance(exc, sa.exc.SQLAlchemyError):
            raise LeaseError(
                f"{self.prefix}leases database {self.safe_url} error: {first_line(exc)}"
            ) from exc


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
    seen: set[int] = set()
    error: BaseException | None = exc
    dialects = all_dialects()
    while error is not None and id(error) not in seen:  # the error and what raised it
        seen.add(id(error))
        # SQLAlchemy's error wraps the driver's; another library's (Django's) is raised from it.
        orig = error.orig if isinstance(error, sa.exc.DBAPIError) else error
        if orig is not None and any(d.ended_idle_transaction(orig) for d in dialects):
            return True
        error = error.__cause__
    return False


__all__ = ["Wrapped", "ended_idle_transaction", "first_line"]
