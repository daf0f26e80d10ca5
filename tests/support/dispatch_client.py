"""A client process that dispatches leased jobs, for tests that kill it at a chosen point.

Run ``python -m tests.support.dispatch_client`` with the ``app_env`` variables of a scenario
(``tests.support.apps.factory``): it builds ``tests.support.apps.leased_app``'s app from them,
writes ``ready``, then reads one call per line on stdin, ``<job id> <count> <unit seconds>``,
and sends ``e2e.units(count, unit_seconds)`` under that id (``apply_async(task_id=...)``). It
writes ``calling <id>`` just before the call and ``sent <id>`` once it has returned (or
``failed <id> <error>``), each flushed at once, so the test knows where the call is when it
kills the process.
"""

from __future__ import annotations

import sys


def main() -> None:
    from tests.support.apps.leased_app import app

    units = app.tasks["e2e.units"]
    say("ready")
    for line in sys.stdin:
        if not line.strip():
            continue
        job_id, count, unit_seconds = line.split()
        say(f"calling {job_id}")
        try:
            units.apply_async((int(count), float(unit_seconds)), task_id=job_id)
        except Exception as exc:  # reported to the test, which decides
            say(f"failed {job_id} {exc!r}")
        else:
            say(f"sent {job_id}")


def say(line: str) -> None:
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
