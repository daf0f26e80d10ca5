"""The reaper's heartbeat in the store: record a pass, read the last one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import StoreBase


@dataclass(frozen=True)
class ReaperPass:
    """The last reaper pass recorded."""

    #: Who ran it ("host/pid").
    owner: str
    #: Seconds since it ended (database clock).
    age: float


class BeatOps(StoreBase):
    """The reaper's heartbeat: a pass recorded, the last one read."""

    def record_pass(self, owner: str) -> None:
        """Record that a reaper pass of ``owner`` ended now (database clock)."""
        record = self.sql.heartbeat.record
        self._run(lambda c: c.execute(record, {"b_owner": owner[:255]}), single=True)

    def last_pass(self) -> ReaperPass | None:
        """The last reaper pass recorded on this table, or None if none was."""
        last = self.sql.heartbeat.last
        row = self._run(lambda c: c.execute(last).first())
        return None if row is None else ReaperPass(str(row[0]), max(float(row[1]), 0.0))


def record_pass(store: Any, owner: str) -> None:
    """Record that a reaper pass of ``owner`` ended now (``Store.record_pass``)."""
    store.record_pass(owner)


def last_pass(store: Any) -> ReaperPass | None:
    """The last reaper pass recorded on ``store``'s table (``Store.last_pass``)."""
    return store.last_pass()  # type: ignore[no-any-return]


__all__ = ["BeatOps", "ReaperPass", "last_pass", "record_pass"]
