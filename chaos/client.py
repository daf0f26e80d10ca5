"""A client that dies: ``python -m chaos.client <plan.json>``, started by the chaos driver's
``kill_client`` fault and SIGKILLed by it at a seeded moment, as a web process is killed by a
request timeout or the OOM killer.

It makes the calls of its plan one after the other: chaos jobs (``chaos.exactly_once`` /
``chaos.at_least_once``, with the same callbacks the driver sends) and triggers of keyed jobs
(``chaos.keyed``, recorded in the trigger log once the call returned, like the driver's). Its
broker is slow: every publish waits ``publish_delay`` seconds (a random draw in the plan's
range) before it goes out, so the kill often lands between the moment a call recorded its job
and the moment it published it. The keyed calls are made with celery-leases' default
``leases_queued_timeout`` (off), the setting under which a dying client used to block a key for
good; the other calls with the run's.

Each call is announced on stdout (the client's log) before it starts (``recording <id>``), once
its job is recorded and its publish starts (``recorded <id>, publishing``: not for a trigger
coalesced into its key, which publishes nothing) and after it returned (``published <id> ->
<result id>``): the driver's watcher kills the client at a seeded moment after one of those
lines, and can tell afterwards which call the kill interrupted.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from kombu import messaging

from celery_leases.config import settings_for
from celery_leases.db.store import store_for
from chaos.app import KEYED_TASK, make_app, trigger_log_for
from chaos.trigger import account_key

READY = "chaos client: ready"
RECORDING = "chaos client: recording"
RECORDED = "chaos client: recorded"
PUBLISHED = "chaos client: published"
FAILED = "chaos client: call failed"
DONE = "chaos client: every call made"
TASK_OF_MODE = {"exactly_once": "chaos.exactly_once", "at_least_once": "chaos.at_least_once"}


def slow_publish(rng: random.Random, low: float, high: float) -> None:
    """Every publish of this process waits ``low``-``high`` seconds before it goes out (a slow
    network between the client and the broker): the real publish follows. A task message's
    publish comes once its job is recorded: it says so first (``recorded <id>, publishing``)."""
    publish = messaging.Producer.publish

    def slowly(self: Any, *args: Any, **kwargs: Any) -> Any:
        job_id = (kwargs.get("headers") or {}).get("id")
        if job_id:
            print(f"{RECORDED} {job_id}, publishing", flush=True)
        time.sleep(rng.uniform(low, high))
        return publish(self, *args, **kwargs)

    messaging.Producer.publish = slowly  # type: ignore[method-assign]


def keyed_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with celery-leases' default ``leases_queued_timeout`` (off)."""
    config = json.loads(environ.get("TEST_CELERY_CONFIG") or "{}")
    config.pop("leases_queued_timeout", None)
    return {**environ, "TEST_CELERY_CONFIG": json.dumps(config)}


def main(argv: list[str]) -> int:
    plan = json.loads(Path(argv[0]).read_text())
    environ = dict(os.environ)
    app = make_app(environ, name="chaos-dying-client")
    keyed_app = make_app(keyed_environment(environ), name="chaos-dying-client-keyed")
    store = store_for(settings_for(app))
    triggers = trigger_log_for(keyed_app)
    slow_publish(random.Random(plan["seed"]), *plan["publish_delay"])
    store.now()  # connected before the first call
    print(f"{READY} (pid {os.getpid()})", flush=True)
    for call in plan["calls"]:
        print(f"{RECORDING} {call['id']}", flush=True)
        try:
            if call["kind"] == "job":
                result = app.tasks[TASK_OF_MODE[call["mode"]]].apply_async(
                    (plan["units"], plan["unit_seconds"]),
                    task_id=call["id"],
                    link=app.signature("chaos.on_done", args=(call["id"],)),
                    link_error=app.signature("chaos.errback"),
                )
                served = str(result.id)
            else:
                account, key = account_key(call["account"])
                at = store.now()
                served = str(
                    keyed_app.tasks[KEYED_TASK]
                    .apply_async(
                        (account, plan["key_units"], plan["unit_seconds"]), task_id=call["id"]
                    )
                    .id
                )
                triggers.add(key, call["id"], served, at)
        except Exception as exc:  # the broker or the database is restarting: next call
            print(f"{FAILED} {call['id']}: {exc!r}", flush=True)
            continue
        print(f"{PUBLISHED} {call['id']} -> {served}", flush=True)
    print(DONE, flush=True)
    time.sleep(3600)  # until the driver kills it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
