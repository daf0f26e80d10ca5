"""The jobs table's schema revisions as operations of Django migrations.

One history, two front doors: the package's Alembic revisions (``db/migrations``) are what
``celery -A proj leases upgrade`` runs, and each is also an operation (:class:`Revision`) of
this app's Django migrations, so ``showmigrations`` and ``migrate --plan`` show it,
``sqlmigrate`` prints its SQL for the project's database, and ``migrate celery_leases <n>``
undoes it. A revision runs on the leases database only (``CELERY_LEASES_DATABASE_ALIAS``), on a
connection of the store's own under its migration lock (as ``leases upgrade`` does), and only
when the table is not at it or past it already (a table a ``leases upgrade`` brought ahead).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from django.db.migrations.operations.base import Operation

from ... import routes
from ...db import migrations
from ...db.schema import version_table
from ...errors import ConfigurationError, LeaseError
from . import database


class Revision(Operation):
    """Bring the leases table to celery-leases' schema revision ``revision`` (backwards: to
    the one before it; before the first: no table)."""

    reduces_to_sql = True
    reversible = True

    def __init__(self, revision: str) -> None:
        self.revision = revision

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (f"{__name__}.{type(self).__name__}", [self.revision], {})

    def describe(self) -> str:
        return f"celery-leases revision {self.revision}: {migrations.summary(self.revision)}"

    @property
    def migration_name_fragment(self) -> str:
        return f"leases_revision_{self.revision}"

    def state_forwards(self, app_label: str, state: Any) -> None:
        """The tables are unmanaged models: their state is the migrations' other operations."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.alias != database.alias():
            return
        store = database.store()
        if schema_editor.collect_sql:  # sqlmigrate
            start = migrations.previous(self.revision) or "base"
            for statement in migrations.sql(store, start=start, revision=self.revision):
                schema_editor.execute(statement, params=None)
            return
        for each in _every_store(store):
            if not _at_or_past(migrations.current(each), self.revision):
                migrations.upgrade(each, revision=self.revision)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.alias != database.alias():
            return
        store = database.store()
        before = migrations.previous(self.revision) or "base"
        if schema_editor.collect_sql:  # sqlmigrate --backwards
            try:
                statements = migrations.sql(
                    store, start=self.revision, revision=before, downgrade=True
                )
            except ConfigurationError as exc:
                # SQLite drops a column by rebuilding the table from the live one.
                reason = str(exc).split(";", 1)[0]
                statements = [f"-- not writable as SQL here, run migrate instead: {reason}"]
            if before == "base":
                statements.append(_drop_versions(store))
            for statement in statements:
                schema_editor.execute(statement, params=None)
            return
        for each in _every_store(store):
            if _at_or_past(migrations.current(each), self.revision):
                migrations.downgrade(each, revision=before)
            if before == "base":
                # Zero leaves nothing behind: Alembic keeps its version table, emptied.
                _version_table(each).drop(each.engine, checkfirst=True)


def _every_store(store: Any) -> list[Any]:
    """``store`` (the leases database's), then the store of every other database named in
    ``CELERY_LEASES_DATABASES``: ``migrate`` of the leases database migrates them all."""
    return [store, *(other for _, other in routes.stores(store.settings)[1:])]


def _version_table(store: Any) -> sa.Table:
    return version_table(sa.MetaData(), store.table.name)


def _drop_versions(store: Any) -> str:
    """The SQL that drops the leases table's version table, for ``sqlmigrate``."""
    drop = sa.schema.DropTable(_version_table(store), if_exists=True)
    return str(drop.compile(dialect=store.engine.dialect)).strip()


def _at_or_past(current: str | None, revision: str) -> bool:
    order = migrations.revisions()
    return current in order and order.index(current) >= order.index(revision)


def settle_routed(using: str, *, verbosity: int = 0, out: Any = None) -> None:
    """After ``migrate`` of the leases database: bring each database named in
    ``CELERY_LEASES_DATABASES`` whose table is behind the leases database's (one added after
    the migrations were applied, where Django has nothing left to apply) to its revision.
    Never takes one back (``migrate celery_leases <n>`` undoes revisions on every database
    itself: :class:`Revision`), nor touches a table a newer celery-leases migrated. A database
    it cannot bring there is written to ``out`` (the command's output) and left to
    ``celery_leases.W003``: ``migrate`` has committed Django's migrations by then, and the
    other apps' ``post_migrate`` receivers must still run."""
    if using != database.alias():
        return
    try:
        store = database.store()
    except ConfigurationError:
        return  # a leases URL that cannot be used: the checks say why (E00x, W002)
    others = routes.stores(store.settings)[1:]
    if not others:
        return
    target = migrations.current(store)
    known = migrations.revisions()
    if target not in known:  # no table (zero), or a newer celery-leases's
        return
    for name, other in others:
        try:
            current = migrations.current(other)
            if (current is not None and current not in known) or _at_or_past(current, target):
                continue  # at or past it (a newer celery-leases's revision included)
            migrations.upgrade(other, revision=target)
        except (LeaseError, ConfigurationError, sa.exc.DBAPIError) as exc:
            _say(
                out,
                f"celery-leases: could not bring leases database {name!r} "
                f"({other.safe_url}) to revision {target}, where the leases database is: "
                f"{exc}. Run manage.py migrate again once it answers",
            )
            continue
        if verbosity >= 1:
            _say(
                out,
                f"celery-leases: leases table {other.table.name} in {other.safe_url} "
                f"(database {name!r}): brought to revision {target}",
            )


def _say(out: Any, line: str) -> None:
    if out is None:
        print(line)
    else:
        out.write(line + "\n")


def report(using: str, *, verbosity: int = 0) -> None:
    """After ``migrate`` of the leases database, at ``verbosity`` 1 or more: where the table
    is and at which revision (nothing is migrated here: the revisions are the operations)."""
    if verbosity < 1 or using != database.alias():
        return
    store = database.store()
    revision = migrations.current(store)
    where = f"leases table {store.table.name} in {store.safe_url}"
    if revision is None:
        print(f"celery-leases: {where}: none (migrated to zero)")
    else:
        print(f"celery-leases: {where}: at revision {revision}")
