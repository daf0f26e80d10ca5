"""Groups end to end: a group's jobs run at most its limit at once across real workers, first in
first out, each admitted by the worker that ended the one before; another group is not held up.

Real prefork workers (two, ``-c 1`` each) running ``e2e.units``, grouped per call.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest

from tests.support.scenario import Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MakeScenario = Callable[..., Scenario]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_group_of_one_runs_its_jobs_one_at_a_time_in_order_beside_another_group(
    scenario: MakeScenario, celery_settings: dict[str, Any]
) -> None:
    # Given two workers, and four jobs of tenant a (limit 1) sent at once
    s = scenario(celery_settings, lease_seconds=2.0, renew_seconds=0.5)
    s.start_workers(2)
    options = {"lease_group": "tenant:a", "lease_group_limit": 1}
    tenant_a = [s.send("e2e.units", 2, 0.2, **options) for _ in range(4)]
    # and then one of tenant b
    tenant_b = s.send("e2e.units", 2, 0.2, lease_group="tenant:b", lease_group_limit=1)

    # Then every job runs once; tenant a's one after another, in the order they were sent,
    # each started after the one before it ended; tenant b's at once, on the other worker
    for job_id in [*tenant_a, tenant_b]:
        job = s.wait_finished(job_id, timeout=60)
        assert (job.state, job.attempts) == ("done", 1), job
    runs = [s.log.rows(job_id) for job_id in tenant_a]
    spans = [(min(u.started_at for u in r), max(u.ended_at or 0.0 for u in r)) for r in runs]
    for (_, ended), (started, _) in pairwise(spans):
        assert started >= ended
    b_started = min(u.started_at for u in s.log.rows(tenant_b))
    assert b_started < spans[1][0]  # it did not wait behind tenant a's queue
    jobs = [s.job(job_id) for job_id in tenant_a]
    admitted = [j.admitted_at for j in jobs]
    assert all(a is not None for a in admitted) and admitted == sorted(admitted)  # type: ignore[type-var]
