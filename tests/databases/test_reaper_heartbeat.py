"""The reaper's heartbeat: each pass records itself (the holders' row ``reaper``, the database
clock), and what shows the jobs warns when no pass happened for several intervals: a worker's
watch, ``leases list`` and ``watch``, the metrics' age."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace

import prometheus_client
import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner
from kombu.asynchronous.timer import Timer

from celery_leases import LeasedTask, schedule_reaper
from celery_leases.cli import leases
from celery_leases.cli.group import Host
from celery_leases.config import settings_for
from celery_leases.db.store import Store, store_for
from celery_leases.heartbeat import last_pass, silence, silence_after
from celery_leases.metrics import JobsCollector
from celery_leases.reaper import reap
from celery_leases.worker.watch import ReaperWatch, watch_the_reaper
from tests.support.message import job_message


@pytest.fixture
def app(database_url: str, table_name: str) -> Iterator[Celery]:
    app = Celery("heartbeat", broker="memory://", set_as_current=False)
    app.conf.update(leases_database_url=database_url, leases_table=table_name)

    @app.task(base=LeasedTask, bind=True, shared=False, name="tests.heartbeat")
    def task(self: LeasedTask) -> None:
        pass

    schedule_reaper(app, every=30.0)
    yield app
    store_for(settings_for(app)).engine.dispose()


def pass_ago(store: Store, seconds: float) -> None:
    """Move the last pass ``seconds`` into the past (the database's own row, no sleep)."""
    h = store.holders
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(h).where(h.c.id == "reaper").values(renewed_at=h.c.renewed_at - seconds)
        )


def listed(app: Celery) -> str:
    done = CliRunner().invoke(leases, ["list"], obj=Host(app, "celery -A proj leases"))
    assert done.exit_code == 0, done.output
    return done.output


def test_each_reaper_pass_records_itself_and_a_silence_of_several_intervals_is_warned(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_for(settings_for(app))
    # A running job bound to a live keeper, so the pass's holder statements all run
    task = app.tasks["tests.heartbeat"]
    sent = job_message("beat-1", task.name)
    store.register(sent)
    store.claim(sent, owner="w1/1", duration=60)

    # Given no pass yet: a worker that just started says nothing, leases list warns
    assert last_pass(store) is None
    assert ReaperWatch(app).check() is None
    assert "warning: no reaper pass recorded: is beat running?" in listed(app)

    # When a pass runs, twice (the second reads the first's row as a holder would)
    reap(app)
    reap(app)

    # Then it is recorded on the database clock and nothing warns; the row is no keeper's
    last = last_pass(store)
    assert last is not None and last.age < silence_after(app)
    assert silence(app, store) is None
    assert "warning" not in listed(app)
    assert store.get("beat-1").state == "running"  # type: ignore[union-attr]

    # When no pass happened for 5 intervals of the schedule's 30 s
    assert silence_after(app) == 150.0
    pass_ago(store, 300)

    # Then the worker's watch logs it, leases list and the metrics say it
    caplog.set_level(logging.WARNING, logger="celery_leases.reaper")
    warning = ReaperWatch(app).check()
    assert warning is not None and warning.startswith("no reaper pass for 5 min (the last by ")
    assert "is beat running?" in warning
    assert any(warning in r.getMessage() for r in caplog.records)
    assert " ".join(listed(app).split()).endswith(f"warning: {warning}")
    registry = prometheus_client.CollectorRegistry()
    registry.register(JobsCollector(app))
    age = registry.get_sample_value("celery_leases_reaper_last_pass_age_seconds")
    assert age is not None and 300 <= age < 400

    # ... until the next pass
    reap(app)
    assert silence(app, store) is None

    # A worker looks at start (worker_ready), then every silence_after on its timer
    timer = Timer()
    watch_the_reaper(sender=SimpleNamespace(app=app, timer=timer))
    assert len(timer.queue) == 1
    timer.stop()
