"""The keeper: one thread per worker process that keeps every lease the process holds.

It renews one row, its holder's (``<table>_holders``), never the rows of the jobs it holds:
each running job bound to it lasts while it renews, whatever their number.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid

from .. import lifecycle
from ..db import Store
from ..db.session import Session
from ..errors import LeaseError
from ..lease import Lease
from ..log import lease_fields
from ..process import leave_signals_to_the_main_thread

logger = logging.getLogger("celery_leases.keeper")


#: Seconds a keeper holding nothing lets pass between two renewals of its holder row: the
#: reaper deletes holders idle for a day (``reaper.HOLDER_IDLE``), never a live keeper's.
IDLE_RENEWAL = 3600.0


class Keeper(threading.Thread):
    """Keeps all leases of one store held by this process: one statement per tick, the
    renewal of its holder row."""

    def __init__(self, store: Store) -> None:
        super().__init__(name="celery-leases-keeper", daemon=True)
        self.store = store
        #: The connection this process's holder is bound to (``Store.expire_orphaned``).
        self.session = store.db.session(shared=one_task_at_a_time())
        self.pid = os.getpid()
        #: This keeper's holder row (``<table>_holders``).
        self.holder = uuid.uuid4().hex
        self.owner = ""
        #: Monotonic time of the holder's last renewal (None: not made yet).
        self._renewed: float | None = None
        self._shortest: float | None = None
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._failing = False
        #: Monotonic time of the next renew tick (None: nothing held).
        self._due: float | None = None
        #: Monotonic time the thread wakes by itself next (None: not before add() wakes it).
        self._wakes_at: float | None = None
        #: Seconds an idle keeper sleeps: the shortest renew interval seen, so that a lease
        #: added later is due no sooner than the keeper wakes anyway.
        self._idle_seconds: float | None = None
        #: Leases whose attempt ended without recording its end, still bound to the holder:
        #: job id -> token, to detach (else they would last as long as the holder renews).
        self._orphans: dict[str, int] = {}
        #: Monotonic time of the next sweep for jobs bound to the holder that it does not
        #: hold (:meth:`sweep`; None: at the first tick's lease from now).
        self._next_sweep: float | None = None
        #: The session was lost to an interrupted statement: renew on a new one at once.
        self._session_lost = False
        self.session.on_lost = self._lost_session

    def add(self, lease: Lease) -> None:
        """Hold ``lease`` from now on: its first renewal is one renew interval away (the claim
        has just set its expiry). The thread is woken only if it would sleep past that, or
        past the lease's stall deadline: a process running one short task after another
        sets no event and switches to no other thread per task."""
        with self._lock:
            self._leases[id(lease)] = lease
            now = time.monotonic()
            needed = now + lease.renew_interval
            self._due = needed if self._due is None else min(self._due, needed)
            if lease.stall_timeout is not None:
                needed = min(needed, lease.last_progress + lease.stall_timeout)
            if self._idle_seconds is None or lease.renew_interval < self._idle_seconds:
                self._idle_seconds = lease.renew_interval
            wake = self._wakes_at is None or needed < self._wakes_at
        if wake:
            self._wake.set()

    def _lost_session(self) -> None:
        """The holder's session ended under an interrupted statement (a soft time limit in a
        checkpoint of a prefork process, whose statements share it): until the holder is
        bound to a new one, the reaper would take it for dead. Wake the keeper to do it now."""
        self._session_lost = True
        self._wake.set()

    def rebind(self) -> None:
        """Renew the holder on a new session, and bind again any held lease a reaper pass
        let go meanwhile (it found the old session gone)."""
        if self._renewed is None:
            self._session_lost = False
            return  # no holder yet: the first claim makes it, on the new session
        held = [lease for lease in self.held() if not (lease.lost or lease.released)]
        shortest = min((lease.duration for lease in held), default=self._shortest or 30.0)
        if not self._renew_quietly(shortest):
            return  # tried again when the keeper next wakes
        self._session_lost = False
        for lease in held:
            self._bind(lease)

    def remove(self, lease: Lease) -> None:
        """Hold ``lease`` no more. An attempt that ended without recording its end (the
        database failed it, its lease was lost to failed renewals, an interrupt) leaves its
        job bound to the holder: the keeper detaches it at once, in its own thread, so that
        its lease runs out and the reaper sends the job again."""
        orphaned = not (lease.released or lease.fenced_out) and self._renewed is not None
        with self._lock:
            self._leases.pop(id(lease), None)
            if orphaned:
                self._orphans[lease.job_id] = lease.token
        if orphaned:
            self._wake.set()

    def held(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    def next_stall(self) -> float | None:
        """The monotonic time the first held lease will count as stalled (None: none can)."""
        deadlines = [
            lease.last_progress + lease.stall_timeout + 0.001
            for lease in self.held()
            if lease.stall_timeout is not None
            and not (lease.stall_reported or lease.lost or lease.released)
        ]
        return min(deadlines) if deadlines else None

    def check_stalls(self) -> list[Lease]:
        """Report (and, with kill_stalled, end) the stalled attempts; the leases to renew."""
        renewable = []
        for lease in self.held():
            if lease.lost or lease.released:
                continue
            if not lease.stalled:
                renewable.append(lease)
            elif not lease.stall_reported:
                lease.stall_reported = True
                self._stalled(lease)
        return renewable

    def holder_for(self, owner: str, duration: float) -> str | None:
        """The holder a claim of this process binds its lease to, its row made or renewed
        first when needed (the first claim of the process, or one after an hour of rest: one
        statement then, none usually). None when it cannot be made (the database is down): the
        claim then binds nothing, and the next tick binds the lease."""
        self.owner = self.owner or owner
        now = time.monotonic()
        if self._renewed is not None and now - self._renewed < IDLE_RENEWAL / 2:
            return self.holder
        try:
            self._renew(duration)
        except LeaseError as exc:
            logger.warning("celery-leases: cannot record this process's holder: %s", exc)
            return None
        return self.holder

    def _renew(self, shortest: float) -> None:
        """Renew (make) the holder row: its leases last ``shortest`` seconds past it."""
        if self._renewed is None:
            self.store.dialect.mark_alive(self.holder)
        self._shortest = shortest
        self.store.renew_holder(
            self.holder, owner=self.owner or "?", shortest=shortest, session=self._bound()
        )
        self._renewed = time.monotonic()

    def tick(self) -> None:
        """Renew the holder once (all held leases with it); bind the leases a claim could not;
        mark the ones stalled."""
        renewable = self.check_stalls()
        if not renewable:
            self._renew_idle()
            return
        sent = time.monotonic()
        if not self._renew_quietly(min(lease.duration for lease in renewable)):
            now = time.monotonic()
            for lease in renewable:
                if now > lease.deadline and not lease.lost:
                    lease.lost = True
                    logger.error(
                        "celery-leases: lease lost on job %s: renewals failed until it expired",
                        lease.job_id,
                        extra=lease_fields(lease),
                    )
            return
        for lease in renewable:
            lease.deadline = max(lease.deadline, sent + lease.duration)
            if not lease.bound:
                self._bind(lease)
        now = time.monotonic()
        if self._next_sweep is None:
            self._next_sweep = now + min(lease.duration for lease in renewable)
        elif now >= self._next_sweep:
            self._next_sweep = now + min(lease.duration for lease in renewable)
            self.sweep(margin=max(lease.renew_interval for lease in renewable))

    def sweep(self, *, margin: float) -> None:
        """Detach the jobs bound to the holder that this keeper does not hold (an attempt
        whose end and whose detach were both lost, a claim whose reply was lost): one read
        per lease's length while leases are held, besides the ticks. ``margin``: a job claimed
        since is left alone (its lease may not be added yet)."""
        try:
            bound = self.store.bound_to(self.holder, margin=margin)
        except LeaseError as exc:
            logger.warning("celery-leases: cannot check this process's bound jobs: %s", exc)
            return
        held = {(lease.job_id, lease.token) for lease in self.held()}
        with self._lock:
            for job_id, token in bound:
                if (job_id, token) not in held:
                    self._orphans.setdefault(job_id, token)
        self._detach_orphans()

    def _detach_orphans(self) -> None:
        """Detach the leases :meth:`remove` and :meth:`sweep` found ended but still bound:
        each ends when the holder's last renewal runs out, and the reaper sends its job
        again. One that cannot be detached now (the database is down) is tried again."""
        with self._lock:
            orphans = list(self._orphans.items())
        for job_id, token in orphans:
            try:
                detached = self.store.detach(job_id, token)
            except LeaseError as exc:
                logger.warning(
                    "celery-leases: job %s: cannot let its ended attempt's lease go yet: %s",
                    job_id,
                    exc,
                )
                return
            with self._lock:
                self._orphans.pop(job_id, None)
            if detached:
                logger.warning(
                    "celery-leases: job %s: its attempt (token %d) ended without recording "
                    "its end; its lease is left to run out, and the reaper sends it again",
                    job_id,
                    token,
                )

    def _renew_idle(self) -> None:
        """Renew the holder of a keeper holding nothing, if an hour has passed."""
        if self._renewed is not None and time.monotonic() - self._renewed >= IDLE_RENEWAL:
            self._renew_quietly(self._shortest or 30.0)

    def _renew_quietly(self, shortest: float) -> bool:
        """:meth:`_renew`, logging a failure once (until a renewal works again)."""
        try:
            self._renew(shortest)
        except LeaseError as exc:
            if not self._failing:
                logger.error("celery-leases: cannot renew leases: %s", exc)
            self._failing = True
            return False
        if self._failing:
            logger.info("celery-leases: renewals work again")
            self._failing = False
        return True

    def _bind(self, lease: Lease) -> None:
        """Bind a lease a claim could not bind (the holder row was missing, or its session
        was cut): until then, its own expiry, which the claim set, is its end."""
        try:
            lease.bound = self.store.bind(lease.job_id, lease.token, self.holder)
        except LeaseError as exc:
            logger.warning(
                "celery-leases: job %s: cannot bind its lease to this process: %s",
                lease.job_id,
                exc,
                extra=lease_fields(lease),
            )

    def _bound(self) -> Session | None:
        """The session to renew on, binding the leases to it; None: renew unbound, through
        the pool (``leases_bind_session`` off, or behind a connection pooler)."""
        if self.store.settings.bind_session and self.session.ident() is not None:
            return self.session
        return None

    def _stalled(self, lease: Lease) -> None:
        """Stop keeping a stalled attempt's lease; with kill_stalled, end its process."""
        try:
            self.store.detach(lease.job_id, lease.token)
        except LeaseError as exc:  # its holder's renewals keep it: the stall is reported again
            lease.stall_reported = False
            logger.warning(
                "celery-leases: could not let stalled job %s go: %s",
                lease.job_id,
                exc,
                extra=lease_fields(lease),
            )
            return
        logger.warning(
            "celery-leases: job %s made no checkpoint for %.0f s: stalled, no longer renewing "
            "its lease so the job moves to another worker",
            lease.job_id,
            lease.stall_timeout or 0,
            extra=lease_fields(lease),
        )
        if not (lease.kill_when_stalled and one_task_at_a_time()):
            return
        try:
            if lifecycle.let_go(self.store, lease.job_id, lease.token):
                lease.released = True
        except LeaseError as exc:
            logger.warning(
                "celery-leases: could not release stalled job %s: %s",
                lease.job_id,
                exc,
                extra=lease_fields(lease),
            )
        logger.error(
            "celery-leases: terminating pool process %d stuck in job %s",
            os.getpid(),
            lease.job_id,
            extra=lease_fields(lease),
        )
        os.kill(os.getpid(), signal.SIGKILL)

    def run(self) -> None:
        leave_signals_to_the_main_thread()
        while not self._stopped.is_set():
            # A stall is acted on when it happens, not at the next renewal (every third of a
            # 30 s lease): a stalled prefork process (leases_kill_stalled) hands its job back
            # and ends then, and the next reaper pass sends the job again; elsewhere renewals
            # stop then, and the job moves when its lease expires.
            stall = self.next_stall()
            now = time.monotonic()
            with self._lock:
                if not self._leases:
                    self._due = None
                due = self._due
                wake = min((t for t in (due, stall) if t is not None), default=None)
                if wake is None and self._idle_seconds is not None:
                    wake = now + self._idle_seconds
                self._wakes_at = wake
            self._wake.wait(None if wake is None else max(wake - now, 0.0))
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                if self._session_lost:
                    self.rebind()
                if self._orphans:
                    self._detach_orphans()
                if due is None or time.monotonic() < due:
                    # Idle, woken by add() or for a stall: a claim has just renewed its
                    # lease, so only the next tick renews it; renewing now would cost one
                    # more committed write per task. A keeper holding nothing renews its
                    # holder hourly, so no reaper takes it for abandoned.
                    self.check_stalls()
                    if due is None:
                        self._renew_idle()
                    continue
                self._next_tick()
                self.tick()
            except Exception:
                logger.exception("celery-leases: keeper tick failed")

    def _next_tick(self) -> None:
        """Set the tick after this one: a renew interval from now (the shortest held)."""
        with self._lock:
            intervals = [lease.renew_interval for lease in self._leases.values()]
            self._due = time.monotonic() + min(intervals) if intervals else None

    def stop(self) -> None:
        """Stop renewing (after a renewal under way, if any)."""
        self._stopped.set()
        self._wake.set()

    def retire(self) -> None:
        """The process is going away, its leases handed back: delete its holder row, take its
        mark away, and end its session."""
        self.stop()
        if self._renewed is not None:
            self._detach_orphans()
            try:
                self.store.drop_holder(self.holder)
            except LeaseError as exc:  # the reaper deletes it once its session is gone
                logger.warning("celery-leases: could not delete this process's holder: %s", exc)
            self.store.dialect.forget_alive(self.holder)
        self.session.close()


def one_task_at_a_time() -> bool:
    """True in a prefork pool process: it runs one task at a time (so its one lease, if any,
    is the running task's, and ending the process frees one pool slot only)."""
    try:
        from billiard.process import current_process
    except ImportError:
        return False
    return bool(current_process().name.startswith("ForkPoolWorker"))


_keepers: dict[tuple[int, int], Keeper] = {}
_keepers_lock = threading.Lock()


def keeper_for(store: Store) -> Keeper:
    """This process's running keeper for ``store`` (started on first use, also after fork)."""
    key = (os.getpid(), id(store))
    with _keepers_lock:
        keeper = _keepers.get(key)
        if keeper is None or not keeper.is_alive():
            keeper = _keepers[key] = Keeper(store)
            keeper.start()
        return keeper


def all_keepers() -> list[Keeper]:
    """The keepers of this process."""
    with _keepers_lock:
        return [k for (pid, _), k in _keepers.items() if pid == os.getpid()]
