"""Commands that make and migrate the table: ``init-db``, ``upgrade``."""

from __future__ import annotations

import click

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
def upgrade_db(revision: str) -> None:
    """Apply the schema migrations the jobs table lacks (a table made by an older
    celery-leases is brought under them, its jobs kept)."""
    click.echo(upgrade(cli_store(), revision=revision).describe())


#: The commands of this module (``cli/__init__.py`` adds them to the group).
COMMANDS = (
    init_db,
    upgrade_db,
)
