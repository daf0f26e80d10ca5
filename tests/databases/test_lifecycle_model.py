"""A model-based test of the job lifecycle: Hypothesis's stateful testing drives the real store
(``celery_leases.lifecycle`` on a real database, a real in-memory broker) through random
sequences of events over every feature at once, and checks the promises after every step.

Rules (events): calls of plain, keyed (coalescing, newest wins, debounced) and grouped (a limit
and a rate; keyed or debounced too) tasks, by a client or sent by name; a client dying between
its writes; a worker's delivery of any message in the broker (in any order, early, or twice);
an attempt's checkpoint, finish, failure, retry (now or with a countdown) and preemption; its
holder dying; operators' cancel, retry and release; Celery's revoke; lost messages; reaper
passes; the clock moving forward, and stepping back.

Invariants, after every step: never two live runs of a key; a group never over its limit;
tokens that strictly grow at each claim of a job; every start of a rated group's job comes
from an admission made after its previous start, no earlier than its token's time, tokens
spaced by the rate. At the end of each example: once nothing holds anything, a bounded number
of deliveries and reaper passes leaves no job live, and every trigger of a key whose jobs all
ended well was served by a run that started after it (with its arguments or a newer trigger's,
where the newest wins or the key is debounced).

Time is the database's. On SQLite the model holds it: its clock (``julianday('now')``) is a
function of the model's (:class:`Clock`), frozen between steps, so an example replays exactly.
Elsewhere the clock runs, and time moves by shifting every stored time back (or forward, for a
step back). The short form runs in ``make test`` on SQLite, derandomized with a fixed budget;
the long form runs by hand on every database::

    LEASES_MODEL_EXAMPLES=500 LEASES_MODEL_STEPS=120 .venv/bin/python -m pytest \\
        tests/databases/test_lifecycle_model.py -p no:cacheprovider
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_leases import LeasedTask, lifecycle, reap, reaper
from celery_leases.config import settings_for
from celery_leases.db.rows import Claimed, Refused
from celery_leases.db.store import Store, store_for
from celery_leases.errors import Cancelled, LeaseError, Superseded
from celery_leases.lease import Lease
from celery_leases.message import Message
from celery_leases.states import State
from celery_leases.worker.keeper import all_keepers
from tests.support.memory import memory_app
from tests.support.message import job_message

EXAMPLES = int(os.environ.get("LEASES_MODEL_EXAMPLES", "25"))
STEPS = int(os.environ.get("LEASES_MODEL_STEPS", "60"))
RATE = 1.0  # the groups' rate, a second
LIMIT = 1  # the groups' limit
DURATION = 10.0  # leases
QUIET, MAX_WAIT = 2.0, 8.0  # debounce
OWNER = "model/1/1"
#: Rounds of the final drain (each: deliver, run to the end, 12 s pass, a reaper pass).
DRAIN_ROUNDS = 300

#: The tasks: (name, options). Every task takes (x, y, n): x a group or resource, y a key's
#: resource, n the call's number (its arguments).
TASKS: dict[str, dict[str, Any]] = {
    "m.plain": {},
    "m.coalesce": {"lease_key": "c:{1}"},
    "m.newest": {"lease_key": "n:{1}", "lease_key_strategy": "newest"},
    "m.debounced": {"lease_key": "d:{1}", "lease_debounce": (QUIET, MAX_WAIT)},
    "m.grouped": {"lease_group": "g:{0}", "lease_group_limit": LIMIT, "lease_group_rate": RATE},
    "m.keyed_grouped": {
        "lease_key": "kg:{1}",
        "lease_group": "g:{0}",
        "lease_group_limit": LIMIT,
        "lease_group_rate": RATE,
    },
    "m.debounced_grouped": {
        "lease_key": "dg:{1}",
        "lease_debounce": (QUIET, MAX_WAIT),
        "lease_group": "g:{0}",
        "lease_group_limit": LIMIT,
        "lease_group_rate": RATE,
    },
}
#: The time columns of each table, shifted to move the database clock's "now".
TIMES = {
    "jobs": (
        "expires_at", "run_after", "created_at", "claimed_at", "renewed_at", "checkpoint_at",
        "finished_at", "started_at", "admitted_at",
    ),
    "keys": ("cursor_at", "pending_at", "pending_since"),
    "holders": ("renewed_at", "expires_at", "created_at"),
    "groups": ("refilled_at", "admitted_at", "created_at"),
}  # fmt: skip


class Clock:
    """The database clock of an SQLite file, as the model sets it: ``julianday('now')`` on
    every connection the store opens reads :attr:`now` (epoch seconds)."""

    now = 0.0

    @classmethod
    def tick(cls, model: Model) -> None:
        """An event: a millisecond passes, as between two steps of a real run."""
        cls.now += 0.001
        model.events += 1

    @classmethod
    def hook(cls, engine: sa.engine.Engine) -> None:
        """Make ``engine``'s connections read the model's clock."""
        if not sa.event.contains(engine, "connect", _frozen_clock):
            sa.event.listen(engine, "connect", _frozen_clock)


def _frozen_clock(dbapi_connection: Any, _: Any) -> None:
    def julianday(*args: Any) -> float:
        if args != ("now",):
            raise ValueError(f"julianday{args}: only 'now' is the model's")
        return Clock.now / 86400.0 + 2440587.5

    dbapi_connection.create_function("julianday", -1, julianday)


@dataclass
class Call:
    """A trigger: a call of a keyed task (its number, its key, when it came)."""

    n: int
    task: str
    key: str
    #: When it came: the model's event count (the clock may step back; events never do).
    at: int
    #: Its caller saw its id (one that died before it did is owed nothing, but its trigger
    #: still counts as newer than those before it).
    owed: bool = True


@dataclass
class Attempt:
    """An attempt the model's worker holds."""

    job_id: str
    task: str
    lease: Lease
    delivery: Message


@dataclass
class Model:
    calls: list[Call] = field(default_factory=list)
    #: Keys whose runs did not all end well (failed, cancelled, revoked by the model, given up).
    spoiled: set[str] = field(default_factory=set)
    #: Each job's last claimed token, and its last start (database clock).
    tokens: dict[str, int] = field(default_factory=dict)
    starts: dict[str, float] = field(default_factory=dict)
    #: Events so far (each step, each delivery, each end in the final drain).
    events: int = 0
    #: The event of each job's first start.
    first_start: dict[str, int] = field(default_factory=dict)
    #: Admissions (job, admitted_at) made before the clock last stepped back.
    before_step: set[tuple[str, float]] = field(default_factory=set)
    #: Each job's admission (``admitted_at``) its last start came from.
    admitted: dict[str, float] = field(default_factory=dict)
    #: Each rated group's admissions' token times (run_after), since the last step back.
    admissions: dict[str, list[tuple[str, float]]] = field(default_factory=dict)


class Lifecycle(RuleBasedStateMachine):
    """The lifecycle of jobs over every feature, on one database (``DATABASE``)."""

    def __init__(self, database_url: str, table: str) -> None:
        super().__init__()
        self.app = memory_app(
            "lifecycle_model",
            database_url,
            table,
            task_ignore_result=True,
            leases_duration=DURATION,
            leases_queued_timeout=20.0,
            leases_reap_grace=5.0,
            leases_max_attempts_without_progress=None,
        )
        for name, options in TASKS.items():
            self.app.task(base=LeasedTask, shared=False, name=name, **options)(_work)
        self.store: Store = store_for(settings_for(self.app))
        #: SQLite: the model holds the database clock (else it runs, and times are shifted).
        self.frozen = self.store.dialect.name == "sqlite"
        if self.frozen:
            Clock.now = time.time()
            Clock.hook(self.store.engine)
        self.queue = self.app.conf.task_default_queue
        self.inflight: list[Message] = []
        self.attempts: list[Attempt] = []
        self.model = Model()
        self.numbers = 0
        #: Jobs sent by name: they run at once, counted in their group (not admitted).
        self.by_name: set[str] = set()
        #: Messages sent by name no worker has received yet (a trigger once one has).
        self.unseen: dict[str, tuple[str, str, str, int]] = {}
        _clean(self.store)
        reaper._passes.pop(id(self.store), None)  # each example's passes counted from 0
        self.receive()  # the memory broker's queue outlives an example: empty it
        self.inflight.clear()

    def teardown(self) -> None:
        try:
            self.drain()
        finally:
            for keeper in all_keepers():
                if keeper.store is self.store:
                    keeper.stop()
            self.app.close()

    # -- the broker ----------------------------------------------------------------------

    def receive(self) -> None:
        """Move what the broker holds into ``inflight`` (the model's deliveries pick from it)."""
        with self.app.connection_for_write() as connection:
            queue = connection.SimpleQueue(self.queue, no_ack=True)
            try:
                while True:
                    try:
                        raw = queue.get(block=False)
                    except queue.Empty:
                        break
                    info = raw.delivery_info or {}
                    self.inflight.append(
                        Message.published(
                            body=raw.payload,
                            headers=dict(raw.headers),
                            properties=dict(raw.properties),
                            exchange=info.get("exchange", ""),
                            routing_key=info.get("routing_key", self.queue),
                        )
                    )
            finally:
                queue.close()

    # -- clients -----------------------------------------------------------------------------

    def next_number(self) -> int:
        self.numbers += 1
        return self.numbers

    def _trigger(self, name: str, x: str, y: str, n: int, *, owed: bool = True) -> None:
        key = _key_of(name, x, y)
        if key is not None:
            self.model.calls.append(Call(n, name, key, self.model.events, owed))

    @rule(name=st.sampled_from(sorted(TASKS)), x=st.sampled_from("ab"), y=st.sampled_from("pq"))
    def call(self, name: str, x: str, y: str) -> None:
        n = self.next_number()
        self._trigger(name, x, y, n)
        self.app.tasks[name].apply_async((x, y, n), task_id=f"j{n}")
        self.receive()

    @rule(name=st.sampled_from(sorted(TASKS)), x=st.sampled_from("ab"), y=st.sampled_from("pq"))
    def call_by_name(self, name: str, x: str, y: str) -> None:
        n = self.next_number()
        self.by_name.add(f"j{n}")
        # A trigger once a worker has it (a message sent by name that is lost before any
        # worker receives it was never recorded anywhere: nothing can serve it)
        self.unseen[f"j{n}"] = (name, x, y, n)
        self.app.send_task(name, (x, y, n), task_id=f"j{n}", queue=self.queue)
        self.receive()

    @rule(
        name=st.sampled_from(sorted(TASKS)),
        x=st.sampled_from("ab"),
        y=st.sampled_from("pq"),
        before_admission=st.booleans(),
    )
    def client_dies_between_its_writes(
        self, name: str, x: str, y: str, before_admission: bool
    ) -> None:
        """A client records its job, then dies: before its group's admission (its message
        never published), or before its publish."""
        n = self.next_number()
        self._trigger(name, x, y, n, owed=False)
        task = self.app.tasks[name]
        message = job_message(f"j{n}", name, args=[x, y, n], recorded=False, routing_key=self.queue)
        if before_admission:
            # its process dies inside the admission: the record is all it made
            self.store.admit = _dies  # type: ignore[method-assign]
            try:
                lifecycle.record(task, message)
            except ClientDied:
                pass
            finally:
                del self.store.admit
        else:
            lifecycle.record(task, message)  # what it says to publish is never published
        self.receive()

    # -- the worker ---------------------------------------------------------------------

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), duplicate=st.booleans())
    def deliver(self, data: st.DataObject, duplicate: bool) -> None:
        """A worker receives a message (any of the broker's, early or not; ``duplicate``: the
        broker delivers it again later too)."""
        index = data.draw(st.integers(0, len(self.inflight) - 1))
        message = self.inflight[index] if duplicate else self.inflight.pop(index)
        self.worker_gets(message)
        self.receive()

    def worker_gets(self, message: Message) -> None:
        """What a worker does with ``message``: claim its job, or drop it (as the claim
        says)."""
        unseen = self.unseen.pop(message.id, None)
        if unseen is not None:
            self._trigger(*unseen)
        Clock.tick(self.model)
        task = self.app.tasks[message.task]
        delivery = lifecycle.delivered(task, message)
        outcome = lifecycle.claim(
            task, delivery, owner=OWNER, holder=None, fresh=False, connection=None
        )
        if isinstance(outcome, Refused):
            lifecycle.refused(task, outcome, delivery, redelivered=False)
        else:
            self.started(task, delivery, outcome)

    def started(self, task: Any, delivery: Message, outcome: Claimed) -> None:
        job_id = delivery.id
        previous = self.model.tokens.get(job_id)
        assert previous is None or outcome.token > previous, (job_id, previous, outcome.token)
        self.model.first_start.setdefault(job_id, self.model.events)
        self.model.tokens[job_id] = outcome.token
        job = self.store.get(job_id)
        assert job is not None and job.state == State.RUNNING
        self.check_rate(job)
        assert job.claimed_at is not None
        self.model.starts[job_id] = job.claimed_at
        lease = Lease(
            job_id, outcome.token, outcome.attempt, outcome.checkpoint, OWNER, DURATION,
            DURATION / 3, key=delivery.key, group=delivery.group,
        )  # fmt: skip
        self.attempts.append(Attempt(job_id, task.name, lease, delivery))

    def check_rate(self, job: Any) -> None:
        """A start of a rated group's job: admitted after its previous start, not before its
        token's time; the group's token times spaced by its rate."""
        group = job.lease_group
        previous = self.model.starts.get(job.id)
        if group is None or (previous is None and job.id in self.by_name):
            return  # sent by name: its first start is at once, counted in its group, no token
        assert job.admitted_at is not None and job.claimed_at is not None
        # (Compared by value, not by time: the clock may have stepped back in between.)
        assert job.admitted_at != self.model.admitted.get(job.id), (
            f"job {job.id} started again without an admission after its last start"
        )
        self.model.admitted[job.id] = job.admitted_at
        t = self.store.table
        with self.store.engine.connect() as connection:
            run_after = connection.execute(
                sa.select(t.c.run_after).where(t.c.id == job.id)
            ).scalar_one()
        ahead = (run_after or 0.0) - job.claimed_at
        # (A claim after a clock step back runs a job due further ahead than its rate allows.)
        assert ahead <= 1e-3 or ahead > max(1.0, 1 / RATE), f"job {job.id} started {ahead} s early"
        tokens = self.model.admissions.setdefault(group, [])
        if (job.id, job.admitted_at) in self.model.before_step:
            return
        if run_after is not None and (job.id, run_after) not in tokens:
            tokens.append((job.id, run_after))
        times = sorted(at for _, at in tokens)
        for earlier, later in itertools.pairwise(times):
            assert later - earlier >= 1 / RATE - 1e-3, f"group {group}: tokens at {times}"

    def attempt(self, data: st.DataObject) -> Attempt:
        return self.attempts[data.draw(st.integers(0, len(self.attempts) - 1))]

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        held = self.attempt(data)
        task = self.app.tasks[held.task]
        lease = held.lease
        try:
            saved, stop = self.store.checkpoint(lease.job_id, lease.token, '{"done": 1}')
        except LeaseError:
            return
        if not saved:
            self.attempts.remove(held)  # fenced out: a newer attempt holds the job
            return
        if stop == "cancel":
            self.attempts.remove(held)
            lifecycle.stop(task, lease, State.CANCELLED, "cancelled by an operator")
        elif stop == "supersede":
            self.attempts.remove(held)
            lifecycle.stop(task, lease, State.SUPERSEDED, "superseded")
        elif stop == "preempt":
            self.attempts.remove(held)
            if lifecycle.hand_back(task, lease, reap_in=0.0) == State.QUEUED:
                lifecycle.send_again(task, lease, held.delivery)
        self.receive()

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        held = self.attempt(data)
        self.attempts.remove(held)
        lifecycle.finish(self.app.tasks[held.task], held.lease, {"n": held.delivery.args[-1]})
        self.receive()

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        held = self.attempt(data)
        self.attempts.remove(held)
        if lifecycle.fail(self.app.tasks[held.task], held.lease, RuntimeError("boom")):
            self.spoil(held.job_id)
        self.receive()

    @precondition(lambda self: self.attempts)
    @rule(data=st.data(), countdown=st.sampled_from([0.0, 3.0]))
    def retry(self, data: st.DataObject, countdown: float) -> None:
        """Celery's ``self.retry(countdown=...)``: a new message of the job, due then."""
        held = self.attempt(data)
        self.attempts.remove(held)
        task = self.app.tasks[held.task]
        job = self.store.get(held.job_id)
        assert job is not None
        again = job.message.new_version().with_headers(retries=job.message.retries + 1)
        if countdown:
            again = again.with_headers(eta=_iso(self.app.now().timestamp() + countdown))
        try:
            recording = lifecycle.retry_now(task, held.lease, again, countdown, lost=False)
        except (Cancelled, Superseded, LeaseError):  # a cancel or a supersede met it
            self.receive()
            return
        if recording.message is not None:
            recording.message.send(self.app)
        self.receive()

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """A warm shutdown: the attempt hands its job back at its checkpoint."""
        held = self.attempt(data)
        self.attempts.remove(held)
        task = self.app.tasks[held.task]
        if lifecycle.hand_back(task, held.lease, reap_in=0.0) == State.QUEUED:
            lifecycle.send_again(task, held.lease, held.delivery)
        self.receive()

    @precondition(lambda self: self.attempts)
    @rule(data=st.data())
    def holder_dies(self, data: st.DataObject) -> None:
        """The attempt's process dies: its lease lasts until it expires."""
        self.attempts.remove(self.attempt(data))

    # -- operators and Celery ------------------------------------------------------------

    def some_job(self, data: st.DataObject) -> str | None:
        if not self.numbers:
            return None
        return f"j{data.draw(st.integers(1, self.numbers))}"

    @rule(data=st.data())
    def operator_cancels(self, data: st.DataObject) -> None:
        job_id = self.some_job(data)
        if job_id is None:
            return
        try:
            lifecycle.cancel(self.app, self.store, job_id)
        except LeaseError:
            return
        self.spoil(job_id)
        self.receive()

    @rule(data=st.data())
    def operator_retries(self, data: st.DataObject) -> None:
        job_id = self.some_job(data)
        if job_id is None:
            return
        try:
            lifecycle.requeue(self.app, self.store, job_id, queued_timeout=20.0)
        except LeaseError:
            return
        self.receive()

    @rule(data=st.data())
    def operator_releases(self, data: st.DataObject) -> None:
        job_id = self.some_job(data)
        if job_id is not None:
            lifecycle.end_lease(self.store, job_id)

    @rule(data=st.data())
    def celery_revokes(self, data: st.DataObject) -> None:
        job_id = self.some_job(data)
        if job_id is None:
            return
        if lifecycle.end_in_celery(self.app, self.store, job_id, State.REVOKED, "revoked"):
            self.spoil(job_id)
        self.receive()

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def a_message_is_lost(self, data: st.DataObject) -> None:
        lost = self.inflight.pop(data.draw(st.integers(0, len(self.inflight) - 1)))
        self.unseen.pop(lost.id, None)

    @rule()
    def reaper_pass(self) -> None:
        report = reap(self.app)
        for job_id in report.gave_up:
            self.spoil(job_id)
        self.receive()

    # -- the clock ---------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 11.0, 40.0]))
    def time_passes(self, seconds: float) -> None:
        self.shift(-seconds)

    @rule(seconds=st.sampled_from([2.0, 30.0]))
    def the_clock_steps_back(self, seconds: float) -> None:
        # Token times before and after a step are not comparable: those admitted before it
        # are left out of the spacing of tokens
        t = self.store.table
        with self.store.engine.connect() as connection:
            self.model.before_step |= {
                (job_id, at)
                for job_id, at in connection.execute(
                    sa.select(t.c.id, t.c.admitted_at).where(t.c.admitted_at.is_not(None))
                )
            }
        self.model.admissions.clear()
        self.shift(seconds)

    def shift(self, seconds: float) -> None:
        """Move every stored time by ``seconds`` (negative: time passes): on SQLite, the
        clock moves the other way."""
        if self.frozen:
            Clock.now -= seconds
            return
        tables = {
            "jobs": self.store.table,
            "keys": self.store.keys,
            "holders": self.store.holders,
            "groups": self.store.groups_table,
        }
        with self.store.engine.begin() as connection:
            for name, columns in TIMES.items():
                table = tables[name]
                connection.execute(
                    sa.update(table).values({c: table.c[c] + seconds for c in columns})
                )
        for job_id in self.model.starts:
            self.model.starts[job_id] += seconds
        for tokens in self.model.admissions.values():
            tokens[:] = [(job_id, at + seconds) for job_id, at in tokens]

    # -- the promises ----------------------------------------------------------------------

    def spoil(self, job_id: str) -> None:
        job = self.store.get(job_id)
        if job is not None and job.lease_key is not None:
            self.model.spoiled.add(job.lease_key)

    @invariant()
    def never_two_live_runs_of_a_key(self) -> None:
        Clock.tick(self.model)  # (once a step)
        t = self.store.table
        with self.store.engine.connect() as connection:
            found = connection.execute(
                sa.select(t.c.lease_key, sa.func.count())
                .where(t.c.lease_key.is_not(None), t.c.state.in_(("queued", "running")))
                .group_by(t.c.lease_key)
            ).all()
        assert all(count <= 1 for _, count in found), found
        holding: dict[str, int] = {}
        for held in self.attempts:
            job = self.store.get(held.job_id)
            running = job is not None and job.state == State.RUNNING
            if running and job.token == held.lease.token and job.lease_key is not None:
                holding[job.lease_key] = holding.get(job.lease_key, 0) + 1
        assert all(count <= 1 for count in holding.values()), holding

    @invariant()
    def a_group_never_over_its_limit(self) -> None:
        """Its live admitted jobs, those sent by name aside (they run at once, counted)."""
        t = self.store.table
        with self.store.engine.connect() as connection:
            found = connection.execute(
                sa.select(t.c.id, t.c.lease_group).where(
                    t.c.lease_group.is_not(None),
                    t.c.admitted_at.is_not(None),
                    t.c.state.in_(("queued", "running")),
                )
            ).all()
        counts: dict[str, int] = {}
        for job_id, group in found:
            if job_id not in self.by_name:
                counts[group] = counts.get(group, 0) + 1
        assert all(count <= LIMIT for count in counts.values()), (counts, found, self.stuck())

    def drain(self) -> None:
        """Once nothing holds anything: deliver everything, run every attempt to its end,
        let time pass and the reaper run, a bounded number of rounds; then no job is live,
        and every trigger of a key whose runs all ended well was served."""
        self.receive()
        for _ in range(DRAIN_ROUNDS):
            delivered, self.inflight = self.inflight, []
            for message in delivered:
                self.worker_gets(message)
            for held in list(self.attempts):
                Clock.tick(self.model)
                self.attempts.remove(held)
                lifecycle.finish(self.app.tasks[held.task], held.lease, None)
            self.receive()
            if not self.attempts and not self.inflight and not self.live():
                break
            self.shift(-12.0)
            for job_id in reap(self.app).gave_up:
                self.spoil(job_id)
            self.receive()
        assert not self.live(), f"jobs still live once nothing held anything: {self.stuck()}"
        self.check_triggers_served()

    def live(self) -> list[tuple[str, str]]:
        t = self.store.table
        with self.store.engine.connect() as connection:
            return [
                (r[0], r[1])
                for r in connection.execute(
                    sa.select(t.c.id, t.c.state).where(t.c.state.in_(("queued", "running")))
                )
            ]

    def stuck(self) -> list[dict[str, Any]]:
        """The live jobs, as the table has them (for the report of a failure)."""
        t = self.store.table
        columns = (t.c.id, t.c.state, t.c.lease_key, t.c.lease_group, t.c.admitted_at,
                   t.c.run_after, t.c.expires_at, t.c.sends, t.c.stop_requested)  # fmt: skip
        with self.store.engine.connect() as connection:
            now = self.store.now()
            found = connection.execute(
                sa.select(*columns).where(t.c.state.in_(("queued", "running")))
            ).all()
        return [
            {
                c.name: (round(v - now, 2) if c.name.endswith(("_at", "_after")) and v else v)
                for c, v in zip(columns, row, strict=True)
            }
            for row in found
        ]

    def check_triggers_served(self) -> None:
        t = self.store.table
        with self.store.engine.connect() as connection:
            runs = connection.execute(
                sa.select(t.c.id, t.c.lease_key, t.c.state, t.c.started_at, t.c.message).where(
                    t.c.lease_key.is_not(None), t.c.started_at.is_not(None)
                )
            ).all()
            ends = connection.execute(
                sa.select(t.c.lease_key, t.c.state).where(t.c.lease_key.is_not(None))
            ).all()
        order = {call.n: index for index, call in enumerate(self.model.calls)}
        spoiled = set(self.model.spoiled)
        spoiled |= {key for key, state in ends if state in ("failed", "cancelled", "revoked")}
        for call in self.model.calls:
            if call.key in spoiled or not call.owed:
                continue
            served = [
                Message.loads(text).args[-1]
                for job_id, key, state, _, text in runs
                if key == call.key
                and state == "done"
                and self.model.first_start.get(job_id, -1) > call.at
            ]
            rows = [
                (job_id, state, started_at, Message.loads(text).args)
                for job_id, key, state, started_at, text in runs
                if key == call.key
            ]
            assert served, f"trigger {call} was never served by a run that started after it: {rows}"
            options = TASKS[call.task]
            if options.get("lease_key_strategy") == "newest" or "lease_debounce" in options:
                # a trigger's arguments or a newer trigger's (newer: came later; a message sent
                # by name is a trigger when a worker gets it)
                newest = max(order.get(n, -1) for n in served)
                assert newest >= order[call.n], (call, served)


class ClientDied(BaseException):
    """A client process dying in the middle of a call."""


def _dies(*_: Any, **__: Any) -> Any:
    raise ClientDied()


def _work(x: str, y: str, n: int) -> int:
    return n


def _key_of(name: str, x: str, y: str) -> str | None:
    key = TASKS[name].get("lease_key")
    return None if key is None else str(key).format(x, y)


def _iso(timestamp: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat()


def _clean(store: Store) -> None:
    """An empty table for each example."""
    with store.engine.begin() as connection:
        for table in (store.table, store.keys, store.holders, store.groups_table):
            connection.execute(sa.delete(table))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_the_lifecycle_keeps_its_promises_where_features_meet(
    database_url: str, table_name: str
) -> None:
    if not database_url.startswith("sqlite") and "LEASES_MODEL_EXAMPLES" not in os.environ:
        pytest.skip("the long form, on every database, runs by hand (LEASES_MODEL_EXAMPLES)")
    quiet = logging.getLogger("celery_leases")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # thousands of events: their lines are the test's noise
    try:
        run_state_machine_as_test(
            lambda: Lifecycle(database_url, table_name),
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                derandomize="LEASES_MODEL_EXAMPLES" not in os.environ,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                print_blob=True,
                # LEASES_MODEL_SHRINK=0: the first failing example as found (a quick look)
                phases=[
                    p
                    for p in Phase
                    if p != Phase.shrink or os.environ.get("LEASES_MODEL_SHRINK") != "0"
                ],
            ),
        )
    finally:
        quiet.setLevel(level)
