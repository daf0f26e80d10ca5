"""Running the jobs table's migrations (the package's Alembic revisions) from Django's."""

from __future__ import annotations

from ...db import migrations
from . import database


def migrate_database(using: str, *, verbosity: int = 0) -> None:
    """Create or upgrade the leases table when ``using`` is the leases database; at
    ``verbosity`` 1 or more, say where it is and at which revision."""
    if using != database.alias():
        return
    migrated = migrations.upgrade(database.store())
    if verbosity >= 1:
        print(f"celery-leases: {migrated.describe()}")


def unmigrate_database(using: str, *, verbosity: int = 0) -> None:
    """``migrate celery_leases zero``: drop the leases table, and every job in it."""
    if using != database.alias():
        return
    dropped = migrations.downgrade(database.store())
    if verbosity >= 1:
        print(f"\n  celery-leases: {dropped.describe()}", end="")
