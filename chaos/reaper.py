"""A reaper in a PID namespace of its own: ``python -m chaos.reaper``, started by the chaos
driver under ``unshare --user --map-root-user --pid --fork --mount-proc`` (``--namespace-reaper``,
SQLite only), as a second container of one pod sharing the database's volume runs it: same
hostname, its own pids, the workers' processes invisible to it.

It runs a reaper pass (``celery_leases.reaper.reap``) every ``E2E_REAPER_EVERY`` seconds on the
run's database, alongside beat's, and logs what each pass did. A reaper that took the holders it
cannot see for dead would re-send every running job at each pass: two attempts at once (the
chaos check ``never two attempts at once`` catches it).

``CHAOS_REAPER_TAKES_LIVE_HOLDERS=1`` (in the driver's environment) makes it such a reaper, as a
negative control of that check: before each pass it ends the lease of every running job
(``Store.release``, what an operator does for a host known dead).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

from celery_leases.config import settings_for
from celery_leases.db.store import store_for
from celery_leases.reaper import reap
from chaos.app import make_app

READY = "chaos reaper: ready"
#: The negative control: a reaper that takes every live holder for dead.
TAKES_LIVE_HOLDERS = "CHAOS_REAPER_TAKES_LIVE_HOLDERS"


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s",
    )
    for name in ("celery_leases", "celery.task", "celery_leases.reaper"):
        logging.getLogger(name).propagate = True
    every = float(os.environ.get("E2E_REAPER_EVERY") or 1.0)
    app = make_app(os.environ, name="chaos-namespaced-reaper")
    namespace = os.readlink("/proc/self/ns/pid")
    print(
        f"{READY}: pid {os.getpid()} in {namespace} on host {socket.gethostname()}, a pass "
        f"every {every:g} s",
        flush=True,
    )
    broken = os.environ.get(TAKES_LIVE_HOLDERS) == "1"
    store = store_for(settings_for(app))
    while True:
        try:
            if broken:
                for job in store.list_jobs(states=("running",), limit=1000):
                    store.release(job.id)
            report = reap(app)
        except Exception as exc:  # the next pass tries again
            print(f"chaos reaper: pass failed: {exc!r}", flush=True)
        else:
            done = {k: v for k, v in report.as_dict().items() if v}
            if done:
                print(f"chaos reaper: pass {done}", flush=True)
        time.sleep(every)


if __name__ == "__main__":
    sys.exit(main())
