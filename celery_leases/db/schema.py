"""The tables and the facts every part of the storage wing shares: states, limits, names.

Every time in the table is a float of epoch seconds read from the database clock
(``functions.db_now``), so lease arithmetic never compares a worker's clock with a stored time and
keeps sub-second resolution on every backend. The table is created and changed by the
migrations (``migrations/``), never at first use; this is the shape the code reads and writes,
which the migrations' head must match (a test compares them).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from ..states import FINISHED, LIVE, State
from ..states import REVOKED_ENDS as REVOKED_ENDS_
from .dialects import Dialect

SCHEMA_VERSION = 6

#: Job states, as the ``state`` column stores them (``celery_leases.states.State``'s values:
#: the states are named there, once). ``queued`` and ``running`` are live; the others are
#: finished. A job of a group that waits for its admission is ``queued`` with no
#: ``admitted_at`` (``WAITING``, never stored).
QUEUED = State.QUEUED.value
RUNNING = State.RUNNING.value
DONE = State.DONE.value
FAILED = State.FAILED.value
CANCELLED = State.CANCELLED.value
REVOKED = State.REVOKED.value
REPLACED = State.REPLACED.value
SUPERSEDED = State.SUPERSEDED.value
STATES = (QUEUED, RUNNING, DONE, FAILED, CANCELLED, REVOKED, REPLACED, SUPERSEDED)
LIVE_STATES = tuple(s.value for s in LIVE)
#: SQL true for a live job (a partial index's predicate: the statements that use the index
#: write the states as literals, so that a generic plan can prove it).
LIVE_PREDICATE = f"state IN ({', '.join(repr(s) for s in LIVE_STATES)})"
FINISHED_STATES = tuple(s.value for s in FINISHED)
#: The ends a client sees as REVOKED in the result backend.
REVOKED_ENDS = tuple(s.value for s in REVOKED_ENDS_)
#: A job of a group that waits in the database for its admission (never published yet): it
#: is ``queued`` (live: it holds its lease key) with no ``admitted_at`` and no ``expires_at``
#: (no reaper re-publishes it). Shown as ``waiting`` by ``leases list``.
WAITING = State.WAITING.value

#: Longest job (task) id the table holds; a longer one is refused, never truncated.
MAX_ID_LENGTH = 155
#: Longest lease key (``lease_key``: the resource a job works on) the table holds.
MAX_KEY_LENGTH = 255
#: Length of a holder's id (a keeper's: 32 hex digits).
MAX_HOLDER_LENGTH = 64
#: SQL true for a job that holds its lease key: a live one, or one that ended with a trigger
#: waiting for its follow-up (it hands the key to that follow-up, in one transaction). At
#: most one job per key holds it (a unique index).
KEY_HELD = f"state IN ({', '.join(repr(s) for s in LIVE_STATES)}) OR followup_id IS NOT NULL"


def version_table_name(table: str) -> str:
    """The Alembic version table of the leases table ``table``."""
    return f"{table}_version"


#: Defining a table on a shared ``MetaData`` is a check then an insert: two threads of one
#: process (a thread pool's first operations) could both define it, and the second fails
#: ("already defined") or reads a half-built one. One lock for all definitions.
_DEFINING = threading.RLock()
_F = TypeVar("_F", bound=Callable[..., Any])


def _serialized(define: _F) -> _F:
    @functools.wraps(define)
    def serialized(*args: Any, **kwargs: Any) -> Any:
        with _DEFINING:
            return define(*args, **kwargs)

    return cast(_F, serialized)


@_serialized
def jobs_table(
    metadata: sa.MetaData, name: str = "celery_leases_jobs", dialect: Dialect | None = None
) -> sa.Table:
    """Define the jobs table called ``name`` on ``metadata`` (or return the one already there).

    ``dialect`` says how "one job holds each lease key" (``KEY_HELD``) is enforced
    (``Dialect.live_key_index``; without one: a partial unique index, PostgreSQL's and
    SQLite's)."""
    if name in metadata.tables:
        return metadata.tables[name]
    text = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
    live = sa.text(KEY_HELD)
    family = dialect or Dialect("")
    one_live_job_per_key = family.live_key_index(name, live)
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.String(MAX_ID_LENGTH), primary_key=True),
        sa.Column("task", sa.String(255), nullable=False),
        # Celery's replaced_task_nesting of the message: a replacement is a newer generation.
        sa.Column("generation", sa.Integer, nullable=False, default=0),
        # The message's version id (leases_message_id header); NULL for one not recorded
        # by celery-leases (sent by name from elsewhere).
        sa.Column("version", sa.String(64)),
        # The whole task message, as Celery's JSON (message.Message.dumps).
        sa.Column("message", text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(255)),
        # The database session of the holder's keeper, set by each renewal (PostgreSQL: its
        # backend pid; MariaDB: its connection id; SQLite: its process id): a running job whose
        # holder's session is gone is re-published without waiting for its expiry.
        sa.Column("session", sa.BigInteger),
        sa.Column("token", sa.BigInteger, nullable=False, default=0),
        sa.Column("duration", sa.Double),
        sa.Column("expires_at", sa.Double),
        sa.Column("attempts", sa.Integer, nullable=False, default=0),
        sa.Column("stalled_attempts", sa.Integer, nullable=False, default=0),
        # Times the reaper re-published the job while it waited queued (for the backoff).
        sa.Column("sends", sa.Integer, nullable=False, default=0),
        sa.Column("checkpoint", text),
        sa.Column("progress_done", sa.BigInteger),
        sa.Column("progress_total", sa.BigInteger),
        sa.Column("result", text),
        sa.Column("error", text),
        sa.Column("stop_requested", sa.String(16)),
        # A Celery state (FAILURE, REVOKED) to store in the result backend for a job that
        # ended outside any attempt (given up, cancelled while queued); NULL once stored.
        sa.Column("notify", sa.String(16)),
        sa.Column("run_after", sa.Double),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("claimed_at", sa.Double),
        sa.Column("renewed_at", sa.Double),
        sa.Column("checkpoint_at", sa.Double),
        sa.Column("finished_at", sa.Double),
        sa.Column("schema_version", sa.Integer, nullable=False, default=SCHEMA_VERSION),
        # The resource the job works on (the task's lease_key): at most one live job per key.
        sa.Column("lease_key", sa.String(MAX_KEY_LENGTH)),
        # Written by a celery-leases before revision 0003 only (a trigger kept on the job that
        # ran: now the key's ``pending``); read until none is left.
        sa.Column("followup", text),
        sa.Column("followup_id", sa.String(MAX_ID_LENGTH)),
        # The keeper (``<table>_holders``) whose renewals keep a running job's lease; NULL: the
        # job's own ``expires_at`` is its lease's end.
        sa.Column("holder", sa.String(MAX_HOLDER_LENGTH)),
        # When the job's first attempt claimed it (a trigger of its key that came before this
        # is served by it).
        sa.Column("started_at", sa.Double),
        # How many triggers its key had had (``<table>_keys.triggers``) when its first attempt
        # claimed it: the triggers it started after, whatever the clock did (NULL: claimed by
        # a release before revision 0006; then ``started_at`` says).
        sa.Column("started_seq", sa.BigInteger),
        # A trigger that a run of its key served (one that started after the trigger): that
        # run's id; this row holds what the trigger's caller is told.
        sa.Column("served_by", sa.String(MAX_ID_LENGTH)),
        # The group the job is admitted in (the task's lease_group): at most the group's limit
        # of its jobs are admitted and live at once (``<table>_groups``).
        sa.Column("lease_group", sa.String(MAX_KEY_LENGTH)),
        # When the job was admitted in its group; NULL while a job of a group waits in the
        # database, unpublished (``GROUP_WAITING``).
        sa.Column("admitted_at", sa.Double),
        *one_live_job_per_key,
        *_jobs_indexes(name, family),
    )


def _where_not_null(column: str) -> dict[str, Any]:
    """A partial index's condition (PostgreSQL's and SQLite's): rows whose ``column`` is set."""
    condition = sa.text(f"{column} IS NOT NULL")
    return {"postgresql_where": condition, "sqlite_where": condition}


def _jobs_indexes(name: str, family: Dialect) -> list[sa.Index]:
    """The jobs table's indexes besides the one live job per key, each with the read it serves."""
    return [
        sa.Index(f"ix_{name}_expiry", "state", "expires_at"),
        sa.Index(f"ix_{name}_finished", "finished_at"),
        sa.Index(f"ix_{name}_followup", "followup_id"),
        # ``leases list`` and its counts: the newest jobs of each state, the newest of a task
        # in each state; ``count_states`` counts a state up to a bound in the first.
        sa.Index(f"ix_{name}_state_created", "state", "created_at"),
        sa.Index(f"ix_{name}_task_created", "task", "state", "created_at"),
        # An id prefix (``leases show 8597f7f3``) where the primary key cannot serve LIKE.
        *family.id_prefix_index(name),
        *family.live_expiry_index(name, sa.text(LIVE_PREDICATE)),
        sa.Index(f"ix_{name}_holder", "holder", **_where_not_null("holder")),
        # The runs of a key, by start: did one start after a trigger (``Keys.started_since``)?
        sa.Index(
            f"ix_{name}_key_started", "lease_key", "started_at", **_where_not_null("lease_key")
        ),
        # A group's oldest waiting jobs (state queued, admitted_at NULL, by created_at), and
        # its live admitted ones (counted under the group row's lock at each admission).
        sa.Index(
            f"ix_{name}_group_waiting",
            "lease_group",
            "state",
            "admitted_at",
            "created_at",
            **_where_not_null("lease_group"),
        ),
        # The few jobs whose end the result backend has not been told (each reaper pass).
        sa.Index(f"ix_{name}_notify", "notify", **_where_not_null("notify")),
    ]


@_serialized
def keys_table(metadata: sa.MetaData, jobs: str = "celery_leases_jobs") -> sa.Table:
    """Define ``<jobs>_keys``: the cursor of each lease key, which outlives the key's jobs.

    Written only by the attempt holding the lease of a live job of the key (fenced by its
    token), read by the key's next run (``self.lease.cursor``)."""
    name = f"{jobs}_keys"
    if name in metadata.tables:
        return metadata.tables[name]
    text = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
    return sa.Table(
        name,
        metadata,
        sa.Column("lease_key", sa.String(MAX_KEY_LENGTH), primary_key=True),
        sa.Column("cursor_state", text),
        # The job and token of the attempt that wrote it.
        sa.Column("job_id", sa.String(MAX_ID_LENGTH)),
        sa.Column("token", sa.BigInteger),
        sa.Column("cursor_at", sa.Double),
        # The key's triggers not served yet (they came while a job held the key): the id their
        # callers were given (the first one's), its message, and when the latest came. A run
        # of the key that starts after ``pending_at`` serves them; else one runs for them.
        sa.Column("pending_id", sa.String(MAX_ID_LENGTH)),
        sa.Column("pending", text),
        sa.Column("pending_at", sa.Double),
        # When the first of them came (a debounced follow-up waits at most ``max_wait`` after it).
        sa.Column("pending_since", sa.Double),
        # How many triggers ever waited on the key: the latest one's number (a run whose
        # claim read at least that started after it: ``started_seq``).
        sa.Column("triggers", sa.BigInteger),
        sa.Index(
            f"ix_{name}_pending",
            "pending_at",
            postgresql_where=sa.text("pending_id IS NOT NULL"),
            sqlite_where=sa.text("pending_id IS NOT NULL"),
        ),
    )


@_serialized
def holders_table(metadata: sa.MetaData, jobs: str = "celery_leases_jobs") -> sa.Table:
    """Define ``<jobs>_holders``: one row per keeper (a worker process's thread that renews
    its leases). A keeper renews its one row, not the rows of the jobs it holds: a running
    job bound to it (``holder``) lasts while its keeper renews, whatever its number, and a
    transaction of the task's on a job's row never meets a renewal."""
    name = f"{jobs}_holders"
    if name in metadata.tables:
        return metadata.tables[name]
    return sa.Table(
        name,
        metadata,
        sa.Column("id", sa.String(MAX_HOLDER_LENGTH), primary_key=True),
        # The worker process it runs in ("node/instance/pid"), for people.
        sa.Column("owner", sa.String(255), nullable=False),
        # The database session it renews on (PostgreSQL: its backend pid; MariaDB: its
        # connection id, while it holds its named lock; SQLite: its process id), NULL when
        # unbound: behind a pooler, or leases_bind_session off.
        sa.Column("session", sa.BigInteger),
        sa.Column("renewed_at", sa.Double, nullable=False),
        # When its shortest lease ends without a renewal: a job of a holder past it may be over.
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        # When the database server it last renewed on started (epoch seconds; NULL where the
        # database cannot say): its session gone under another start is a restart or a
        # failover, which ended every session, not a death.
        sa.Column("server", sa.Double),
    )


@_serialized
def groups_table(metadata: sa.MetaData, jobs: str = "celery_leases_jobs") -> sa.Table:
    """Define ``<jobs>_groups``: one row per job group (``lease_group``), locked by every
    admission of the group: its limit and rate as the last client gave them, and its token
    bucket (``tokens``, refilled by the database clock since ``refilled_at``, at most 1, as
    Celery's own rate limit). The admitted count is not kept here: it is the count of the
    group's live admitted jobs, read under this row's lock, so nothing can make it drift."""
    name = f"{jobs}_groups"
    if name in metadata.tables:
        return metadata.tables[name]
    return sa.Table(
        name,
        metadata,
        sa.Column("name", sa.String(MAX_KEY_LENGTH), primary_key=True),
        # At most this many jobs of the group admitted and live at once (NULL: no limit).
        sa.Column("group_limit", sa.Integer),
        # Admissions per second (NULL: no rate limit).
        sa.Column("rate", sa.Double),
        sa.Column("tokens", sa.Double, nullable=False),
        sa.Column("refilled_at", sa.Double, nullable=False),
        # The group's last admission: a reaper pass admits the longest-served group first.
        sa.Column("admitted_at", sa.Double),
        sa.Column("created_at", sa.Double, nullable=False),
    )


@_serialized
def version_table(metadata: sa.MetaData, name: str) -> sa.Table:
    """The Alembic version table of the jobs table ``name`` (``<name>_version``)."""
    versions = version_table_name(name)
    if versions in metadata.tables:
        return metadata.tables[versions]
    return sa.Table(versions, metadata, sa.Column("version_num", sa.String(32), primary_key=True))


#: Metadata holding the jobs table under its default name, for Alembic ``target_metadata``.
metadata = sa.MetaData()
jobs_table(metadata)
keys_table(metadata)
holders_table(metadata)
groups_table(metadata)
