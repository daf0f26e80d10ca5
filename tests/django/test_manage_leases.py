"""``manage.py leases ...`` in the example project, against ``celery -A shop leases ...`` on the
same jobs: the same output and exit codes (SQLite, PostgreSQL and MariaDB for ``list`` and
``show``; SQLite for the other commands).

The celery CLI runs with ``CELERY_LEASES_DATABASE_URL`` set to the URL the project's app builds
from ``DATABASES``: it does not set Django up, so without it the CLI would not find the leases
in Django's database.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from typing import Any

import pytest

from tests.django.conftest import PROJECT, Shop
from tests.support.cli import claim, record

EXTRA_SETTINGS = "tests.django.extra_settings"
#: A duration as the CLI prints it (4.2s, 37s, 4m05s, 3h07m): two runs a moment apart differ.
#: It follows a space or "(", never starts a line: a listed job's ID does, and one in 430 random
#: IDs reads as a duration ("1234567d"; CI met one, and the test missed the ID it looked for).
#: A time of day (watch's header).
_CLOCK = re.compile(r"\b\d\d:\d\d:\d\d\b")
_SPAN = re.compile(r"(?<=[ (])(?:\d+(?:\.\d)?s|\d+[mhd](?:\d\d[smh])?)(?![\w-])")


def manage_leases(shop: Shop, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return shop.try_manage("leases", *args, CELERY_BROKER_URL="memory://", COLUMNS="100", **env)


_urls: dict[str, str] = {}


def celery_url(shop: Shop) -> str:
    """The leases URL the project's Celery app builds from ``DATABASES`` (Django set up)."""
    if shop.url not in _urls:
        _urls[shop.url] = shop.run("where")["celery_url"]
    return _urls[shop.url]


def celery_leases(shop: Shop, *args: str) -> subprocess.CompletedProcess[str]:
    env = shop.environment(
        CELERY_BROKER_URL="memory://",
        COLUMNS="100",
        DJANGO_SETTINGS_MODULE=EXTRA_SETTINGS,
        SHOP_EXTRA_SETTINGS=json.dumps({"CELERY_LEASES_DATABASE_URL": celery_url(shop)}),
    )
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "shop", "leases", *args],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def shown(
    done: subprocess.CompletedProcess[str], renamed: dict[str, str] | None = None
) -> tuple[int, list[str], list[str]]:
    """Exit code, stdout and stderr lines, with each text of ``renamed`` replaced, durations
    masked and spaces collapsed."""

    def lines(text: str) -> list[str]:
        for old, new in (renamed or {}).items():
            text = text.replace(old, new)
        text = _CLOCK.sub("<clock>", _SPAN.sub("<t>", text))
        return [" ".join(line.split()) for line in text.splitlines()]

    return done.returncode, lines(done.stdout), lines(done.stderr)


def test_the_masks_keep_a_listed_id_that_reads_as_a_duration() -> None:
    printed = "1234567d running manage.x w1/100 1 4m59s 3s 25%\nlease: 4.2s left (over 3m)\n"

    masked = shown(subprocess.CompletedProcess([], 0, printed, ""))

    assert masked[1] == [
        "1234567d running manage.x w1/100 1 <t> <t> 25%",
        "lease: <t> left (over <t>)",
    ]


def both(shop: Shop, *args: str) -> tuple[Any, Any]:
    """What ``manage.py leases args`` and ``celery -A shop leases args`` show."""
    return shown(manage_leases(shop, *args)), shown(celery_leases(shop, *args))


def jobs_of_a_task(shop: Shop) -> tuple[str, dict[str, str]]:
    """A task name of this test's own, and its jobs: queued, running, failed."""
    task = f"manage.{uuid.uuid4().hex[:8]}"
    store = shop.store
    ids = {"queued": record(store, task=task)}
    ids["running"] = record(store, task=task)
    token = claim(store, ids["running"])
    store.checkpoint(ids["running"], token, json.dumps({"i": 2}), progress=(2, 8))
    ids["failed"] = record(store, task=task)
    token = claim(store, ids["failed"])
    store.checkpoint(ids["failed"], token, json.dumps({"i": 3}), progress=(3, 5))
    store.fail(ids["failed"], token, error="RuntimeError: disk full")
    return task, ids


def test_list_and_show_print_what_the_celery_cli_prints_with_its_exit_codes(shop: Shop) -> None:
    # Given a queued, a running and a failed job of one task in the project's database
    task, ids = jobs_of_a_task(shop)

    # When each is listed and shown by manage.py leases and by celery leases
    listed = both(shop, "list", "--task", task)
    running = both(shop, "show", ids["running"])
    by_prefix = both(shop, "show", ids["queued"][:13])
    missing = both(shop, "show", "nope-nope")
    bad_state = both(shop, "list", "--state", "sleeping")
    as_json = [json.loads(r.stdout) for r in (
        manage_leases(shop, "list", "--task", task, "--json"),
        celery_leases(shop, "list", "--task", task, "--json"),
    )]  # fmt: skip

    # Then the outputs and exit codes are the same
    assert listed[0] == listed[1]
    assert listed[0][0] == 0 and len(listed[0][1]) >= 4, listed[0]
    assert all(any(i[:8] in line for line in listed[0][1]) for i in ids.values()), listed[0]
    assert running[0] == running[1] and running[0][0] == 0
    assert f"job {ids['running']}" in running[0][1]
    assert by_prefix[0] == by_prefix[1] and f"job {ids['queued']}" in by_prefix[0][1]
    assert missing[0] == missing[1] and missing[0][0] == 1
    assert missing[0][2][0].startswith("Error: no job 'nope-nope' in table")
    assert bad_state[0] == bad_state[1] and bad_state[0][0] == 2
    assert [j["id"] for j in as_json[0]] == [j["id"] for j in as_json[1]]
    assert sorted(j["state"] for j in as_json[0]) == ["failed", "queued", "running"]


@pytest.mark.parametrize("shop", ["sqlite"], indirect=True)
def test_show_of_a_failed_job_names_the_manage_py_command_that_retries_it(shop: Shop) -> None:
    _, ids = jobs_of_a_task(shop)

    mine, theirs = both(shop, "show", ids["failed"])

    assert f"to resume it: python manage.py leases retry {ids['failed']}" in mine[1]
    assert f"to resume it: celery -A shop leases retry {ids['failed']}" in theirs[1]
    assert mine[1][:-1] == theirs[1][:-1] and mine[0] == theirs[0] == 0


@pytest.mark.parametrize("shop", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("action", "state", "code"),
    [("retry", "failed", 0), ("cancel", "queued", 0), ("cancel", "running", 0),
     ("release", "running", 0), ("retry", "queued", 1)],
)  # fmt: skip
def test_an_action_does_and_says_what_the_celery_cli_does(
    shop: Shop, action: str, state: str, code: int
) -> None:
    # Given two jobs in the same state, one for each command line
    my_task, mine = jobs_of_a_task(shop)
    their_task, theirs = jobs_of_a_task(shop)

    # When each acts on its own job
    done = shown(manage_leases(shop, action, mine[state]), {mine[state]: "ID", my_task: "T"})
    expected = shown(
        celery_leases(shop, action, theirs[state]), {theirs[state]: "ID", their_task: "T"}
    )

    # Then both say the same (but the job's id) with the same exit code, and leave the jobs
    # in the same state
    assert done == expected
    assert done[0] == code and "job ID" in "\n".join(done[1] + done[2]), done
    mine_after, theirs_after = shop.store.get(mine[state]), shop.store.get(theirs[state])
    assert mine_after is not None and theirs_after is not None
    assert (mine_after.state, mine_after.stop_requested) == (
        theirs_after.state,
        theirs_after.stop_requested,
    )


@pytest.mark.parametrize("shop", ["sqlite"], indirect=True)
def test_cursor_reap_watch_and_help_are_the_celery_cli_commands(shop: Shop) -> None:
    key = f"account-{uuid.uuid4().hex[:8]}"

    set_mine = shown(manage_leases(shop, "cursor", key, "--set", '{"after": 7}'))
    read_theirs = shown(celery_leases(shop, "cursor", key))
    read_mine = shown(manage_leases(shop, "cursor", key))
    reaped = both(shop, "reap", "--json")
    watched = both(shop, "watch", "--once")
    helped = both(shop, "--help")

    assert set_mine[0] == 0 and read_mine == read_theirs and read_mine[0] == 0
    assert '{"after": 7}' in " ".join(read_mine[1])
    assert reaped[0][0] == reaped[1][0] == 0
    assert json.loads("\n".join(reaped[0][1])).keys() == json.loads("\n".join(reaped[1][1])).keys()
    assert watched[0] == watched[1] and watched[0][0] == 0
    assert helped[0][0] == helped[1][0] == 0
    assert helped[0][1][0] == "Usage: manage.py leases [OPTIONS] COMMAND [ARGS]..."
    assert helped[0][1][1:] == helped[1][1][1:]


def test_without_a_celery_app_the_command_says_how_to_name_it(tmp_path: Any) -> None:
    # Given a project whose CELERY_LEASES_APP names nothing
    env = {"SHOP_DATABASE": "sqlite", "SHOP_DB_NAME": str(tmp_path / "x.sqlite3")}
    shop = Shop("sqlite", env, "")

    done = manage_leases(
        shop,
        "list",
        DJANGO_SETTINGS_MODULE=EXTRA_SETTINGS,
        SHOP_EXTRA_SETTINGS=json.dumps({"CELERY_LEASES_APP": "shop.nothing.app"}),
    )

    assert done.returncode == 2
    assert done.stderr.startswith("Error: CELERY_LEASES_APP is 'shop.nothing.app', which cannot")


def test_a_missing_leases_table_names_manage_py_migrate_first(tmp_path: Any) -> None:
    from tests.django.conftest import sqlite_shop

    # Given a project whose database was never migrated
    shop = sqlite_shop(tmp_path)

    # When manage.py leases reads the jobs
    done = shop.try_manage("leases", "list")

    # Then the error names Django's command first
    assert done.returncode == 1, done
    assert "create it with python manage.py migrate (outside Django: " in done.stderr
