"""The Django integration in the example project, against SQLite, PostgreSQL and MariaDB:
migrations, the leases in Django's own database, ORM writes and checkpoints committed together,
delay_on_commit, and the admin (Django's test client)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa

import celery_leases.contrib.django.migrations as django_migrations
from celery_leases.db import migrations
from tests.django.conftest import TABLE, Shop, sqlite_shop

DJANGO_MIGRATIONS = Path(django_migrations.__file__).parent


def test_migrate_creates_the_leases_table_in_django_own_database_and_zero_drops_it(
    shop: Shop,
) -> None:
    # Given the project migrated (the shop fixture ran manage.py migrate)
    assert migrations.current(shop.store) == migrations.head()

    # When the app's migrations are undone, then applied again
    shop.manage("migrate", "celery_leases", "zero", "--verbosity", "0")
    with shop.store.engine.connect() as connection:
        left = [t for t in sa.inspect(connection).get_table_names() if t.startswith(TABLE)]
    again = shop.manage("migrate", "--verbosity", "1")

    # Then zero dropped the table and every table of its own (its version table too), and
    # migrate made them anew, saying where
    assert left == []
    assert migrations.current(shop.store) == migrations.head()
    assert f"celery-leases: leases table {TABLE} in " in again.stdout


def test_migrate_upgrades_a_leases_table_an_older_release_made_keeping_its_jobs(
    shop: Shop,
) -> None:
    # Given the leases table at the first revision (as celery-leases before lease keys made
    # it, with its first Django migration), holding a job
    first = migrations.revisions()[0]
    shop.manage("migrate", "celery_leases", "0001", "--verbosity", "0")
    assert migrations.current(shop.store) == first
    job_id = f"old-{shop.kind}"
    with shop.store.engine.begin() as connection:
        connection.execute(
            sa.text(
                f"INSERT INTO {TABLE} (id, task, generation, message, state, token, attempts, "
                "stalled_attempts, sends, created_at, schema_version) VALUES (:id, 'billing.x', "
                "0, '{}', 'done', 1, 1, 0, 0, 0, 3)"
            ),
            {"id": job_id},
        )

    # When the project is migrated, as a deploy of a newer celery-leases does
    done = shop.manage("migrate", "--verbosity", "1")

    # Then the table is at the code's revision, the job still in it, and migrate said where
    shop.store.schema_changed()
    assert migrations.current(shop.store) == migrations.head()
    with shop.store.engine.connect() as connection:
        found = connection.execute(
            sa.text(f"SELECT state FROM {TABLE} WHERE id = :id"), {"id": job_id}
        ).scalar()
    assert found == "done"
    assert f"celery-leases: leases table {TABLE} in " in done.stdout
    with shop.store.engine.begin() as connection:
        connection.execute(sa.text(f"DELETE FROM {TABLE} WHERE id = :id"), {"id": job_id})


def test_the_celery_app_keeps_its_leases_in_django_database_without_a_url_of_its_own(
    shop: Shop,
) -> None:
    where = shop.run("where")

    assert where["celery_url"] == where["django_url"]
    assert where["table"] == TABLE
    backend = sa.engine.make_url(where["celery_url"]).get_backend_name()
    assert backend == {"sqlite": "sqlite", "postgres": "postgresql", "mariadb": "mysql"}[shop.kind]


def test_an_orm_write_and_its_checkpoint_commit_together_and_a_stale_attempt_rolls_back(
    shop: Shop,
) -> None:
    seen = shop.run("orm_checkpoint")

    # The stale attempt's checkpoint raised inside atomic(), and its invoice rolled back
    assert seen["stale"] == "LeaseLost"
    assert seen["invoices after the stale attempt"] == 0
    # A block that fails after the checkpoint rolls the checkpoint back with the invoice
    assert seen["checkpoint after a rolled-back block"] is None
    assert seen["invoices after a rolled-back block"] == 0
    # The checkpoint is in Django's transaction: invisible to another connection until commit
    assert seen["checkpoint seen before the commit"] is None
    assert seen["checkpoint after the commit"] == {"next": 1}
    assert seen["progress after the commit"] == [1, 2]
    assert seen["invoices"] == [[0, seen["fresh token"]]]


def test_delay_on_commit_records_and_sends_the_job_only_when_the_block_commits(
    shop: Shop,
) -> None:
    seen = shop.run("delay_on_commit")

    assert seen["inside the block"] == []
    assert seen["after the commit"] == ["queued"]
    assert seen["after a rollback"] == []


def test_the_admin_lists_filters_and_searches_jobs_and_groups_and_its_actions_use_the_store(
    shop: Shop,
) -> None:
    seen = shop.run("admin")

    assert seen["listed"] == ["done", "failed", "queued", "running"]
    assert seen["progress shown"]
    assert seen["filtered by state running"] == ["running"]
    assert seen["filtered by state waiting"] == [True, False]
    assert seen["filtered by state queued"] == [False, True]
    assert seen["reaper warning"]  # no reaper pass recorded
    assert seen["filtered by task"] == ["done", "failed", "queued", "running"]
    assert seen["searched by id prefix"] == ["running"]
    assert seen["created in the past hour"] == ["failed", "queued", "running"]
    assert seen["created_at"] == ["datetime", True]
    assert (seen["created since an hour ago"], seen["created before an hour ago"]) == (3, 1)
    assert seen["taken as a date, text and seconds"] == [4, 4, 4]
    assert seen["__date as in Python"] == [True] * 4
    assert seen["__year and __hour"] == [True]
    assert seen["datetimes by day"]
    assert seen["date hierarchy links"]
    assert seen["listed on the running job's day"] == seen["expected on that day"]
    assert "running" in seen["expected on that day"]
    # Read-only: a job's page shows it, with no save button, and refuses a POST; no add page
    assert (seen["detail status"], seen["detail has a save button"]) == (200, False)
    assert seen["detail shows the checkpoint"]
    assert seen["detail post status"] == 403
    assert seen["add status"] == 403
    # The actions: cancel (queued: cancelled; running: asked to stop; done: refused), retry
    # (failed: queued again, checkpoint kept), release (running: lease expired)
    cancel = seen["cancel messages"]
    assert any("cancelled: its message is dropped" in m for m in cancel)
    assert any("it stops at its next checkpoint and ends cancelled" in m for m in cancel)
    assert any("is done; only queued or running jobs can be cancelled" in m for m in cancel)
    assert any(
        "queued again: attempt 2 resumes from its checkpoint" in m for m in seen["retry messages"]
    )
    assert any("lease of w@host/" in m for m in seen["release messages"])
    assert seen["viewer sees"] == [200, []]
    assert seen["after"]["queued"][:2] == ["cancelled", None]
    assert seen["after"]["running"] == ["running", "cancel", True]
    assert seen["after"]["failed"][0] == "queued"
    assert seen["after"]["done"][0] == "done"
    assert seen["failed job's checkpoint"] == {"next": 4}
    # The lease keys' pages: set a free key's cursor, refuse what is not JSON and a held key,
    # clear it; a keyed job's page shows its key, its arguments and its waiting follow-up
    assert len(seen["keys listed"]) == 2
    assert seen["set"][0] == 200 and seen["set"][2] == {"page": 7}
    assert any("set to" in m for m in seen["set"][1])
    assert seen["not json"][2] == {"page": 7}
    assert any("The cursor is not JSON" in m for m in seen["not json"][1])
    assert seen["held"][2] == {"page": 1}
    assert any("is held by a job" in m for m in seen["held"][1])
    assert seen["cleared"][2] is None
    assert seen["keyed job's page"] == [True, True, True]
    # The job groups' page: limit, rate as written, admitted (live) and waiting jobs, and the
    # bucket's tokens now (the 10/m group took its token moments ago); read-only
    a, b = sorted(seen["groups listed"])
    assert seen["groups status"] == 200
    assert seen["groups listed"] == {a: ["1", "10/m", "1", "2"], b: ["-", "-", "0", "1"]}
    tokens_a, tokens_b = seen["tokens now"]
    assert 0.0 <= float(tokens_a) < 0.5 and tokens_b == "-"
    assert seen["group add status"] == 403
    assert seen["group's page"] == [200, False]
    page = seen["group's page shows"]
    assert [page[f] for f in ("group", "limit", "rate_shown", "admitted", "waiting")] == [
        a, "1", "10/m", "1", "2",
    ]  # fmt: skip
    # A group leads to its jobs, the waiting ones shown waiting; the filter offers the group;
    # a job's page shows its group and whether it waits
    assert seen["group's jobs link"] == "/admin/celery_leases/job/?group=" + a.replace(":", "%3A")
    assert len(seen["jobs of the group"]) == 3 and all(
        j[0] == "a" for j in seen["jobs of the group"]
    )
    assert seen["states shown"] == ["queued", "waiting", "waiting"]
    assert seen["group offered in the filter"]
    assert seen["waiting job's page"] == [True, True]
    assert seen["admitted job's page"]


@pytest.mark.parametrize("shop", ["postgres", "mariadb"], indirect=True)
def test_a_block_idle_past_the_lease_after_its_checkpoint_is_ended_and_seen_as_such(
    shop: Shop,
) -> None:
    seen = shop.run("idle_in_atomic")

    assert seen["idle bounded"] is True
    assert seen["ended idle"] is True, seen
    assert (seen["invoices"], seen["checkpoint"]) == (0, None)


def test_leases_in_a_database_alias_of_their_own_are_migrated_read_and_administered_there(
    tmp_path: Path,
) -> None:
    # Given the project with CELERY_LEASES_DATABASE_ALIAS = "leases", a second SQLite file
    default, leases = tmp_path / "default.sqlite3", tmp_path / "leases.sqlite3"
    env = {
        "SHOP_DATABASE": "sqlite",
        "SHOP_DB_NAME": str(default),
        "SHOP_LEASES_DB_NAME": str(leases),
        "SHOP_LEASES_TABLE": TABLE,
        "SHOP_DEBUG": "0",
    }
    shop = Shop("sqlite", env, f"sqlite:///{leases}")

    # When both databases are migrated
    shop.manage("migrate", "--verbosity", "0")
    made = shop.manage("migrate", "--database", "leases", "--verbosity", "1")

    try:
        # Then the jobs table is in the leases database only, where the Celery app keeps its
        # leases, and the admin lists and acts on the jobs there
        tables = {}
        for path in (default, leases):
            engine = sa.create_engine(f"sqlite:///{path}")
            with engine.connect() as connection:
                tables[path.name] = sa.inspect(connection).get_table_names()
            engine.dispose()
        assert TABLE in tables["leases.sqlite3"] and TABLE not in tables["default.sqlite3"]
        assert f"celery-leases: leases table {TABLE} in " in made.stdout
        where = shop.run("where")
        assert (where["alias"], where["celery_url"]) == ("leases", f"sqlite:///{leases}")
        assert where["celery_url"] == where["alias_url"] != where["django_url"]
        seen = shop.run("admin")
        assert seen["listed"] == ["done", "failed", "queued", "running"]
        assert seen["after"]["queued"][:2] == ["cancelled", None]
    finally:
        if shop._store is not None:
            shop._store.engine.dispose()


def test_migrate_of_the_leases_database_migrates_every_routed_database_too(
    tmp_path: Path,
) -> None:
    # Given the project with a second leases database (CELERY_LEASES_DATABASES)
    routed = tmp_path / "routed.sqlite3"
    shop = sqlite_shop(tmp_path, SHOP_LEASES_ROUTED_URL=f"sqlite:///{routed}")

    # When the project is migrated, then its leases migrated back to zero
    shop.manage("migrate", "--verbosity", "0")
    made = tables_of(routed)
    shop.manage("migrate", "celery_leases", "zero", "--verbosity", "0")

    # Then the routed database got the jobs table at the code's revision, and lost it again
    assert TABLE in made and f"{TABLE}_version" in made
    assert [t for t in tables_of(routed) if t.startswith(TABLE)] == []


def test_a_leases_database_added_after_migrate_is_a_warning_until_migrate_brings_it_up(
    tmp_path: Path,
) -> None:
    # Given the project migrated with its one leases database
    routed = tmp_path / "routed.sqlite3"
    shop = sqlite_shop(tmp_path)
    shop.manage("migrate", "--verbosity", "0")

    # When a second leases database is added (CELERY_LEASES_DATABASES): the project checked,
    # migrated (Django records every migration as applied already), checked again
    added = {"SHOP_LEASES_ROUTED_URL": f"sqlite:///{routed}"}
    before = shop.try_manage("check", "--database", "default", **added)
    shop.manage("flush", "--no-input", **added)  # what a TransactionTestCase does after a test
    flushed = tables_of(routed)
    made = shop.manage("migrate", "--verbosity", "1", **added)
    after = shop.try_manage("check", "--database", "default", **added)

    # Then the check names the database and the command, and migrate, with no migration to
    # apply, brings the new database to the leases table's revision
    assert "celery_leases.W003" in before.stderr, before.stderr
    assert "leases database 'routed' (CELERY_LEASES_DATABASES)" in before.stderr
    assert "run manage.py migrate: it brings every database" in before.stderr
    assert TABLE not in flushed  # flush sends post_migrate too: it migrates nothing
    assert "No migrations to apply" in made.stdout
    assert f"(database 'routed'): brought to revision {migrations.head()}" in made.stdout
    assert TABLE in tables_of(routed)
    assert "celery_leases.W003" not in after.stderr, after.stderr


def test_migrate_goes_through_when_a_routed_database_added_later_cannot_be_reached(
    tmp_path: Path,
) -> None:
    # Given the project migrated, then a second leases database added that cannot be reached
    shop = sqlite_shop(tmp_path)
    shop.manage("migrate", "--verbosity", "0")
    gone = {"SHOP_LEASES_ROUTED_URL": f"sqlite:///{tmp_path}/no/such/dir/routed.sqlite3"}

    # When the project is migrated (a new migration of another app would be applied so)
    made = shop.try_manage("migrate", "--verbosity", "1", **gone)

    # Then migrate succeeds (Django's migrations are committed, the other apps' post_migrate
    # receivers ran) and says which database it could not bring to the revision, and why
    assert made.returncode == 0, made.stderr
    assert "could not bring leases database 'routed'" in made.stdout
    assert "Run manage.py migrate again once it answers" in made.stdout


def test_a_checkpoint_in_atomic_of_a_routed_job_is_refused_naming_its_database(
    tmp_path: Path,
) -> None:
    # Given the project with a second leases database, migrated
    routed = tmp_path / "routed.sqlite3"
    shop = sqlite_shop(tmp_path, SHOP_LEASES_ROUTED_URL=f"sqlite:///{routed}")
    shop.manage("migrate", "--verbosity", "0")

    # When a task whose jobs live there checkpoints inside atomic() on the project's database
    seen = shop.run("checkpoint_in_atomic_of_a_routed_job")

    # Then it is refused, naming the job's database and what to do (not the settings of the
    # leases database, which would not help)
    assert seen["home"] == "routed"
    error = seen["error"]
    assert error.startswith("ConfigurationError: a checkpoint inside transaction.atomic()")
    assert "this job lives in leases database 'routed' of CELERY_LEASES_DATABASES" in error
    assert "add that database to DATABASES" in error and "after the block" in error
    assert "CELERY_LEASES_DATABASE_ALIAS" not in error


def test_the_admin_shows_each_leases_database_and_acts_where_a_job_lives(
    tmp_path: Path,
) -> None:
    # Given the project with a second leases database that DATABASES names too, migrated,
    # a running job in each database and a group in the second
    routed = tmp_path / "routed.sqlite3"
    shop = sqlite_shop(
        tmp_path,
        SHOP_LEASES_ROUTED_URL=f"sqlite:///{routed}",
        SHOP_LEASES_ROUTED_SQLITE=str(routed),
    )
    shop.manage("migrate", "--verbosity", "0")

    # When a staff user lists the jobs of each database, opens one, cancels it, follows a
    # group of the second database to its jobs, and opens pages with the second one down
    seen = shop.run("admin_across_databases")

    # Then each list shows its database's jobs, each row saying where it lives; the filter
    # offers both (no "All": a list pages one database); an unknown name is Django's error
    # page; the routed job's page is found without the filter, and cancelled in its database
    home, away = (f"{kind}-{seen['tag']}" for kind in ("home", "away"))
    assert seen["default list"] == {home: "default"}, seen
    assert seen["routed list"] == {away: "routed", f"grouped-{seen['tag']}": "routed"}, seen
    assert seen["filter offers"] == ["*default: ?", "routed: ?database=routed"], seen
    assert seen["unknown database"] == 302
    assert seen["routed job's page"] == [True, True]
    cancel, warning = seen["cancel messages"]
    assert cancel.startswith(f"job {away} (billing.invoice_orders) running on "), cancel
    assert cancel.endswith("it stops at its next checkpoint and ends cancelled"), cancel
    # (no reaper ran: the list's warning names the database it has not seen a pass in)
    assert warning.startswith("celery-leases (leases database 'routed'): no reaper pass"), warning
    assert seen["after"] == {"default": None, "routed": "cancel"}
    assert seen["group's jobs link"].startswith("/admin/celery_leases/job/?database=routed&")
    assert seen["group's jobs"] == {f"grouped-{seen['tag']}": "routed"}
    assert seen["groups of default"] is False
    # (a key of one name in both: set where it was opened, shown from there after the save)
    assert seen["cursors after the save"] == ["home", "edited"], seen
    assert seen["page after the save"] == ["edited"], seen
    # (the key's page by a bare link: the default database's, saying the routed one holds a
    # key of that name too, with a link that opens that one; no such word for a job that
    # lives in one database only)
    shown, said = seen["bookmark"]
    assert shown == ["home"] and len(said) == 1, seen
    assert said[0].startswith("celery-leases: this page shows the object of leases database "), said
    assert "default;" in said[0] and "named no database" in said[0], said
    assert seen["its link"] == [
        f"/admin/celery_leases/leasekey/cursor-{seen['tag']}/change/"
        "?_changelist_filters=database%3Drouted"
    ], seen
    assert len(seen["bookmark's link, as the page has it"]) == 1, seen  # a link, not its text
    # (opened from the default list, whose rows' links name it: no warning)
    assert "_changelist_filters=database%3Ddefault" in seen["the default list's row link"], seen
    assert seen["opened from the default list"] == [["home"], []], seen
    assert seen["the linked page"] == ["edited"], seen
    assert seen["a job in one database, by a bare link"] == [], seen
    # (the routed database down: a job of the default one opens; a page of an id in neither
    # is Django's "doesn't exist", with a warning that the routed one could not be searched)
    assert seen["a job's page, routed down"] == 200, seen
    assert seen["a missing job's page, routed down"] == 200, seen
    missing, searched = seen["its messages"]
    assert searched == (
        "leases database 'routed' could not be searched (OperationalError; the server's log "
        "says why)"
    ), searched
    assert missing.startswith("leased job with ID "), missing
    assert f"nowhere-{seen['tag']}" in missing and "exist. Perhaps it was deleted?" in missing
    # (a user who may not see the page is refused it, and is told nothing of the search)
    assert seen["refused, then the next page's messages"] == [403, 200, []], seen

    # And a routed database that DATABASES does not name is offered, and its list says how
    # to see its jobs
    apart = sqlite_shop(tmp_path, SHOP_LEASES_ROUTED_URL=f"sqlite:///{routed}")
    said = apart.run("admin_of_a_database_not_in_databases")
    assert said["status"] == 200 and said["offered"] is True, said
    assert len(said["says"]) == 1 and "is not in DATABASES" in said["says"][0], said
    assert "leases list --database routed" in said["says"][0]


def tables_of(path: Path) -> list[str]:
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as connection:
            return sa.inspect(connection).get_table_names()
    finally:
        engine.dispose()


def test_an_in_memory_sqlite_database_is_refused_with_the_reason(tmp_path: Path) -> None:
    # Given a project whose database is SQLite in memory (no other connection can see it)
    env = {"SHOP_DATABASE": "sqlite", "SHOP_DB_NAME": ":memory:", "SHOP_DEBUG": "0"}
    shop = Shop("sqlite", env, "sqlite://")

    # When the leases URL is built from it, then it is refused, saying why and what to do
    error = shop.run("url_error")
    assert error is not None and "in-memory SQLite database" in error
    assert "give it a file" in error


def test_each_revision_is_a_django_operation_whose_sql_sqlmigrate_prints(shop: Shop) -> None:
    # When sqlmigrate prints each migration of the app for the project's database
    names = sorted(
        path.name[:4] for path in DJANGO_MIGRATIONS.glob("0*.py") if path.name[:4].isdigit()
    )
    printed = [shop.manage("sqlmigrate", "celery_leases", name).stdout for name in names]

    # Then every celery-leases revision is there once, in order, each with the statements the
    # revision runs on this database (those `leases upgrade --sql` prints)
    text = "\n".join(printed)
    headers = re.findall(r"^-- celery-leases revision (\d{4}): ", text, re.MULTILINE)
    assert headers == list(migrations.revisions())
    for revision in migrations.revisions():
        start = migrations.previous(revision) or "base"
        for statement in migrations.sql(shop.store, start=start, revision=revision):
            assert f"{statement};" in text, (revision, statement)
    assert "CREATE TABLE" in printed[0] and f"{TABLE}_groups" in printed[2]
