"""The worker wing, mirroring ``celery/worker/``: what runs in a worker's processes besides the
task body.

- ``request.py``: a leased job's request in the worker's main process (a pool process that
  died, a revoke that terminates);
- ``deaths.py``: the main process's watch for dead pool processes;
- ``keeper.py``: the thread of each process that renews every lease the process holds;
- ``signals.py``: the worker's signals (shutdown, unknown tasks, revokes, failures);
- ``startup.py``: the checks at worker and beat start;
- ``watch.py``: the main process's warning while no reaper pass happens.

:func:`connect` connects the signals once, when a ``LeasedTask`` or the reaper is first bound
to an app: importing the package connects nothing.
"""

from __future__ import annotations

import threading

from .. import event
from . import signals, startup, watch

_connected = False
_lock = threading.Lock()


def connect() -> None:
    """Connect the worker's and beat's signal receivers (once per process)."""
    global _connected
    with _lock:
        if _connected:
            return
        for signal, receiver in (
            *startup.RECEIVERS,
            *signals.RECEIVERS,
            *watch.RECEIVERS,
            *event.RECEIVERS,
        ):
            signal.connect(receiver, weak=False)
        _connected = True


__all__ = ["connect"]
