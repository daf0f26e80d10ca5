"""The Celery app of the example: its settings, and the sync task.

Settings come from environment variables, so the demo (and you) can switch them:

- ``WEBHOOK_SYNC_BROKER``: broker URL. Default ``atomicfs://``: files under the data folder, no
  server (the demo's ``demo/fs_transport.py``). Also ``redis://...``, ``amqp://...``, ``sqla+sqlite:///...``.
- ``WEBHOOK_SYNC_DATABASE``: SQLAlchemy URL of the leases table, of ``synced_events`` and of
  the receiver's ``deliveries``. Default: ``webhook_sync.sqlite3`` in the data folder.
- ``WEBHOOK_SYNC_DATA``: the data folder. Default ``.demo`` in the working directory.
- ``WEBHOOK_SYNC_UPSTREAM``: base URL of the events API. Default ``http://127.0.0.1:8765``.
- ``WEBHOOK_SYNC_PAGE_SIZE``: events per page. Default 100.
- ``WEBHOOK_SYNC_NAME``: prefix of the tables and name of the queue. Default ``webhook_sync``.
- ``WEBHOOK_SYNC_SECRET``: the secret webhooks are signed with (the receiver refuses to start
  without one; see ``signature.py``).

Run a worker: ``celery -A examples.webhook_sync.app worker -l info``, and beat (the reaper):
``celery -A examples.webhook_sync.app beat -l info``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery
from celery.signals import beat_init, worker_init
from celery.utils.log import get_task_logger
from sqlalchemy.engine import Engine

from celery_leases import LeasedTask, schedule_reaper

from . import deliveries, sink
from .client import EventsClient, UpstreamBusy

DATA = Path(os.environ.get("WEBHOOK_SYNC_DATA", ".demo")).resolve()
BROKER = os.environ.get("WEBHOOK_SYNC_BROKER", "atomicfs://")
DATABASE = os.environ.get("WEBHOOK_SYNC_DATABASE", f"sqlite:///{DATA / 'webhook_sync.sqlite3'}")
UPSTREAM = os.environ.get("WEBHOOK_SYNC_UPSTREAM", "http://127.0.0.1:8765")
PAGE_SIZE = int(os.environ.get("WEBHOOK_SYNC_PAGE_SIZE", "100"))
NAME = os.environ.get("WEBHOOK_SYNC_NAME", "webhook_sync")

LEASES_TABLE = f"{NAME}_leases"
EVENTS = sink.events_table(f"{NAME}_synced_events")
DELIVERIES = deliveries.deliveries_table(f"{NAME}_deliveries")
#: Seconds a lease lasts without renewal, and between reaper passes. Short, so the demo resumes
#: a killed job within seconds; in production keep the defaults (30 s and 10 s).
LEASE_SECONDS = 2.0
REAP_EVERY_SECONDS = 1.0

app = Celery("webhook_sync", broker=BROKER)
app.conf.update(
    leases_database_url=DATABASE,
    leases_table=LEASES_TABLE,
    leases_duration=LEASE_SECONDS,
    # A message a killed worker had taken but not started is gone with it on a serverless
    # broker (and on Redis for an hour): after this many seconds in the queue the reaper
    # publishes the job again.
    leases_queued_timeout=10.0,
    task_default_queue=NAME,
    control_exchange=f"{NAME}_control",
    task_ignore_result=True,
    # A worker busy with a long sync takes no other message that would wait behind it.
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
if BROKER.startswith(("atomicfs:", "filesystem:")):
    # The demo's broker: message files under the data folder, no server. With Redis or
    # RabbitMQ nothing here runs; a copy of this module without the demo can drop it.
    from .demo import fs_transport

    fs_transport.register()
    app.conf.broker_transport_options = {
        **fs_transport.options(DATA / "broker"),
        "polling_interval": 0.1,
    }
schedule_reaper(app, every=REAP_EVERY_SECONDS)


#: Marks the data folder as this example's, so the demo may wipe it.
DATA_MARKER = ".webhook-sync-data"


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
@beat_init.connect(weak=False)  # type: ignore[untyped-decorator]
def make_data_folder(**_: Any) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / DATA_MARKER).touch()


logger = get_task_logger(__name__)


@app.task(  # type: ignore[untyped-decorator]
    base=LeasedTask,
    bind=True,
    name="webhook_sync.sync_account",
    # One run per account: a webhook while the account's sync is queued is served by it; one
    # while it runs (or waits to resume) starts one follow-up run when it ends.
    lease_key="account:{account}",
    autoretry_for=(UpstreamBusy,),
    retry_backoff=True,
    retry_backoff_max=60,
    max_retries=None,
)
def sync_account(self: LeasedTask, account: str) -> dict[str, Any]:
    """Copy the upstream events of ``account`` that follow the account's cursor into
    ``synced_events``, a page at a time, moving the cursor with each page.

    The cursor belongs to the account (the lease key), not to the job: ``{"after": <id of the
    last event stored>, "events": <events stored>}``, None before the first sync. A run starts
    from it, and so does an attempt that resumes a killed one (the cursor was committed with
    its last page). A run syncs the events the upstream had when it began and ends: those that
    arrive during it are its follow-up's. A busy upstream is retried by Celery (backoff up to
    a minute), which resumes from the cursor too.
    """
    database = events_database()
    position = self.lease.cursor or {"after": None, "events": 0}
    # This run's own progress: where it began, pages and events so far, the events it syncs
    # up to (the upstream's count at its first page).
    run = self.lease.checkpoint or {
        "started_after": position["after"],
        "pages": 0,
        "events": 0,
        "until": None,
    }
    if run["pages"]:
        logger.info(
            "sync %s: attempt %d resumes after page %d at the account's cursor %s "
            "(%d events stored, checkpoint %.1f s old)",
            account,
            self.lease.attempt,
            run["pages"],
            position["after"],
            position["events"],
            self.lease.checkpoint_age or 0.0,
        )
    elif position["after"] is None:
        logger.info(
            "sync %s: attempt %d starts: the account's first sync", account, self.lease.attempt
        )
    else:
        logger.info(
            "sync %s: attempt %d starts at the account's cursor %s (%d events stored before)",
            account,
            self.lease.attempt,
            position["after"],
            position["events"],
        )
    upstream = EventsClient(UPSTREAM)
    while True:
        page = upstream.page(account, after=position["after"], limit=PAGE_SIZE)
        if run["until"] is None:
            run["until"] = page.total
        position = {
            "after": page.next_cursor or position["after"],
            "events": position["events"] + len(page.events),
        }
        run = run | {"pages": run["pages"] + 1, "events": run["events"] + len(page.events)}
        store_page(
            self,
            database,
            EVENTS,
            account,
            page.events,
            cursor=position,
            checkpoint=run,
            progress=(position["events"], run["until"]),
        )
        logger.info(
            "sync %s: page %d stored (%d events, %d/%s), cursor %s",
            account,
            run["pages"],
            len(page.events),
            position["events"],
            run["until"],
            position["after"],
        )
        caught_up = run["until"] is not None and position["events"] >= run["until"]
        if not page.has_more or caught_up:
            return {"account": account, **run, "ended_after": position["after"]}
        self.stop_point()  # a deploy's stop request, seen after the commit


def store_page(
    task: LeasedTask,
    database: Engine,
    table: sa.Table,
    account: str,
    events: list[dict[str, Any]],
    *,
    cursor: dict[str, Any],
    checkpoint: dict[str, Any],
    progress: tuple[int, int | None],
) -> None:
    """Store a page of events, the account's cursor after it and the run's checkpoint in one
    transaction.

    All three commit or none does. An attempt whose lease was taken by a newer claim gets
    ``LeaseLost`` from the cursor (or the checkpoint), which rolls its page back: a stale
    attempt can neither store events nor move the cursor. This needs the events in the leases
    database; with another sink, make the writes idempotent (upsert by event id) and save the
    cursor and the checkpoint after them.
    """
    with database.begin() as connection:
        sink.insert(connection, table, account, events)
        task.save_cursor(cursor, connection=connection)
        task.checkpoint(checkpoint, progress=progress, connection=connection)


_created: set[tuple[str, int]] = set()


def events_database() -> Engine:
    """The engine of ``synced_events`` (the leases database), the table created once."""
    engine = sink.engine(DATABASE)
    if (EVENTS.name, os.getpid()) not in _created:
        sink.create(engine, EVENTS)
        _created.add((EVENTS.name, os.getpid()))
    return engine
