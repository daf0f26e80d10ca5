"""The database families celery-leases runs on, one module each, registered by the backend
names SQLAlchemy gives them. A new database is a module answering :class:`~.base.Dialect`
and one line in ``REGISTERED``."""

from __future__ import annotations

from .base import Dialect
from .mysql import MySQL
from .postgresql import PostgreSQL
from .sqlite import SQLite

#: Each supported family, by the backend names it serves (``URL.get_backend_name()``).
REGISTERED: tuple[type[Dialect], ...] = (PostgreSQL, MySQL, SQLite)


def dialect_for(backend: str) -> Dialect:
    """The dialect serving SQLAlchemy's backend ``backend``; ValueError for one not supported."""
    for family in REGISTERED:
        if backend in family.names:
            return family(backend)
    supported = ", ".join(name for family in REGISTERED for name in family.names)
    if backend == "postgres":  # Heroku's and libpq's spelling, which SQLAlchemy 2 refuses
        raise ValueError(
            "SQLAlchemy names PostgreSQL postgresql, not postgres: write the URL as "
            "postgresql+psycopg://... (psycopg 3) or postgresql://... (psycopg2)"
        )
    raise ValueError(f"celery-leases does not support {backend!r} databases (only {supported})")


def all_dialects() -> list[Dialect]:
    """One dialect of each family (to ask about an error whose database is not known)."""
    return [family(family.names[0]) for family in REGISTERED]


__all__ = ["REGISTERED", "Dialect", "all_dialects", "dialect_for"]
