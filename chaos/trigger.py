"""The triggers of a chaos run's keyed jobs: a seeded plan of bursts, and the thread that sends
them as a webhook receiver would.

A *burst* is a few calls of ``chaos.keyed`` for one account (lease key ``account:<account>``),
some tenths of a second apart, sent when the run's progress reaches the burst's moment: some
start a job, most land while the key's job waits or runs and are coalesced into it. The
:class:`Sender` makes the calls from a thread of its own, one at a time, so a call that waits
(on the key's row, locked by a transaction of a frozen worker) never holds up the driver's
faults and thaws. Each call is recorded in the trigger log with the database clock read just
before it; a call that raises is recorded as such and sent again as a new call (a provider
retries a delivery that failed).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Seconds before a call that raised is sent again (as a new call, with a new id).
RETRY_AFTER = 1.0
#: Seconds the sender keeps trying to record a call while the database is unreachable.
RECORD_PATIENCE = 60.0


@dataclass(frozen=True)
class Burst:
    """``len(gaps) + 1`` triggers of account ``k<account>``, sent when the run's progress
    (fraction of units) reaches ``at``; ``gaps`` are the seconds between two of them."""

    number: int
    account: int
    at: float
    gaps: tuple[float, ...]

    @property
    def size(self) -> int:
        return len(self.gaps) + 1

    def describe(self, account: str | None = None) -> str:
        """``account``: the account's name (default ``k<account>``)."""
        name = account or f"k{self.account}"
        return f"#{self.number} {name} x{self.size} @{self.at:.0%}"


def plan(rng: random.Random, *, triggers: int, keys: int, largest: int, gap: float) -> list[Burst]:
    """Bursts of 1 to ``largest`` triggers, ``triggers`` in all, for ``keys`` accounts, at
    moments spread over 3-92% of the run's progress, at most ``gap`` seconds between two
    triggers of a burst; in the order they are sent."""
    sizes: list[int] = []
    while sum(sizes) < triggers:
        sizes.append(rng.randint(1, min(largest, triggers - sum(sizes))))
    drawn = sorted(
        (
            rng.uniform(0.03, 0.92),
            rng.randrange(keys),
            tuple(rng.uniform(0.0, gap) for _ in range(n - 1)),
        )
        for n in sizes
    )
    return [
        Burst(number, account, at, gaps)
        for number, (at, account, gaps) in enumerate(drawn, start=1)
    ]


def account_key(account: int, *, keys: int | None = None, debounced: int = 0) -> tuple[str, str]:
    """The account argument of account number ``account``, and its lease key: ``k<n>`` for
    the first ``keys`` accounts (all of them when None: coalescing triggers), then ``d<n>``
    for ``debounced`` accounts (debounced triggers), then ``n<n>`` (newest wins)."""
    if keys is None or account < keys:
        name = f"k{account}"
    elif account < keys + debounced:
        name = f"d{account - keys}"
    else:
        name = f"n{account - keys - debounced}"
    return name, f"account:{name}"


@dataclass
class _Due:
    when: float  # monotonic seconds
    account: int
    trigger_id: str


class Sender(threading.Thread):
    """Sends the triggers of scheduled bursts when they are due, one at a time, in order.

    ``call(account, trigger_id)`` makes one call and returns the id of the job that serves it;
    ``accounts(number)`` names an account and its key (:func:`account_key`);
    ``clock()`` reads the database clock; ``record(key, trigger_id, served, at, error)`` adds a
    row to the trigger log. ``out`` prints a line of the run's log."""

    def __init__(
        self,
        *,
        call: Callable[[str, str], str],
        clock: Callable[[], float],
        record: Callable[..., None],
        out: Callable[[str], None],
        prefix: str,
        accounts: Callable[[int], tuple[str, str]] = account_key,
    ) -> None:
        super().__init__(name="chaos-triggers", daemon=True)
        self._call, self._clock, self._record, self._out = call, clock, record, out
        self._accounts = accounts
        self._prefix = prefix
        self._due: list[_Due] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._busy = False
        self.sent = 0
        self.failed = 0
        #: The longest call, in seconds (a call waits while the key's row is locked).
        self.longest = 0.0

    def schedule(self, burst: Burst) -> None:
        """Send ``burst``'s triggers from now on, its gaps apart."""
        when = time.monotonic()
        with self._lock:
            for index, gap in enumerate((0.0, *burst.gaps)):
                when += gap
                trigger_id = f"{self._prefix}-t{burst.number:03d}-{index}"
                self._due.append(_Due(when, burst.account, trigger_id))
            self._due.sort(key=lambda d: d.when)
        self._wake.set()

    @property
    def idle(self) -> bool:
        """Nothing left to send, and no call under way."""
        with self._lock:
            return not self._due and not self._busy

    def stop(self, timeout: float) -> bool:
        """Stop sending; False if a call was still under way after ``timeout`` seconds."""
        self._stopping.set()
        self._wake.set()
        self.join(timeout)
        return not self.is_alive()

    def run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                now = time.monotonic()
                due = self._due.pop(0) if self._due and self._due[0].when <= now else None
                self._busy = due is not None
                wait = (self._due[0].when - now) if self._due else 1.0
            if due is None:
                self._wake.wait(max(0.01, min(wait, 1.0)))
                self._wake.clear()
                continue
            try:
                self._send(due)
            except Exception as exc:  # never die silently: the run would wait for nothing
                self._out(f"chaos: trigger {due.trigger_id} not sent: {exc!r}")
            finally:
                with self._lock:
                    self._busy = False

    def _send(self, due: _Due) -> None:
        account, key = self._accounts(due.account)
        at = self._patiently(self._clock)
        started = time.monotonic()
        try:
            served = self._call(account, due.trigger_id)
        except Exception as exc:  # the broker or the database is restarting
            self.failed += 1
            error = repr(exc)
            self._patiently(lambda: self._record(key, due.trigger_id, None, at, error))
            with self._lock:
                self._due.append(
                    _Due(time.monotonic() + RETRY_AFTER, due.account, f"{due.trigger_id}r")
                )
                self._due.sort(key=lambda d: d.when)
            return
        self.longest = max(self.longest, time.monotonic() - started)
        self.sent += 1
        self._patiently(lambda: self._record(key, due.trigger_id, served, at, None))

    @staticmethod
    def _patiently(operation: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + RECORD_PATIENCE
        while True:
            try:
                return operation()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
