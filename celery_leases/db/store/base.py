"""The store's foundation: its database, statements and tables, how an operation runs, and the
schema check every process makes once."""

from __future__ import annotations

import functools
import logging
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...errors import ConfigurationError, CorruptJob, LeaseError
from ...settings import Settings
from .. import migrations, rows
from ..dbapi import Foreign
from ..dialects import Dialect
from ..engine import Database
from ..identity import Facts
from ..rows import Job
from ..schema import groups_table, holders_table, jobs_table, keys_table
from ..statements import Statements

logger = logging.getLogger("celery_leases")

#: Seconds ahead an admission may take a token of a group's bucket (at least one token's
#: time): the job is published at once with a countdown to it, and its claim waits for it.
RATE_HORIZON = 1.0
#: Seconds the database clock may read behind a time it wrote before the step back is
#: reported (a clock stepped back by NTP, a failover to a server whose clock is behind).
CLOCK_SLACK = 0.5

#: A group's (limit, rate): at most ``limit`` jobs admitted and live (None: no limit), at
#: most ``rate`` admissions a second (None: no rate).
Limits = tuple[int | None, float | None]


def token_horizon(rate: float) -> float:
    """Seconds ahead an admission at ``rate`` a second may take a token: ``RATE_HORIZON``, or
    one token's time if that is longer. A job admitted at ``rate`` is never due later than
    this (the claim's bound on a database clock stepped back)."""
    return max(RATE_HORIZON, 1.0 / rate)


class KeyTaken(Exception):
    """A write would make a second job of a lease key live (the unique index refused it)."""


class StoreBase:
    """What every group of the store's operations stands on."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.db = Database(settings.database_url, settings.engine_options)
        self._schema_ready = False

    # Built at first use: a database celery-leases does not support is refused then.

    @functools.cached_property
    def table(self) -> sa.Table:
        """The jobs table."""
        return jobs_table(sa.MetaData(), self.settings.table, self.db.dialect)

    @functools.cached_property
    def keys(self) -> sa.Table:
        """The lease keys' table (their cursors)."""
        return keys_table(self.table.metadata, self.settings.table)

    @functools.cached_property
    def holders(self) -> sa.Table:
        """The holders' table (a row per keeper)."""
        return holders_table(self.table.metadata, self.settings.table)

    @functools.cached_property
    def groups_table(self) -> sa.Table:
        """The job groups' table (a row per group)."""
        return groups_table(self.table.metadata, self.settings.table)

    @functools.cached_property
    def sql(self) -> Statements:
        """Every statement on these tables."""
        return Statements(self.table, self.db.dialect, self.keys, self.holders, self.groups_table)

    @property
    def safe_url(self) -> str:
        return self.db.safe_url

    @property
    def dialect(self) -> Dialect:
        """The database family (``db/dialects``)."""
        return self.db.dialect

    @property
    def engine(self) -> sa.engine.Engine:
        return self.db.engine

    # -- running operations ------------------------------------------------------------------

    def _run(self, operation: Any, *, single: bool = False) -> Any:
        """Run ``operation`` through SQLAlchemy (operators, the reaper)."""
        if not self._schema_ready:
            self.check_schema()
        return self.db.run(operation, single=single)

    def _hot(
        self, operation: Any, *, reads_back: bool = False, refused: type[LeaseError] = LeaseError
    ) -> Any:
        """Run an operation of the hot path on this process's direct connection: one
        statement, in autocommit; with ``reads_back``, one that reads its row back where
        the dialect has no RETURNING (MariaDB), in a transaction. ``refused``: the error of a
        write the database refuses for good (``ArgumentsError`` for a message, ...)."""
        if not self._schema_ready:
            self.check_schema()
        single = self.dialect.returning or not reads_back
        return self.db.run(operation, single=single, direct=True, refused=refused)

    def _count(self, stmt: Any, params: dict[str, Any] | None = None) -> int:
        return int(self._hot(lambda c: c.execute(stmt, params or {}).rowcount))

    def _insert(self, c: Connection, stmt: Any, params: dict[str, Any]) -> bool:
        """Run an insert-unless-exists; True when it inserted. :class:`KeyTaken` when another
        live job holds the row's lease key."""
        return bool(
            self._keyed(
                c,
                lambda: self.dialect.inserted(c, stmt, params, key_taken=self._live_key_taken),
            )
        )

    def _keyed(self, c: Connection, write: Any) -> Any:
        """Run ``write``, a statement that makes a job live; :class:`KeyTaken` when another
        live job holds its lease key (the unique index on live keys refused it)."""
        try:
            return write()
        except sa.exc.IntegrityError as exc:
            if self._live_key_taken(exc):
                raise KeyTaken() from exc
            raise

    def _live_key_taken(self, exc: sa.exc.IntegrityError) -> bool:
        text = str(exc.orig)
        return f"ix_{self.table.name}_live_key" in text or f"{self.table.name}.lease_key" in text

    def _facts(self, job_id: str) -> Facts | None:
        row = self._hot(lambda c: c.execute(self.sql.record.facts, {"b_id": job_id}).first())
        return None if row is None else Facts(*row)

    def _parse_jobs(self, c: Connection, ids: list[str]) -> tuple[list[Job], dict[str, str]]:
        """The jobs ``ids``, and the ids whose stored values are not JSON (with the error)."""
        if not ids:
            return [], {}
        select = self.sql.reads.select_jobs(self.table.c.id.in_(ids))
        jobs: list[Job] = []
        corrupt: dict[str, str] = {}
        for row in c.execute(select).all():
            try:
                jobs.append(rows.job(row._mapping))
            except CorruptJob as exc:
                corrupt[row._mapping["id"]] = str(exc)
        return jobs, corrupt

    # -- the process's first operation -------------------------------------------------------

    def check_schema(self) -> None:
        """Check, in one round trip (a read of ``<table>_version``), that the table exists and
        is at the revision this code needs. Creates nothing: a missing or older table raises
        :class:`ConfigurationError` naming the command that migrates it."""

        def read(connection: Connection) -> list[str] | None:
            try:
                revision = self.sql.reads.schema_revision
                return [row[0] for row in connection.execute(revision).all()]
            except sa.exc.DBAPIError as exc:
                if exc.connection_invalidated:
                    raise  # the server went away: not a question of schema
                return None  # no version table

        found = self.db.run(read, single=True, direct=True)
        head = migrations.head()
        if found and found[0] == head:
            self._schema_ready = True
            return
        name, where = self.table.name, self.safe_url
        if found and found[0] not in migrations.revisions():
            # A newer celery-leases migrated it: revisions only add what older code ignores,
            # so a rolling deploy's older workers go on.
            logger.warning(
                "celery-leases: table %s in %s is at revision %s, newer than this "
                "celery-leases knows (%s): upgrade celery-leases",
                name,
                where,
                found[0],
                head,
            )
            self._schema_ready = True
            return
        if found:
            raise ConfigurationError(
                f"leases table {name!r} in {where} is at revision {found[0]}, older than this "
                f"celery-leases needs ({head}): run {migrations.UPGRADE_COMMAND}"
            )
        if self.db.run(lambda c: sa.inspect(c.wrapped).has_table(name)):
            raise ConfigurationError(
                f"leases table {name!r} in {where} has no migration history (made by an "
                f"older celery-leases, or its migration failed): bring it under the "
                f"migrations, jobs kept, with {migrations.UPGRADE_COMMAND}"
            )
        raise ConfigurationError(
            f"no leases table {name!r} in {where}: create it with {migrations.INIT_COMMAND}"
        )

    def schema_changed(self) -> None:
        """The table was migrated: check it again at the next operation."""
        self._schema_ready = False

    def warm(self) -> None:
        """Import the database driver and compile the hot path's statements in this process,
        opening no connection: a worker's main process calls it before forking its pool, so
        every pool process shares them (copy-on-write) instead of building its own."""
        for statement in self.sql.hot():
            self.db.direct.compile(statement)

    def ping(self) -> float:
        """Reach the database once (the clock, on this process's direct connection)."""
        return float(
            self.db.run(
                lambda c: c.execute(self.sql.reads.now).scalar_one(), single=True, direct=True
            )
        )

    def foreign(self, dbapi_connection: Any, info: dict[str, Any]) -> Foreign:
        """The store's statements on ``dbapi_connection``, another library's connection in a
        transaction of its own (Django's, inside ``transaction.atomic()``)."""
        return self.db.direct.foreign(dbapi_connection, info)


__all__ = ["CLOCK_SLACK", "RATE_HORIZON", "KeyTaken", "Limits", "StoreBase", "token_horizon"]
