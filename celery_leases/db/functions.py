"""SQL functions each dialect module renders in its own SQL (``@compiles``).

:class:`db_now` is the database clock: every lease time is computed by it, inside the SQL; a
worker's clock is never compared with a stored time.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement


class db_now(FunctionElement[float]):
    """The database's wall clock as epoch seconds with sub-second resolution."""

    type = sa.Double()
    inherit_cache = True


@compiles(db_now)
def _db_now_default(element: Any, compiler: Any, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) AS DOUBLE PRECISION)"


class greatest(FunctionElement[Any]):
    """The greatest of its arguments (``GREATEST``; SQLite's ``max``)."""

    inherit_cache = True


@compiles(greatest)
def _greatest_default(element: Any, compiler: Any, **kw: Any) -> str:
    return f"GREATEST({compiler.process(element.clauses, **kw)})"


class least(FunctionElement[Any]):
    """The least of its arguments (``LEAST``; SQLite's ``min``)."""

    inherit_cache = True


@compiles(least)
def _least_default(element: Any, compiler: Any, **kw: Any) -> str:
    return f"LEAST({compiler.process(element.clauses, **kw)})"


__all__ = ["db_now", "greatest", "least"]
