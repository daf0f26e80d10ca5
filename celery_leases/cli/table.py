"""Commands that make and migrate the table: ``init-db``, ``upgrade``."""

from __future__ import annotations

import click

from ..db import migrations
from ..db.migrations import upgrade
from .group import cli_store


@click.command("init-db")
def init_db() -> None:
    """Create the jobs table and its migration history, and say where (a table that exists
    is brought up to date)."""
    click.echo(upgrade(cli_store()).describe())


@click.command("upgrade")
@click.option(
    "--to",
    "revision",
    default="head",
    show_default=True,
    metavar="REVISION",
    help="Stop at this revision.",
)
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Print the SQL the upgrade would run, for the table's database, and run nothing.",
)
@click.option(
    "--from",
    "start",
    default=None,
    metavar="REVISION",
    help="With --sql: from this revision ('base': an empty database), not the table's own.",
)
def upgrade_db(revision: str, as_sql: bool, start: str | None) -> None:
    """Apply the schema migrations the jobs table lacks (a table made by an older
    celery-leases is brought under them, its jobs kept). With --sql, print them instead,
    for a review or to run by hand (the version table's rows included)."""
    store = cli_store()
    if not as_sql:
        if start is not None:
            raise click.UsageError("--from goes with --sql")
        click.echo(upgrade(store, revision=revision).describe())
        return
    statements = migrations.sql(store, start=start, revision=revision)
    click.echo(f"-- celery-leases: table {store.table.name} in {store.safe_url}")
    for statement in statements:
        click.echo(f"\n{statement};")


#: The commands of this module (``cli/__init__.py`` adds them to the group).
COMMANDS = (
    init_db,
    upgrade_db,
)
