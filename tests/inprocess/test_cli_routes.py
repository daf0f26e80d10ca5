"""``celery leases`` over an app with two leases databases (``leases_databases``,
``leases_routes``): two SQLite files, jobs sent through the in-memory broker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_leases import LeasedTask, routes
from celery_leases.cli import leases
from celery_leases.cli.group import Host
from celery_leases.config import settings_for
from celery_leases.db import migrations
from tests.support.memory import memory_app


def routed_app(tmp_path: Path, b_url: str | None = None) -> Celery:
    """An app whose jobs sent to queue ``b`` live in database ``b``, the others in
    ``default``; its task ``routes.count``."""
    app = memory_app(
        "cli_routes",
        f"sqlite:///{tmp_path / 'default.db'}",
        "jobs",
        leases_databases={"b": b_url or f"sqlite:///{tmp_path / 'b.db'}"},
        leases_routes={"queues": {"b": "b"}},
    )

    @app.task(base=LeasedTask, bind=True, shared=False, name="routes.count")  # type: ignore[untyped-decorator]
    def count(self: Any, n: int) -> int:
        return n

    return app


def close(app: Celery) -> None:
    for _, store in routes.stores(settings_for(app)):
        store.engine.dispose()
    app.close()


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = routed_app(tmp_path)
    for _, store in routes.stores(settings_for(app)):
        migrations.upgrade(store)
    yield app
    close(app)


def run(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(leases, list(args), obj=Host(app, "celery -A proj leases"))


def send(app: Celery, job_id: str, queue: str | None = None) -> str:
    app.tasks["routes.count"].apply_async((1,), task_id=job_id, queue=queue)
    return job_id


def test_list_merges_both_databases_newest_first_and_names_each_jobs_database(
    app: Celery,
) -> None:
    # Given a job in default, then one in b, then one in default
    first = send(app, "aaaa0001-first")
    second = send(app, "bbbb0002-second", queue="b")
    third = send(app, "cccc0003-third")

    listed = run(app, "list")
    assert listed.exit_code == 0, listed.output
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:3] == ["ID", "DATABASE", "STATE"]
    assert [line.split()[:2] for line in lines[1:4]] == [
        ["cccc0003", "default"],
        ["bbbb0002", "b"],
        ["aaaa0001", "default"],
    ]
    assert lines[4].startswith("showing 3 of 3 jobs")

    # The limit applies to the merged list; --json names each job's database
    shown = json.loads(run(app, "list", "--limit", "2", "--json").stdout)
    assert [(job["id"], job["database"]) for job in shown] == [(third, "default"), (second, "b")]

    # --database lists one database, its counts alone
    only_b = run(app, "list", "--database", "b")
    assert only_b.exit_code == 0, only_b.output
    assert second[:8] in only_b.stdout and first[:8] not in only_b.stdout
    assert "showing 1 of 1 jobs" in only_b.stdout


def test_show_and_cancel_find_a_job_in_its_database_by_a_prefix(app: Celery) -> None:
    job_id = send(app, "bbbb0002-in-b", queue="b")

    shown = run(app, "show", "bbbb00")
    assert shown.exit_code == 0, shown.output
    assert "  database    b\n" in shown.stdout
    assert json.loads(run(app, "show", job_id, "--json").stdout)["database"] == "b"

    # Not in the database named
    missing = run(app, "show", job_id, "--database", "default")
    assert missing.exit_code == 1
    assert f"no job {job_id!r}" in missing.stderr

    cancelled = run(app, "cancel", "bbbb00")
    assert cancelled.exit_code == 0, cancelled.output
    assert f"job {job_id} (routes.count) cancelled" in cancelled.stdout
    b_store = dict(routes.stores(settings_for(app)))["b"]
    assert b_store.get(job_id).state == "cancelled"  # type: ignore[union-attr]


def test_a_prefix_of_jobs_in_two_databases_is_ambiguous(app: Celery) -> None:
    send(app, "dddd0001-here")
    send(app, "dddd0002-there", queue="b")

    shown = run(app, "show", "dddd000")

    assert shown.exit_code == 1
    assert "job id prefix 'dddd000' is ambiguous" in shown.stderr


def test_an_unknown_database_name_is_refused_with_the_known_ones(app: Celery) -> None:
    refused = run(app, "list", "--database", "billing")

    assert refused.exit_code == 2
    assert refused.stderr == (
        "Error: Invalid value for '--database': 'billing' is not a leases database of this "
        "app (it has default, b)\n"
    )


def test_init_db_makes_the_table_of_every_database_and_says_which(tmp_path: Path) -> None:
    app = routed_app(tmp_path)
    try:
        made = run(app, "init-db")
        assert made.exit_code == 0, made.output
        lines = made.stdout.splitlines()
        assert len(lines) == 2
        assert lines[0].startswith(f"database default: leases table jobs in sqlite:///{tmp_path}")
        assert lines[1].startswith(f"database b: leases table jobs in sqlite:///{tmp_path}")

        sql = run(app, "upgrade", "--sql", "--database", "b").stdout
        assert sql.startswith(f"-- celery-leases: database b, table jobs in sqlite:///{tmp_path}")
    finally:
        close(app)


def test_a_database_that_does_not_answer_is_named_and_the_other_is_listed(
    tmp_path: Path,
) -> None:
    # Given database b in a directory that does not exist
    app = routed_app(tmp_path, b_url=f"sqlite:///{tmp_path / 'gone' / 'b.db'}")
    try:
        migrations.upgrade(dict(routes.stores(settings_for(app)))["default"])
        job_id = send(app, "aaaa0001-default")

        listed = run(app, "list")

        assert listed.exit_code == 1
        assert job_id[:8] in listed.stdout
        assert "showing 1 of 1 jobs" in listed.stdout
        assert "warning: database b did not answer:" in listed.stdout
        # A job of the database that answers is found all the same
        assert run(app, "show", job_id).exit_code == 0
        # And a reaper pass reaps that one, and says which it skipped
        reaped = run(app, "reap")
        assert reaped.exit_code == 1
        assert "Error: database b did not answer" in reaped.stderr
    finally:
        close(app)


def test_a_cursor_is_set_in_the_database_named_then_found_there(app: Celery) -> None:
    # Where no database has the key's cursor, setting one needs --database
    unnamed = run(app, "cursor", "nightly", "--set", "1")
    assert unnamed.exit_code == 2
    assert "Missing option '--database'" in unnamed.stderr
    assert run(app, "cursor", "nightly").stdout == "none\n"

    assert run(app, "cursor", "nightly", "--set", "1", "--database", "b").exit_code == 0

    # Then it is read and cleared in b, without naming it
    assert run(app, "cursor", "nightly").stdout == "1\n"
    assert run(app, "cursor", "nightly", "--clear").stdout == "cursor of 'nightly' cleared\n"
    assert dict(routes.stores(settings_for(app)))["b"].cursor("nightly") is None


def test_purge_counts_each_database_then_the_total(app: Celery) -> None:
    purged = run(app, "purge", "--older-than", "7d")

    assert purged.exit_code == 0, purged.output
    assert purged.stdout.splitlines() == [
        "database default: purged 0 finished jobs",
        "database b: purged 0 finished jobs",
        "purged 0 finished jobs older than 7d",
    ]
