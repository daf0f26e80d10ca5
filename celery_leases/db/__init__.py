"""The storage wing: the only part of celery-leases that speaks SQL.

- ``schema.py``: the tables and the facts they share; ``migrations/``: their history;
- ``statements/``: every statement, in named groups; ``dialects/``: one module per database;
- ``store/``: the operations, grouped by who calls them; ``rows.py``: what they return;
- ``engine.py`` (the engine and its one retry), ``dbapi.py`` (the DBAPI fast path),
  ``session.py`` (a keeper's session), ``errors.py`` (driver errors wrapped and told apart).
"""

from __future__ import annotations

from .store import Store, store_for

__all__ = ["Store", "store_for"]
