"""The caller's transaction, as the store joins it: how every fenced write of an attempt runs in
a transaction its caller holds open.

A checkpoint, a key's cursor, and (for an attempt that started inside one) the claim and the
end: each runs on the caller's connection, inside the caller's transaction, and commits or rolls
back with it; nothing here begins, commits or rolls one back. :func:`joined` turns what the
caller has into one :class:`Joined`, whatever it is:

- ``connection=``: an SQLAlchemy ``Connection``, a DBAPI connection (psycopg, PyMySQL,
  sqlite3), or a connection an integration knows (Django's);
- no ``connection=``: the transaction an integration says this thread is in (Django's
  ``transaction.atomic()`` on the leases' database, at any depth), or none.

A statement of the store's interrupted on the caller's connection (a soft time limit) leaves it
in an unknown state: it is closed (``db.errors.interrupted``), and the caller's transaction
fails with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from ..errors import ConfigurationError
from .dbapi import Foreign
from .engine import Guarded

#: A function an integration registers: the transaction this thread is in on a store's
#: database (a :class:`Joined`), or None.
Ambient = Callable[[Any], "Joined | None"]
#: A function an integration registers: the DBAPI connection behind one of its own (Django's
#: connection wrapper), or None when it is not one of its own.
Unwrap = Callable[[Any], Any]
#: A function an integration registers: called with (store, lease) before a write of that
#: lease's attempt runs on the store's own connection, it raises when the caller is in a
#: transaction of its own that the write cannot join (it would commit apart from it).
Refusal = Callable[[Any, Any], None]

_ambient: list[Ambient] = []
_unwrap: list[Unwrap] = []
_refusals: list[Refusal] = []
_infos: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


@dataclass
class Joined:
    """A caller's open transaction the store's statements join.

    ``executor`` runs them (an SQLAlchemy connection, or the store's statements on a DBAPI
    connection); ``info`` lives as long as that connection (the store keeps its idle-write
    bound there). ``guard_idle``: the write bounds how long the transaction may then sit idle
    (the lease's length), so a worker frozen before its commit cannot hold the job's row past
    its lease; off for a transaction the attempt started inside (the caller holds it around
    the whole attempt, as a test or a request does)."""

    executor: Any
    info: dict[str, Any] = field(default_factory=dict)
    guard_idle: bool = True
    #: The SQLAlchemy pool the connection goes back to (where a bound the store set on the
    #: session is given back), or None.
    pool: Any = None

    @property
    def dialect(self) -> Any:
        """SQLAlchemy's dialect of the connection."""
        return self.executor.dialect


def register_ambient(find: Ambient) -> None:
    """Register ``find``: an integration's way to tell the transaction this thread is in."""
    if find not in _ambient:
        _ambient.append(find)


def register_unwrap(unwrap: Unwrap) -> None:
    """Register ``unwrap``: an integration's way to reach the DBAPI connection behind its own."""
    if unwrap not in _unwrap:
        _unwrap.append(unwrap)


def register_refusal(refuse: Refusal) -> None:
    """Register ``refuse``: an integration's way to refuse a write that would commit apart
    from the caller's transaction (Django: a checkpoint inside ``atomic()`` on a database the
    leases do not live in)."""
    if refuse not in _refusals:
        _refusals.append(refuse)


def refuse_unjoined(store: Any, lease: Any) -> None:
    """Raise (``ConfigurationError``) if a write of ``lease``'s attempt, about to run on the
    store's own connection, sits in a transaction of the caller's that it cannot join."""
    for refuse in _refusals:
        refuse(store, lease)


def joined(store: Any, connection: Any = None) -> Joined | None:
    """The caller's transaction the next write of ``store`` joins: ``connection``'s, or the
    one this thread is in (:func:`ambient`); None when there is none."""
    if connection is None:
        return ambient(store)
    if isinstance(connection, Joined):
        return connection
    if isinstance(connection, sa.engine.Connection):
        return _sqlalchemy(store, connection)
    if isinstance(connection, Foreign):
        return Joined(connection, connection.info)
    dbapi = _dbapi(connection)
    return Joined(store.foreign(dbapi, _info_of(dbapi)), _info_of(dbapi))


def _sqlalchemy(store: Any, connection: sa.engine.Connection) -> Joined:
    """An SQLAlchemy connection's transaction. In one it has begun, on the store's driver,
    the store's statements run on its DBAPI connection as on any other caller's (compiled
    once, no SQLAlchemy execution around them: a tenth of a millisecond less a write), and
    an interruption or a lost connection invalidates it, as SQLAlchemy would. Otherwise (no
    transaction begun yet, which only SQLAlchemy would begin; another driver) they run
    through it (``Guarded``)."""
    begun = connection.in_transaction() and not connection.invalidated
    if begun and connection.dialect.driver == store.db.engine.dialect.driver:
        foreign = store.foreign(connection.connection.dbapi_connection, connection.info)
        foreign.on_discard = foreign.on_lost = connection.invalidate
        return Joined(foreign, connection.info, pool=connection.engine.pool)
    return Joined(Guarded(connection), connection.info, pool=connection.engine.pool)


def ambient(store: Any) -> Joined | None:
    """The transaction an integration says this thread is in on ``store``'s database."""
    for find in _ambient:
        found = find(store)
        if found is not None:
            return found
    return None


def _dbapi(connection: Any) -> Any:
    for unwrap in _unwrap:
        found = unwrap(connection)
        if found is not None:
            return found
    if callable(getattr(connection, "cursor", None)) and callable(
        getattr(connection, "commit", None)
    ):
        return connection  # a DBAPI connection (PEP 249)
    raise ConfigurationError(
        f"connection= must be an SQLAlchemy Connection or a DBAPI connection to the leases "
        f"database (psycopg, PyMySQL, sqlite3), not {type(connection).__name__}"
    )


def _info_of(dbapi: Any) -> dict[str, Any]:
    """What the store keeps about a DBAPI connection of the caller's, for as long as it lives."""
    try:
        return _infos.setdefault(dbapi, {})
    except TypeError:  # not weakly referenceable: nothing outlives this write
        return {}


__all__ = [
    "Joined",
    "ambient",
    "joined",
    "refuse_unjoined",
    "register_ambient",
    "register_refusal",
    "register_unwrap",
]
