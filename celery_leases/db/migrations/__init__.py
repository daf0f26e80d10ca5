"""The jobs table's schema history: Alembic migrations shipped in the package.

Each leases table (``leases_table``) has a history of its own, kept in ``<table>_version`` (an
Alembic version table), so it never meets an application's own Alembic history. Revisions
live in ``versions/``, one file each, named ``NNNN_<what>.py`` with ``revision = "NNNN"``: a
linear history whose head is the highest number. A revision reads the table's name with
:func:`table_name`. Run them with :func:`upgrade` (``celery_leases.migrate(app)``,
``celery -A proj leases upgrade``); a process only reads the version (``Store.check_schema``)
and never creates anything.

:func:`sql` gives the statements a migration would run, without running them (``leases upgrade
--sql``, Django's ``sqlmigrate``): a DBA reviews what a deploy will do. Revisions ask what
exists through :func:`existing`; written as SQL, each revision finds the schema exactly as the
revisions before it leave it.

Alembic is imported only to migrate: a worker's first operation reads one row, not the scripts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...errors import ConfigurationError
from ..dialects import dialect_for
from ..schema import version_table_name

if TYPE_CHECKING:
    from ..store import Store

logger = logging.getLogger("celery_leases.migrations")

HERE = Path(__file__).resolve().parent
_REVISION_FILE = re.compile(r"^(\d{4})_\w+\.py$")

#: The command that brings a table up to date, as errors name it.
UPGRADE_COMMAND = (
    "celery -A proj leases upgrade (or celery_leases.migrate(app); Django: manage.py migrate)"
)
#: The command that creates a table, as errors name it.
INIT_COMMAND = (
    "celery -A proj leases init-db (or celery_leases.migrate(app); Django: manage.py migrate)"
)


@functools.cache
def revisions() -> tuple[str, ...]:
    """Every revision this celery-leases ships, oldest first (from the file names)."""
    found = (_REVISION_FILE.match(path.name) for path in (HERE / "versions").iterdir())
    return tuple(sorted(match.group(1) for match in found if match))


def previous(revision: str) -> str | None:
    """The revision before ``revision`` (None before the first)."""
    order = revisions()
    if revision not in order:
        raise ConfigurationError(f"no celery-leases revision {revision!r} ({', '.join(order)})")
    at = order.index(revision)
    return order[at - 1] if at else None


@functools.cache
def summary(revision: str) -> str:
    """What ``revision`` does, in a few words: its file's docstring, up to the first full
    stop after its number (``"lease keys (schema 4)"``)."""
    import ast

    (path,) = (HERE / "versions").glob(f"{revision}_*.py")
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split()).replace("``", "")
    return first.split(": ", 1)[-1].split(". ", 1)[0].rstrip(".")


def head() -> str:
    """The newest revision: the schema this code reads and writes."""
    return revisions()[-1]


@dataclass(frozen=True)
class Migrated:
    """What ``upgrade()`` did to one leases table."""

    table: str
    #: Where the table is (its database URL, password hidden).
    where: str
    #: The revision before (None: no history: the table was created, or adopted from a
    #: celery-leases older than the migrations).
    before: str | None
    #: The revision now.
    after: str
    #: The jobs table existed before (False: created now).
    existed: bool

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def describe(self) -> str:
        """One line for a person: what happened, where."""
        where = f"leases table {self.table} in {self.where}"
        if self.after == "base":
            return f"{where}: dropped with its jobs (revision {self.before} undone)"
        if not self.existed:
            return f"{where}: created (revision {self.after})"
        if self.before is None:
            return f"{where}: brought under migrations (revision {self.after}), jobs kept"
        if self.changed:
            return f"{where}: upgraded from revision {self.before} to {self.after}"
        return f"{where}: up to date (revision {self.after})"


def upgrade(store: Store, *, revision: str = "head") -> Migrated:
    """Apply the revisions ``store``'s table lacks, up to ``revision`` (default the head).

    Creates the table (and its version table) when missing; a table made by a celery-leases
    older than the migrations (schema 2 or 3) is brought under them, jobs kept. Several
    processes may run it at once: the database serialises them (PostgreSQL advisory lock,
    MariaDB named lock, SQLite write lock). Raises :class:`ConfigurationError` for a table
    this code cannot read (schema 1) or an unknown ``revision``."""
    return _run(store, revision, downgrade=False)


def downgrade(store: Store, *, revision: str = "base") -> Migrated:
    """Undo revisions down to ``revision``; ``"base"`` drops the table and every job in it."""
    return _run(store, revision, downgrade=True)


def sql(
    store: Store, *, start: str | None = None, revision: str = "head", downgrade: bool = False
) -> list[str]:
    """The statements that migrating ``store``'s table from ``start`` to ``revision`` runs, for
    its database, one string each (run nothing; the connection only gives the server's
    dialect and, without ``start``, the table's revision).

    ``start`` None: from the table's revision (none: from an empty database; a table made
    before the migrations is refused: it is adopted by :func:`upgrade` only, which inspects
    it). ``downgrade``: the statements undoing ``start`` down to ``revision``."""
    from alembic import command
    from alembic.util.exc import CommandError

    table = store.table.name
    config = _config(store)
    written = _Statements()
    with (
        store.db.wrapped_errors(f"writing the migration SQL of {table}"),
        store.engine.connect() as connection,
    ):
        if start is None:
            start = _revision(connection, store)
            if start is None and sa.inspect(connection).has_table(table):
                raise ConfigurationError(
                    f"table {table} in {store.safe_url} was made before the migrations: "
                    f"bring it under them with {UPGRADE_COMMAND} (it inspects the table), "
                    "then ask for the SQL of later revisions"
                )
        config.attributes["connection"] = connection
        config.attributes["output"] = written
        span = f"{start or 'base'}:{revision}"
        try:
            if downgrade:
                command.downgrade(config, span, sql=True)
            else:
                command.upgrade(config, span, sql=True)
        except CommandError as exc:
            raise ConfigurationError(
                f"cannot write the SQL of {table} from {start or 'base'} to {revision!r}: {exc}"
            ) from exc
    if all(statement in ("BEGIN", "COMMIT") for statement in written.statements):
        return []  # nothing to migrate (PostgreSQL's script still opens a transaction)
    return written.statements


class _Statements:
    """Alembic's output buffer in offline mode: it writes each statement (or comment) in one
    call, so the statements are kept apart, never split on ``;`` (a function body has some)."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def write(self, text: str) -> None:
        text = "\n".join(line.rstrip() for line in text.strip().splitlines())
        if text and not text.startswith("--"):
            self.statements.append(text.removesuffix(";").rstrip())

    def flush(self) -> None:
        pass


def current(store: Store) -> str | None:
    """The table's revision (None: no version table, or an empty one)."""

    return store.db.run(lambda guarded: _revision(guarded.wrapped, store))


def _run(store: Store, revision: str, *, downgrade: bool) -> Migrated:
    from alembic import command
    from alembic.util.exc import CommandError

    table = store.table.name
    config = _config(store)
    with (
        store.db.wrapped_errors(f"migrating {table}"),
        store.engine.connect() as connection,
        _serialised(store, connection, table),
    ):
        existed = sa.inspect(connection).has_table(table)
        before = _revision(connection, store)
        config.attributes["connection"] = connection
        try:
            if downgrade:
                command.downgrade(config, revision)
            else:
                command.upgrade(config, revision)
        except CommandError as exc:
            raise ConfigurationError(f"cannot migrate {table} to {revision!r}: {exc}") from exc
        after = _revision(connection, store)
    store.schema_changed()
    return Migrated(table, store.safe_url, before, after or "base", existed)


def _revision(connection: sa.Connection, store: Store) -> str | None:
    if not sa.inspect(connection).has_table(version_table_name(store.table.name)):
        return None
    rows = connection.execute(store.sql.reads.schema_revision).scalars().all()
    return rows[0] if rows else None


def _config(store: Store) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(HERE))
    config.attributes["leases_table"] = store.table.name
    config.attributes["leases_where"] = store.safe_url
    return config


@contextlib.contextmanager
def _serialised(store: Store, connection: sa.Connection, table: str) -> Iterator[None]:
    """Run the block holding the database's lock for migrating ``table``, in one transaction
    of ``connection`` that is committed before the lock is let go (a second process then
    finds the first one's version row)."""
    with store.dialect.migration_lock(connection, table):
        try:
            yield
            connection.commit()
        except BaseException:
            connection.rollback()
            raise


# -- what env.py and the revisions use -----------------------------------------------------------


def run_environment() -> None:
    """The body of ``env.py``: run the revisions on the connection :func:`upgrade` gave,
    with ``<table>_version`` as the version table."""
    from alembic import context

    config = context.config
    connection = config.attributes.get("connection")
    if connection is None:
        raise ConfigurationError(
            "celery-leases migrations run through celery_leases.migrate(app) or "
            "`celery -A proj leases upgrade`, not the alembic command"
        )
    output = config.attributes.get("output")
    context.configure(
        connection=connection,
        version_table=version_table_name(config.attributes["leases_table"]),
        # Offline (sql()): the statements go to ``output``, compiled for the connection's
        # dialect (MariaDB's own where it differs from MySQL's), none is run.
        as_sql=output is not None,
        output_buffer=output,
        literal_binds=output is not None,
    )
    with context.begin_transaction():
        context.run_migrations()


def table_name() -> str:
    """The leases table a revision is migrating (``leases_table``)."""
    from alembic import op

    name: str = op.get_context().config.attributes["leases_table"]  # type: ignore[union-attr]
    return name


def where() -> str:
    """Where the table being migrated is (its database URL, password hidden), for messages."""
    from alembic import op

    text: str = op.get_context().config.attributes["leases_where"]  # type: ignore[union-attr]
    return text


def offline() -> bool:
    """The revision is being written as SQL (:func:`sql`), not run."""
    from alembic import context

    return bool(context.is_offline_mode())


class _Nothing:
    """What a revision written as SQL finds of its own work: nothing yet (the revisions before
    it are assumed applied, exactly as they leave the schema)."""

    def has_table(self, name: str) -> bool:
        return False

    def get_columns(self, name: str) -> list[dict[str, Any]]:
        return []

    def get_indexes(self, name: str) -> list[dict[str, Any]]:
        return []


def existing() -> Any:
    """An inspector of what exists, for a revision to skip what is already there (a table
    adopted from before the migrations, an index made by hand ``CONCURRENTLY``): the live
    database's, or, when the revision is written as SQL, one that finds nothing."""
    from alembic import op

    if offline():
        return _Nothing()
    return sa.inspect(op.get_bind())


def add_column_waiting(table: str, column: sa.Column[Any]) -> None:
    """``ALTER TABLE ... ADD COLUMN``, waiting at most 5 s for the table's lock (a deploy must
    not queue every renewal behind it); a failure says what to run by hand. For nullable
    columns without a default, which every database adds without rewriting the table."""
    from alembic import op

    bind = op.get_bind()
    dialect = bind.dialect
    name = dialect.identifier_preparer.quote(table)
    spec = sa.schema.CreateColumn(column).compile(dialect=dialect)
    alter = f"ALTER TABLE {name} ADD COLUMN {spec}"
    family = dialect_for(dialect.name)
    if offline():
        for statement in family.add_column_sql(dialect, name, str(spec)):
            op.execute(statement)
        return
    try:
        for statement in family.add_column_sql(dialect, name, str(spec)):
            bind.exec_driver_sql(statement)
    except sa.exc.DBAPIError as exc:
        raise ConfigurationError(
            f"table {table!r} needs the column {column.name!r}, and adding it failed "
            f"({str(exc.orig).strip().splitlines()[0]}); add it yourself: {alter}, then run "
            f"{UPGRADE_COMMAND}"
        ) from exc
