"""``celery -A app leases ...`` run as real subprocesses against real databases."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases.db import migrations
from celery_leases.db.rows import Refused
from celery_leases.db.schema import jobs_table
from celery_leases.db.store import Store
from celery_leases.message import GROUP_HEADER, KEY_HEADER
from tests.support.cli import (
    STALL_TIMEOUT,
    Cli,
    claim,
    leases_settings,
    record,
    recorded,
    store_of,
)
from tests.support.legacy import drop_holders, drop_lease_keys
from tests.support.message import job_message


@pytest.fixture
def settings(
    database_url: str, table_name: str, filesystem_broker: dict[str, Any]
) -> dict[str, Any]:
    return leases_settings(database_url, table_name, filesystem_broker)


@pytest.fixture
def store(settings: dict[str, Any]) -> Iterator[Store]:
    store = store_of(settings)
    yield store
    store.engine.dispose()


@pytest.fixture
def cli(settings: dict[str, Any]) -> Cli:
    return Cli(settings)


# -- jobs in every state, made through the store --------------------------------------------------


def seed(store: Store) -> dict[str, str]:
    """One job per state (and a stalled one); returns their ids by label."""
    ids = {"queued": record(store, task="cli.other")}

    ids["running"] = record(store, n=8)
    token = claim(store, ids["running"])
    store.checkpoint(ids["running"], token, json.dumps({"i": 2, "sum": 1}), progress=(2, 8))

    ids["stalled"] = record(store)
    token = claim(store, ids["stalled"], owner="celery@w2/200")
    store.checkpoint(ids["stalled"], token, json.dumps({"i": 1, "sum": 0}), progress=(1, 5))
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(store.table)
            .where(store.table.c.id == ids["stalled"])
            .values(
                checkpoint_at=store.table.c.checkpoint_at - 2 * STALL_TIMEOUT,
                claimed_at=store.table.c.claimed_at - 2 * STALL_TIMEOUT,
            )
        )

    ids["done"] = record(store)
    token = claim(store, ids["done"])
    store.checkpoint(ids["done"], token, json.dumps({"i": 5, "sum": 10}), progress=(5, 5))
    store.finish(ids["done"], token, result=json.dumps({"started_from": 0, "i": 5, "sum": 10}))

    ids["failed"] = record(store)
    token = claim(store, ids["failed"])
    store.checkpoint(ids["failed"], token, json.dumps({"i": 3, "sum": 3}), progress=(3, 5))
    store.fail(ids["failed"], token, error="RuntimeError: disk full")

    ids["cancelled"] = record(store)
    store.cancel_queued(ids["cancelled"])
    return ids


def published_ids(broker: dict[str, Any]) -> list[str]:
    """Task ids of the messages waiting in the filesystem broker's queue folder."""
    folder = Path(broker["broker_transport_options"]["data_folder_out"])
    ids = []
    for path in folder.iterdir():
        message = json.loads(path.read_text())
        ids.append(message["headers"]["id"])
    return ids


def line_of(output: str, job_id: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(job_id[:8])]
    assert len(lines) == 1, output
    return lines[0]


# -- list, show, watch ----------------------------------------------------------------------------


def test_list_shows_every_state_with_progress_and_marks_a_stalled_job(
    cli: Cli, store: Store
) -> None:
    ids = seed(store)

    output = cli.ok("list")

    assert output.splitlines()[0].split() == [
        "ID", "STATE", "TASK", "OWNER", "TRY", "LEASE", "CKPT", "PROGRESS"
    ]  # fmt: skip
    for label in ("queued", "running", "done", "failed", "cancelled", "stalled"):
        assert line_of(output, ids[label]).split()[1] == label
    running = line_of(output, ids["running"]).split()
    assert running[3:5] == ["w1/100", "1"]
    assert running[-1] == "25%"
    assert line_of(output, ids["failed"]).endswith(" 60%")
    assert "10m" in line_of(output, ids["stalled"])
    assert "showing 6 of 6 jobs" in output
    assert "4 running (1 stalled)" not in output and "2 running (1 stalled)" in output
    assert "stalled: no checkpoint for over 5m (leases_stall_timeout)" in output
    assert max(len(line) for line in output.splitlines()) <= 100
    assert "\x1b[" not in output


def test_list_json_parses_and_filters_by_state_task_and_limit(cli: Cli, store: Store) -> None:
    ids = seed(store)

    every = json.loads(cli.ok("list", "--json"))
    finished = json.loads(cli.ok("list", "--json", "--state", "failed", "--state", "cancelled"))
    other = json.loads(cli.ok("list", "--json", "--task", "cli.other"))
    two = json.loads(cli.ok("list", "--json", "--limit", "2"))

    assert {job["id"] for job in every} == set(ids.values())
    by_id = {job["id"]: job for job in every}
    assert by_id[ids["stalled"]]["stalled"] is True
    assert by_id[ids["running"]]["stalled"] is False
    assert by_id[ids["running"]]["progress_done"] == 2
    assert by_id[ids["running"]]["progress_total"] == 8
    assert 0 < by_id[ids["running"]]["expires_in"] <= 300
    assert by_id[ids["failed"]]["checkpoint"] == {"i": 3, "sum": 3}
    assert {job["id"] for job in finished} == {ids["failed"], ids["cancelled"]}
    assert [job["id"] for job in other] == [ids["queued"]]
    assert len(two) == 2


def test_list_filters_by_group_and_groups_shows_each_ones_limit_admitted_and_waiting(
    cli: Cli, store: Store
) -> None:
    # Given tenant a, limit 1, with three jobs (one admitted, two waiting), and an ungrouped job
    ids = []
    for _ in range(3):
        ids.append(str(uuid.uuid4()))
        store.register(job_message(ids[-1], "cli.count", args=[1], **{GROUP_HEADER: "tenant:a"}))
    store.admit("tenant:a", limits=(1, 10.0), define=True)
    record(store)

    listed = json.loads(cli.ok("list", "--json", "--group", "tenant:a"))
    waiting = cli.ok("list", "--group", "tenant:a", "--state", "waiting")
    groups = cli.ok("groups")
    shown = cli.ok("show", ids[2])

    assert sorted(job["id"] for job in listed) == sorted(ids)
    assert {job["lease_group"] for job in listed} == {"tenant:a"}
    assert waiting.count(" waiting ") == 2 and "showing 2 of 4 jobs" in waiting
    header, row = groups.splitlines()
    assert header.split() == ["GROUP", "LIMIT", "ADMITTED", "WAITING", "RATE", "TOKENS"]
    assert row.split()[:5] == ["tenant:a", "1", "1", "2", "10/s"]
    assert "  group       tenant:a, waiting for its admission" in shown
    assert json.loads(cli.ok("groups", "--json"))[0]["waiting"] == 2


def test_show_prints_the_job_and_its_checkpoint_as_pretty_json(cli: Cli, store: Store) -> None:
    ids = seed(store)

    output = cli.ok("show", ids["failed"])
    by_prefix = cli.ok("show", ids["failed"][:8])
    as_json = json.loads(cli.ok("show", "--json", ids["stalled"]))

    assert output.splitlines()[0] == f"job {ids['failed']}"
    assert "  state       failed" in output
    assert "  error       RuntimeError: disk full" in output
    assert re.search(r"^  attempts    1 \(token \d+\)$", output, re.MULTILINE), output
    assert 'checkpoint:\n  {\n    "i": 3,\n    "sum": 3\n  }' in output
    assert "60%  (3 / 5)" in output
    assert by_prefix.splitlines()[0] == f"job {ids['failed']}"
    assert as_json["id"] == ids["stalled"] and as_json["stalled"] is True


def test_watch_once_prints_the_running_jobs_as_a_plain_block(cli: Cli, store: Store) -> None:
    ids = seed(store)

    output = cli.ok("watch", "--once")

    assert output.startswith("celery leases watch: ")
    assert {line.split()[0] for line in output.splitlines()[4:6]} == {
        ids["running"][:8],
        ids["stalled"][:8],
    }
    assert ids["done"][:8] not in output and ids["queued"][:8] not in output
    assert "\x1b[" not in output


def test_colours_and_screen_clearing_only_on_a_terminal(cli: Cli, store: Store) -> None:
    seed(store)

    listed = cli.on_a_terminal("list")
    watched = cli.on_a_terminal("watch", "--once")

    assert "\x1b[31m" in listed and "stalled" in listed
    assert watched.startswith("\x1b[H\x1b[2J")
    assert "\x1b[" not in cli.ok("list") + cli.ok("watch", "--once")


def test_an_id_prefix_must_match_exactly_one_job(cli: Cli, store: Store) -> None:
    for job_id in ("nightly-report-1", "nightly-report-2"):
        store.register(job_message(job_id, "cli.count", args=[1]))

    shown = cli.ok("show", "nightly-report-2")
    ambiguous = cli("show", "nightly")
    listed = cli.ok("list")

    assert shown.startswith("job nightly-report-2\n")
    assert assert_one_error_line(ambiguous, 1) == (
        "Error: job id prefix 'nightly' is ambiguous (nightly-report-1, nightly-report-2): "
        "give more of it"
    )
    assert {line.split()[0] for line in listed.splitlines()[1:3]} == {
        "nightly-report-1",
        "nightly-report-2",
    }


# -- acting on jobs -------------------------------------------------------------------------------


def test_retry_requeues_a_failed_job_and_publishes_it_with_its_checkpoint(
    cli: Cli, store: Store, filesystem_broker: dict[str, Any]
) -> None:
    ids = seed(store)

    output = cli.ok("retry", ids["failed"][:8])

    assert f"job {ids['failed']} (cli.count) queued again" in output
    assert "resumes from its checkpoint" in output
    job = store.get(ids["failed"])
    assert job is not None
    assert (job.state, job.checkpoint, job.error) == ("queued", {"i": 3, "sum": 3}, None)
    assert published_ids(filesystem_broker) == [ids["failed"]]


def test_retry_of_a_done_job_is_refused(cli: Cli, store: Store) -> None:
    ids = seed(store)

    result = cli("retry", ids["done"])

    assert result.returncode == 1
    assert result.stderr == (
        f"Error: job {ids['done']} is done; only failed or cancelled jobs can be retried\n"
    )


def test_cancel_of_a_queued_job_makes_its_message_be_dropped(cli: Cli, store: Store) -> None:
    ids = seed(store)

    output = cli.ok("cancel", ids["queued"])

    assert "cancelled: its message is dropped when a worker receives it" in output
    job = store.get(ids["queued"])
    assert job is not None and job.state == "cancelled"
    outcome = store.claim(recorded(store, ids["queued"]), owner="w/1", duration=30.0)
    assert outcome == Refused("cancelled", None, None)


def test_cancel_of_a_running_job_asks_it_to_stop_at_its_next_checkpoint(
    cli: Cli, store: Store
) -> None:
    ids = seed(store)

    output = cli.ok("cancel", ids["running"])

    assert "running on celery@w1/100: it stops at its next checkpoint and ends cancelled" in output
    job = store.get(ids["running"])
    assert job is not None and (job.state, job.stop_requested) == ("running", "cancel")
    # The attempt sees it at its next checkpoint (saved first, fenced by its token)
    assert store.checkpoint(job.id, job.token, json.dumps(job.checkpoint)) == (True, "cancel")


def test_release_of_a_running_job_makes_the_next_reap_republish_it(
    cli: Cli, store: Store, filesystem_broker: dict[str, Any]
) -> None:
    ids = seed(store)

    released = cli.ok("release", ids["running"])
    reaped = cli.ok("reap")

    assert "lease of celery@w1/100 expired; the next reaper pass re-publishes it" in released
    assert f"re-published 1 job ({ids['running']}) whose lease had expired" in reaped
    assert "purged 0 finished jobs older than 7d (leases_retention)" in reaped
    job = store.get(ids["running"])
    assert job is not None and (job.state, job.owner) == ("queued", None)
    assert published_ids(filesystem_broker) == [ids["running"]]
    assert json.loads(cli.ok("reap", "--json"))["republished"] == []


def test_purge_deletes_only_jobs_finished_longer_ago_than_older_than(
    cli: Cli, store: Store
) -> None:
    ids = seed(store)
    with store.engine.begin() as connection:
        connection.execute(
            sa.update(store.table)
            .where(store.table.c.id.in_([ids["done"], ids["failed"]]))
            .values(finished_at=store.table.c.finished_at - 2 * 86400)
        )

    output = cli.ok("purge", "--older-than", "1d")

    assert output == "purged 2 finished jobs older than 1d\n"
    left = {job.id for job in store.list_jobs()}
    assert left == set(ids.values()) - {ids["done"], ids["failed"]}


# -- a lease key's cursor -------------------------------------------------------------------------


def test_cursor_shows_sets_and_clears_a_keys_cursor_only_while_no_job_holds_the_key(
    cli: Cli, store: Store
) -> None:
    assert (cli("cursor", "acct:7").stdout, cli("cursor", "acct:7").returncode) == ("none\n", 0)
    done = cli("cursor", "acct:7", "--set", '{"since": "2026-11-30", "page": 3}')
    assert done.returncode == 0 and "cursor of 'acct:7' set to" in done.stdout
    assert store.cursor("acct:7") == {"since": "2026-11-30", "page": 3}
    assert json.loads(cli("cursor", "acct:7").stdout) == {"since": "2026-11-30", "page": 3}

    job_id = "c0ffee00-cursor"
    store.register(job_message(job_id, "cli.count", args=[5], **{KEY_HEADER: "acct:7"}))
    held = assert_one_error_line(cli("cursor", "acct:7", "--clear"), 1)
    assert "lease key 'acct:7' is held by a job" in held
    claim(store, job_id)
    assert_one_error_line(cli("cursor", "acct:7", "--set", "1"), 1)
    assert store.cursor("acct:7") == {"since": "2026-11-30", "page": 3}  # untouched

    assert store.cancel_queued(job_id) or store.end_live(job_id, state="revoked", error="x")
    assert cli("cursor", "acct:7", "--clear").returncode == 0
    assert store.cursor("acct:7") is None


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("--set", "{since: 1}"), 2, "--set '{since: 1}' is not JSON"),
        (("--set", "NaN"), 2, "NaN is not JSON"),
        (("--set", "1", "--clear"), 2, "give --set or --clear, not both"),
        (("--set", "[" * 100_000), 2, "is not JSON (nested too deeply)"),
    ],
)
def test_cursor_refuses_what_is_not_json_in_one_line_and_writes_nothing(
    cli: Cli, store: Store, args: tuple[str, ...], code: int, message: str
) -> None:
    assert message in assert_one_error_line(cli("cursor", "acct:8", *args), code)
    assert store.cursor("acct:8") is None


def test_cursor_of_a_key_the_table_cannot_hold_is_one_line(cli: Cli) -> None:
    line = assert_one_error_line(cli("cursor", "k" * 300), 2)
    assert "is not a lease key (1 to 255 characters)" in line


@pytest.fixture
def fresh_settings(
    database_url: str, fresh_table_name: str, filesystem_broker: dict[str, Any]
) -> dict[str, Any]:
    """Settings naming a table that does not exist yet."""
    return leases_settings(database_url, fresh_table_name, filesystem_broker)


def test_init_db_creates_the_table_and_its_history_and_says_where(
    fresh_settings: dict[str, Any], database_url: str
) -> None:
    table = fresh_settings["leases_table"]
    cli = Cli(fresh_settings)

    output = cli.ok("init-db")

    assert output.startswith(f"leases table {table} in ")
    assert output.endswith(f": created (revision {migrations.head()})\n")
    engine = sa.create_engine(database_url)
    try:
        names = sa.inspect(engine).get_table_names()
        assert table in names and f"{table}_version" in names
    finally:
        engine.dispose()
    # And running it again changes nothing
    assert cli.ok("init-db").endswith(f": up to date (revision {migrations.head()})\n")


def test_a_command_on_a_missing_table_says_to_run_init_db_and_creates_nothing(
    fresh_settings: dict[str, Any], database_url: str
) -> None:
    table = fresh_settings["leases_table"]

    line = assert_one_error_line(Cli(fresh_settings)("list"), 1)

    assert f"no leases table '{table}' in " in line
    assert "create it with celery -A proj leases init-db" in line
    engine = sa.create_engine(database_url)
    try:
        assert table not in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_upgrade_sql_prints_what_upgrade_would_run_and_runs_nothing(
    fresh_settings: dict[str, Any], database_url: str
) -> None:
    table = fresh_settings["leases_table"]
    cli = Cli(fresh_settings)

    # When the SQL of an upgrade is asked for on an empty database, then past a revision
    printed = cli.ok("upgrade", "--sql")
    later = cli.ok("upgrade", "--sql", "--from", "0004")
    wrong = cli("upgrade", "--from", "0004")

    # Then it is the statements for this database, the version rows among them, and
    # nothing was made; --from goes with --sql only
    assert printed.startswith(f"-- celery-leases: table {table} in ")
    assert f"CREATE TABLE {table} (" in printed and f"CREATE TABLE {table}_groups (" in printed
    assert f"SET version_num='{migrations.head()}'" in printed
    assert f"CREATE TABLE {table} (" not in later and f"{table}_groups" in later
    assert wrong.returncode == 2 and "--from goes with --sql" in wrong.stderr
    engine = sa.create_engine(database_url)
    try:
        assert table not in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_upgrade_brings_a_table_made_by_an_older_release_under_the_migrations(
    fresh_settings: dict[str, Any], database_url: str
) -> None:
    # Given a table an older celery-leases made at first use (schema 3, no history), one job in
    table = fresh_settings["leases_table"]
    store = store_of(fresh_settings)
    try:
        jobs_table(sa.MetaData(), table).create(store.engine)
        store._schema_ready = True  # what an older release did: use it as it was
        job_id = record(store)
        drop_holders(store.engine, table)
        drop_lease_keys(store.engine, table)
    finally:
        store.engine.dispose()
    cli = Cli(fresh_settings)
    assert "celery -A proj leases upgrade" in assert_one_error_line(cli("list"), 1)

    # When the operator runs the command the error names
    output = cli.ok("upgrade")

    # Then the table is under the migrations and its job is still there
    assert output.endswith(
        f": brought under migrations (revision {migrations.head()}), jobs kept\n"
    )
    assert job_id[:8] in cli.ok("list")


# -- bad input ------------------------------------------------------------------------------------


def assert_one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("show", "0b7e1a7c-unknown"), 1, "no job '0b7e1a7c-unknown' in table leases_cli of "),
        (("cancel", "abc"), 1, "no job 'abc' in table leases_cli"),
        (("purge", "--older-than", "7x"), 2, "'7x' is not a duration (use 30s, 15m, 12h, 7d)"),
        (("purge", "--older-than", "-1d"), 2, "'-1d' is not a duration"),
        (("show", "a b"), 2, "'a b' is not a job id"),
        (("retry", "x\x01y"), 2, "'x\\x01y' is not a job id"),
        (("release", "x" * 200), 2, "is not a job id (1 to 155 printable characters"),
        (("watch", "--interval", "0"), 2, "Invalid value for '--interval'"),
    ],
)
def test_bad_input_exits_with_one_line_on_stderr(
    sqlite_settings: dict[str, Any], args: tuple[str, ...], code: int, message: str
) -> None:
    result = Cli(sqlite_settings)(*args)

    assert message in assert_one_error_line(result, code)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://leases:s3cret-pw@127.0.0.1:9/test",
        "mysql+pymysql://leases:s3cret-pw@127.0.0.1:9/test",
    ],
)
@pytest.mark.parametrize(
    "command", [("list",), ("show", "some-id"), ("init-db",), ("upgrade",), ("reap",)]
)
def test_an_unreachable_database_is_one_line_without_the_password(
    sqlite_settings: dict[str, Any], url: str, command: tuple[str, ...]
) -> None:
    cli = Cli({**sqlite_settings, "leases_database_url": url})

    line = assert_one_error_line(cli(*command), 1)

    assert "is unavailable" in line
    assert "127.0.0.1" in line and "s3cret-pw" not in line


def test_a_bad_setting_is_one_line(sqlite_settings: dict[str, Any]) -> None:
    cli = Cli({**sqlite_settings, "leases_duration": "soon"})

    line = assert_one_error_line(cli("list"), 1)

    assert line == "Error: leases_duration must be a number of seconds, not 'soon'"


def test_without_an_app_the_command_says_one_is_needed(sqlite_settings: dict[str, Any]) -> None:
    result = Cli(sqlite_settings)("list", app=None)

    line = assert_one_error_line(result, 2)
    assert "celery leases needs your Celery app: celery -A proj leases list" in line
