"""Job groups against real databases: at most the group's limit of its jobs admitted (in the
broker or running) at once, the others recorded and waiting unpublished, admitted first in
first out as jobs end, round-robin across groups by the reaper, never over the limit under
concurrent admissions, and a rate limit kept as a token bucket on the database clock."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_leases import LeasedTask, control, lifecycle, reap
from celery_leases.config import settings_for
from celery_leases.db.rows import Claimed, Refused
from celery_leases.db.store import Store, store_for
from celery_leases.errors import ArgumentsError
from celery_leases.message import GROUP_HEADER, Message
from celery_leases.settings import DEFAULTS, validate
from celery_leases.worker.keeper import all_keepers
from celery_leases.worker.signals import record_revoke
from tests.databases.test_keys import published
from tests.support.concurrent import at_once
from tests.support.message import job_message

OWNER = "worker-a/1"


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


def member(job_id: str, group: str = "tenant:a", queue: str = "celery") -> Message:
    return job_message(
        job_id, "tests.work", args=[group, 0], routing_key=queue, **{GROUP_HEADER: group}
    )


def waiting(store: Store, group: str = "tenant:a") -> list[str]:
    """The group's waiting jobs, oldest first."""
    t = store.table
    with store.engine.connect() as connection:
        return list(
            connection.execute(
                sa.select(t.c.id)
                .where(t.c.lease_group == group, t.c.state == "queued", t.c.admitted_at.is_(None))
                .order_by(*store.dialect.arrival_order(t))
            ).scalars()
        )


def admitted_live(store: Store, group: str = "tenant:a") -> int:
    t = store.table
    with store.engine.connect() as connection:
        return int(
            connection.execute(
                sa.select(sa.func.count()).where(
                    t.c.lease_group == group,
                    t.c.state.in_(("queued", "running")),
                    t.c.admitted_at.is_not(None),
                )
            ).scalar_one()
        )


def recorded_waiting(
    store: Store, ids: list[str], group: str = "tenant:a", queue: str = "celery"
) -> None:
    for job_id in ids:
        assert store.register(member(job_id, group, queue)).outcome == "new"


def finished(store: Store, job_id: str) -> None:
    job = store.get(job_id)
    assert job is not None
    outcome = store.claim(job.message, owner=OWNER, duration=30.0)
    assert isinstance(outcome, Claimed), outcome
    assert store.finish(job_id, outcome.token, result=None)


def test_a_recorded_job_of_a_group_waits_unpublished_and_is_never_claimed_or_re_sent(
    store: Store,
) -> None:
    recorded_waiting(store, ["w1"])

    # Its message, published anyway (an older release's follow-up), is dropped at its claim
    message = store.get("w1").message  # type: ignore[union-attr]
    outcome = store.claim(message, owner=OWNER, duration=30.0)

    assert isinstance(outcome, Refused) and outcome.reason == "waiting"
    job = store.get("w1")
    assert job is not None and job.waiting and job.expires_in is None
    # The reaper's expiry path never sees it: it has no expiry
    assert store.collect_expired(batch=10, grace=5.0, max_stalled=None, max_attempts=None) == (
        store.collect_expired(batch=10, grace=5.0, max_stalled=None, max_attempts=None)
    )
    assert store.get("w1").waiting  # type: ignore[union-attr]


def test_an_end_makes_room_for_the_next_waiting_job_first_in_first_out(store: Store) -> None:
    recorded_waiting(store, [f"j{n}" for n in range(5)])

    first = store.admit("tenant:a", limits=(2, None), define=True)

    assert [a.id for a in first] == ["j0", "j1"]
    assert waiting(store) == ["j2", "j3", "j4"]
    assert store.admit("tenant:a") == []  # full: nothing more until an end
    finished(store, "j1")
    assert [a.id for a in store.admit("tenant:a")] == ["j2"]
    finished(store, "j0")
    finished(store, "j2")
    assert [a.id for a in store.admit("tenant:a")] == ["j3", "j4"]
    assert waiting(store) == [] and admitted_live(store) == 2


def test_concurrent_admissions_and_ends_never_admit_more_than_the_limit(store: Store) -> None:
    limit, threads, jobs_each = 3, 6, 5
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(admitted_live(store))

    watcher = threading.Thread(target=watch)
    watcher.start()

    def client_and_worker(n: int) -> int:
        # Each thread records its jobs and admits, as a client; then, as a worker, ends the
        # admitted jobs it finds and admits the next ones, racing the others.
        ran = 0
        for i in range(jobs_each):
            store.register(member(f"c{n}-{i}"))
            store.admit("tenant:a", limits=(limit, None), define=True)
            time.sleep(random.uniform(0, 0.01))
        for _ in range(threads * jobs_each * 4):
            job = next(
                (
                    j
                    for j in store.list_jobs(states=("queued",), limit=500)
                    if j.lease_group == "tenant:a" and j.admitted_at is not None
                ),
                None,
            )
            if job is None:
                if not waiting(store):
                    break
                store.admit("tenant:a")
                continue
            outcome = store.claim(job.message, owner=f"w{n}", duration=30.0)
            if isinstance(outcome, Claimed):
                assert store.finish(job.id, outcome.token, result=None)
                ran += 1
            store.admit("tenant:a")
        return ran

    try:
        ran = at_once(threads, client_and_worker)
    finally:
        stop.set()
        watcher.join()

    assert sum(ran) == threads * jobs_each  # every job ran once
    assert waiting(store) == []
    assert seen and max(seen) <= limit


def test_a_reaper_pass_admits_the_waiting_jobs_of_groups_round_robin(app: Celery) -> None:
    store = store_for(settings_for(app))
    # Given two groups whose jobs were recorded but whose admitter died before admitting
    queue = app.conf.task_default_queue
    recorded_waiting(store, ["a1", "a2", "a3"], "tenant:a", queue)
    recorded_waiting(store, ["b1", "b2"], "tenant:b", queue)
    for group in ("tenant:a", "tenant:b"):
        store.admit(group, limits=(3, None), define=True, most=0)

    report = reap(app)

    assert report.admitted == ["a1", "b1", "a2", "b2", "a3"]
    assert sorted(published(app)) == ["a1", "a2", "a3", "b1", "b2"]


def test_a_crashed_enders_group_is_admitted_and_its_unpublished_admission_re_sent(
    app: Celery,
) -> None:
    store = store_for(settings_for(app))
    work = app.tasks["tests.work"]
    calls = [work.apply_async(("t1", n), lease_group_limit=1) for n in range(3)]
    assert published(app) == [calls[0].id]
    # The worker that ran the first job died between its end and its admission
    finished(store, calls[0].id)

    assert reap(app).admitted == [calls[1].id]
    assert published(app) == [calls[1].id]
    assert waiting(store, "t1") == [calls[2].id]
    # An admitter that died between its admission and its publish: once its wait has passed,
    # the reaper hands the admitted job back to its group, whose admission sends it again
    # (first in line, it takes its place back, and a token of its rate)
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(t).where(t.c.id == calls[1].id).values(expires_at=t.c.expires_at - 3600)
        )
    report = reap(app)
    assert report.returned == [calls[1].id] and report.republished == []
    assert published(app) == [calls[1].id]
    assert waiting(store, "t1") == [calls[2].id]


def test_five_calls_of_a_group_of_two_publish_two_and_return_every_id_at_once(
    app: Celery,
) -> None:
    store = store_for(settings_for(app))

    calls = [app.tasks["tests.work"].delay("t1", n) for n in range(5)]

    assert published(app) == [c.id for c in calls[:2]]
    assert waiting(store, "t1") == [c.id for c in calls[2:]]
    job = store.get(calls[4].id)
    assert job is not None and job.lease_group == "t1" and job.waiting
    # Another group has room of its own; a call's own group and limit override the task's
    other = app.tasks["tests.work"].apply_async(
        ("t2", 0), lease_group="vip", lease_group_limit=lambda name: 10
    )
    assert published(app) == [other.id]
    assert store.groups()[-1].name == "vip"
    rows = {g.name: (g.limit, g.admitted, g.waiting) for g in store.groups()}
    assert rows == {"t1": (2, 2, 3), "vip": (10, 1, 0)}


def test_a_burst_of_calls_of_a_group_is_admitted_first_in_first_out(app: Celery) -> None:
    # Given a burst of calls of a group of one, several in each tick of SQLite's clock (a
    # millisecond)
    store = store_for(settings_for(app))
    task = app.tasks["tests.work"]
    calls = [task.apply_async(("t1", n), lease_group_limit=1) for n in range(30)]
    admitted = published(app)

    # When each admitted job is cancelled in turn (its room goes to the next at once)
    for _ in calls[1:]:
        control.cancel(app, store, admitted[-1])
        admitted += published(app)

    # Then they were admitted in the order they were called
    assert admitted == [c.id for c in calls]


def test_an_operator_cancel_of_an_admitted_job_admits_the_next_at_once(app: Celery) -> None:
    store = store_for(settings_for(app))
    calls = [app.tasks["tests.work"].delay("t1", n) for n in range(4)]
    assert published(app) == [c.id for c in calls[:2]]

    # When an operator cancels a waiting job, then an admitted (queued) one
    said_waiting = control.cancel(app, store, calls[3].id)
    assert published(app) == []
    said_admitted = control.cancel(app, store, calls[0].id)

    # Then each is told as it is: the waiting one was never sent, the admitted one's message
    # is dropped when a worker receives it
    assert said_waiting.endswith(
        "cancelled: it was never sent (it waited for its group's admission)"
    )
    assert said_admitted.endswith("cancelled: its message is dropped when a worker receives it")
    # ... the waiting one never runs, and the admitted one's room went to the next at once,
    # not at the reaper's next pass
    assert published(app) == [calls[2].id]
    assert waiting(store, "t1") == []
    assert admitted_live(store, "t1") == 2


def test_a_job_celery_revokes_in_the_worker_admits_the_next_at_once(app: Celery) -> None:
    store = store_for(settings_for(app))
    calls = [app.tasks["tests.work"].delay("t1", n) for n in range(3)]
    assert published(app) == [c.id for c in calls[:2]]

    # When the worker's main process discards an admitted job's message as revoked (the
    # receiver of Celery's task_revoked signal)
    request = SimpleNamespace(id=calls[0].id, hostname="worker@test")
    record_revoke(sender=app.tasks["tests.work"], request=request)

    # Then it ends revoked, and its room goes to the next waiting job at once
    assert store.get(calls[0].id).state == "revoked"  # type: ignore[union-attr]
    assert published(app) == [calls[2].id]
    assert waiting(store, "t1") == []


def test_an_operator_retry_of_a_grouped_job_waits_for_its_admission(app: Celery) -> None:
    store = store_for(settings_for(app))
    task = app.tasks["tests.work"]
    calls = [task.apply_async(("t1", n), lease_group_limit=1) for n in range(2)]
    assert published(app) == [calls[0].id]
    # Given the first job failed and the second admitted in its room
    job = store.get(calls[0].id)
    assert job is not None
    outcome = store.claim(job.message, owner=OWNER, duration=30.0)
    assert isinstance(outcome, Claimed)
    assert store.fail(job.id, outcome.token, error="boom")
    assert [a.id for a in lifecycle.admit(app, store, "t1")] == [calls[1].id]
    assert published(app) == [calls[1].id]

    # When an operator retries the failed one while the group is full
    said = control.retry(app, store, calls[0].id)

    # Then it waits for its admission, unpublished, and is admitted when the room frees
    assert "waits for its admission in group t1" in said
    assert published(app) == []
    assert waiting(store, "t1") == [calls[0].id]
    finished(store, calls[1].id)
    assert [a.id for a in lifecycle.admit(app, store, "t1")] == [calls[0].id]
    assert published(app) == [calls[0].id]


def test_a_callable_limit_gives_each_group_its_tier(app: Celery) -> None:
    store = store_for(settings_for(app))
    tiered = app.tasks["tests.tiered"]

    calls = [tiered.delay(tenant, n) for tenant in ("free", "paid") for n in range(4)]

    assert len(published(app)) == 1 + 3
    rows = {g.name: (g.limit, g.admitted, g.waiting) for g in store.groups()}
    assert rows == {"tenant:free": (1, 1, 3), "tenant:paid": (3, 3, 1)}
    assert store.get(calls[0].id).lease_group == "tenant:free"  # type: ignore[union-attr]


def test_a_keyed_jobs_follow_up_waits_in_its_group_and_is_admitted_when_there_is_room(
    app: Celery,
) -> None:
    store = store_for(settings_for(app))
    keyed = app.tasks["tests.keyed"]
    # Given a keyed job of tenant t1 (limit 1) running, and a job of another key of t1 waiting
    run = keyed.delay("t1", "a")
    other = keyed.delay("t1", "b")
    assert published(app) == [run.id] and waiting(store, "t1") == [other.id]
    job = store.get(run.id)
    assert job is not None
    lease = store.claim(job.message, owner=OWNER, duration=30.0)
    assert isinstance(lease, Claimed)
    # When a trigger of the running key comes, and the run ends
    trigger = keyed.delay("t1", "a")
    assert trigger.id != run.id and published(app) == []
    assert store.finish(run.id, lease.token, result=None)
    lifecycle.settle(app, store, "acct:a")
    lifecycle.admit(app, store, "t1")

    # Then the key's follow-up is recorded in the group, behind the job that waited first:
    # the group's one slot goes to that job, and the follow-up waits for the next
    assert published(app) == [other.id]
    assert waiting(store, "t1") == [trigger.id]
    followup = store.get(trigger.id)
    assert followup is not None and followup.lease_key == "acct:a" and followup.waiting


def test_a_debounced_call_of_a_group_waits_out_its_quiet_then_for_its_admission(
    app: Celery,
) -> None:
    store = store_for(settings_for(app))

    @app.task(
        base=LeasedTask, shared=False, name="tests.both", lease_key="k:{0}",
        lease_debounce=(1.0, 5.0), lease_group="{0}", lease_group_limit=1,
    )  # fmt: skip
    def both(tenant: str, payload: int) -> int:
        return payload

    task = app.tasks["tests.both"]
    # Given a burst of two debounced calls of one key in group t1
    first = task.delay("t1", 1)
    later = task.delay("t1", 2)

    # Then one job, with the newest arguments, waits unadmitted until its quiet is over (no
    # place under the limit, no token, for a start that comes later); its messages go for its
    # due time, to ask for its admission then
    assert later.id == first.id
    job = store.get(first.id)
    assert job is not None and job.waiting and job.message.args == ["t1", 2]
    assert published(app) == [first.id, first.id]
    assert store.admit("t1") == []  # not due: passed over
    # When its due time has come and its message arrives
    t = store.table
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(t).where(t.c.id == first.id).values(run_after=t.c.run_after - 2)
        )
    delivery = store.get(first.id).message  # type: ignore[union-attr]
    refused = store.claim(delivery, owner=OWNER, duration=30.0)
    assert isinstance(refused, Refused) and refused.reason == "waiting"
    lifecycle.refused(task, refused, delivery, redelivered=False)

    # Then its group admits it and publishes it, and its claim runs the newest arguments
    assert published(app) == [first.id]
    claimed = store.claim(store.get(first.id).message, owner=OWNER, duration=30.0)  # type: ignore[union-attr]
    assert isinstance(claimed, Claimed)


def test_a_group_limit_that_is_not_a_positive_int_is_refused_and_nothing_is_recorded(
    app: Celery,
) -> None:
    with pytest.raises(ArgumentsError, match="lease_group_limit"):
        app.tasks["tests.work"].apply_async(("t1", 0), lease_group_limit=0)
    with pytest.raises(ArgumentsError, match="lease_group_rate"):
        app.tasks["tests.work"].apply_async(("t1", 0), lease_group_rate="fast")
    assert store_for(settings_for(app)).list_jobs() == []


def test_a_rate_of_5_a_second_spaces_the_admissions_by_the_database_clock(
    store: Store,
) -> None:
    ids = [f"r{n:02d}" for n in range(12)]
    recorded_waiting(store, ids, "api")

    # Admissions as jobs end or the reaper passes: each takes the tokens due within a second
    first = store.admit("api", limits=(None, 5.0), define=True)
    for _ in range(40):
        if not waiting(store, "api"):
            break
        time.sleep(0.25)
        store.admit("api")

    assert waiting(store, "api") == []
    t = store.table
    with store.engine.connect() as connection:
        found = connection.execute(
            sa.select(t.c.id, t.c.run_after, t.c.admitted_at)
            .where(t.c.lease_group == "api")
            .order_by(t.c.run_after)
        ).all()
    assert [r.id for r in found] == ids  # first in, first out
    starts = [float(r.run_after) for r in found]
    # A token every 0.2 s, a bucket of one (Celery's): never two starts closer than that, so
    # never more than 5 in any second
    assert min(b - a for a, b in itertools.pairwise(starts)) >= 0.2 - 1e-6
    assert max(sum(1 for s in starts if t0 <= s < t0 + 1.0) for t0 in starts) <= 5
    # Taken at most a second ahead of its token: its claim waits for its time
    assert all(float(r.run_after) - float(r.admitted_at) <= 1.0 + 1e-6 for r in found)
    assert len(first) == 6
    late = store.get(first[-1].id)
    assert late is not None
    outcome = store.claim(late.message, owner=OWNER, duration=30.0)
    if float(found[5].run_after) > store.ping():  # (it may have come due meanwhile)
        assert isinstance(outcome, Refused) and outcome.reason == "early"


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("group_tests", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        leases_database_url=database_url,
        leases_table=table_name,
        task_ignore_result=True,
        task_default_queue=table_name,
    )

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.work",
        lease_group="{tenant}",
        lease_group_limit=2,
    )
    def work(self: LeasedTask, tenant: str, n: int) -> Any:
        return n

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.tiered",
        lease_group=lambda tenant, n: f"tenant:{tenant}",
        lease_group_limit=lambda group: 1 if group == "tenant:free" else 3,
    )
    def tiered(self: LeasedTask, tenant: str, n: int) -> Any:
        return n

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="tests.keyed",
        lease_key="acct:{account}",
        lease_group="{tenant}",
        lease_group_limit=1,
    )
    def keyed(self: LeasedTask, tenant: str, account: str) -> Any:
        return account

    yield app
    store = store_for(settings_for(app))
    for keeper in all_keepers():
        if keeper.store is store:
            keeper.stop()
            keeper.join(timeout=5)
    store.engine.dispose()
    app.close()
