"""Commands that make and migrate the table: ``init-db``, ``upgrade``."""

from __future__ import annotations

import click

from ..db import migrations
from ..db.migrations import upgrade
from .group import cli_routed, cli_stores, database_option


@click.command("init-db")
@database_option
def init_db(database: str | None) -> None:
    """Create the jobs table and its migration history, and say where (a table that exists
    is brought up to date), in every leases database."""
    routed = cli_routed()
    for name, store in cli_stores(database):
        click.echo(_prefix(name, routed) + upgrade(store).describe())


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
@database_option
def upgrade_db(revision: str, as_sql: bool, start: str | None, database: str | None) -> None:
    """Apply the schema migrations the jobs table lacks (a table made by an older
    celery-leases is brought under them, its jobs kept), in every leases database. With
    --sql, print them instead, for a review or to run by hand (the version table's rows
    included)."""
    if not as_sql and start is not None:
        raise click.UsageError("--from goes with --sql")
    routed = cli_routed()
    for i, (name, store) in enumerate(cli_stores(database)):
        if not as_sql:
            click.echo(_prefix(name, routed) + upgrade(store, revision=revision).describe())
            continue
        statements = migrations.sql(store, start=start, revision=revision)
        where = f"database {name}, " if routed else ""
        click.echo(
            ("\n" if i else "")
            + f"-- celery-leases: {where}table {store.table.name} in {store.safe_url}"
        )
        for statement in statements:
            click.echo(f"\n{statement};")


def _prefix(name: str, routed: bool) -> str:
    return f"database {name}: " if routed else ""


#: The commands of this module (``cli/__init__.py`` adds them to the group).
COMMANDS = (
    init_db,
    upgrade_db,
)
