"""A leased task called directly (``task(...)``): it runs here, with no job in the leases
table, and says so when asked for what only a job has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_leases import LeasedTask
from celery_leases.errors import LeaseError
from tests.support.memory import memory_app


def test_a_keyed_task_called_directly_says_it_runs_with_no_job_not_that_it_has_no_key(
    tmp_path: Path,
) -> None:
    app = memory_app("direct", f"sqlite:///{tmp_path}/leases.sqlite3", "leases_direct")

    @app.task(base=LeasedTask, bind=True, shared=False, lease_key="account:{0}")
    def sync(self: Any, account: int) -> Any:
        self.checkpoint({"page": 1})
        return self.lease.cursor

    with pytest.raises(LeaseError) as raised:
        sync(7)

    message = str(raised.value)
    assert message.startswith("a leased task called directly (task(...), not task.delay()")
    assert "no job in the leases table" in message and "in memory only" in message
    assert "has no lease key" not in message
