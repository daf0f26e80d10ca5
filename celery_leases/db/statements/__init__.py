"""Every SQL statement of celery-leases, built once per table and dialect, in named groups.

Each statement is an attribute with a ``#:`` line saying what it is for; where databases
differ, a group asks the dialect (``db/dialects``), never tests its name.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..dialects import Dialect
from .checkpoint import Checkpoint
from .common import (
    CANCELLED_TEXT,
    GAVE_UP_CORRUPT,
    GAVE_UP_MAX_ATTEMPTS,
    GAVE_UP_NO_PROGRESS,
    Parts,
)
from .end import End
from .groups import Groups
from .heartbeat import Heartbeat
from .keys import Keys
from .operators import Operators
from .reads import Reads
from .reaper import Reaper
from .record import Record
from .renew import Renew


class Statements:
    """The statements on one jobs table (and its keys table) for one dialect."""

    def __init__(
        self,
        table: sa.Table,
        dialect: Dialect,
        keys: sa.Table,
        holders: sa.Table,
        groups: sa.Table,
    ) -> None:
        parts = Parts(table, dialect, keys, holders, groups)
        self.table = table
        #: Recording a job and claiming its lease.
        self.record = Record(parts)
        #: A keeper's renew tick (its holder row), and binding a lease to it.
        self.renew = Renew(parts)
        #: Saving a checkpoint.
        self.checkpoint = Checkpoint(parts)
        #: How an attempt ends.
        self.end = End(parts)
        #: Operators' actions and ends decided outside any attempt.
        self.operators = Operators(parts)
        #: A reaper pass.
        self.reaper = Reaper(parts)
        #: Lease keys: holders, follow-ups, cursors.
        self.keys = Keys(parts)
        #: Job groups: their rows and admissions.
        self.groups = Groups(parts)
        #: Reads: jobs, the clock, the revision.
        self.reads = Reads(parts)
        #: The reaper's heartbeat: its last pass.
        self.heartbeat = Heartbeat(parts)

    def hot(self) -> list[Any]:
        """The statements of a worker's hot path (claim, renew, checkpoint, finish and their
        neighbours), for ``Store.warm``."""
        record, renew, checkpoint, end = self.record, self.renew, self.checkpoint, self.end
        return [
            self.reads.schema_revision,
            *(record.register, record.register_unflushed, record.create_claimed),
            *(record.claim_version, record.claim_job),
            *(record.claimed, record.facts),
            *(renew.bound, renew.unbound, renew.bind, renew.detach),
            *(checkpoint.save, checkpoint.save_progress, checkpoint.stop_of),
            *checkpoint.unstopped.values(),
            *(end.finish, end.fail, end.hand_back, end.hand_back_retry, end.state_of, end.replace),
            *(self.keys.key_holder, self.keys.add_pending, self.keys.pending_id_of),
        ]


__all__ = [
    "CANCELLED_TEXT",
    "GAVE_UP_CORRUPT",
    "GAVE_UP_MAX_ATTEMPTS",
    "GAVE_UP_NO_PROGRESS",
    "Statements",
]
