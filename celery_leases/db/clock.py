"""The database clock: every lease time is computed by it, inside the SQL.

Each dialect module renders :class:`db_now` in its own SQL (``@compiles``); a worker's clock is
never compared with a stored time.
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


__all__ = ["db_now"]
