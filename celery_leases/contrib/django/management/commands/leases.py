"""``manage.py leases COMMAND``: ``celery -A proj leases COMMAND`` in a Django project.

The same click group runs (``celery_leases.cli``), so every command, option, output and exit
code is the CLI's; the Celery app is the project's (``CELERY_LEASES_APP``, else the app the
project's ``celery`` module makes: ``project.celery_app``). Its hints name
``python manage.py leases``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import click
from django.core.management.base import BaseCommand, CommandParser
from django.db import connections

from .....cli import leases
from .....cli.group import Host
from .....errors import ConfigurationError
from ...project import celery_app, missing_app_hint

PROG = "manage.py leases"


def run(args: Sequence[str]) -> int:
    """Run ``celery leases`` with ``args`` for the project's Celery app; its exit code."""
    args = list(args)
    no_color = False
    while args and args[0] == "--no-color":  # Django's option, before the command's name
        no_color = True
        args.pop(0)
    try:
        app = celery_app()
    except ConfigurationError as exc:
        click.echo(f"Error: {exc}", err=True)
        return 2
    if app is None:
        click.echo(f"Error: {PROG} needs your Celery app: {missing_app_hint()}", err=True)
        return 2
    host = Host(app=app, command=f"python {PROG}", no_color=no_color)
    try:
        code = leases.main(args, prog_name=PROG, obj=host, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        return 1
    except click.ClickException as exc:  # a usage error: standalone click shows it so
        exc.show()
        return exc.exit_code
    return code if isinstance(code, int) else 0


class Command(BaseCommand):
    help = "celery-leases jobs of the project's Celery app: as celery -A proj leases COMMAND."
    requires_system_checks: list[str] = []  # as the CLI, which checks its settings itself

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "args", nargs=argparse.REMAINDER, help="the celery leases command and its options"
        )

    def run_from_argv(self, argv: list[str]) -> None:
        # Every argument is the click group's (--help included), not argparse's.
        try:
            code = run(argv[2:])
        finally:
            connections.close_all()
        sys.exit(code)

    def print_help(self, prog_name: str, subcommand: str) -> None:
        # manage.py help leases: the group's help, as manage.py leases --help.
        run(["--help"])

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("leases", "list", "--json")``: exits with the CLI's code when it is
        not 0 (``SystemExit``)."""
        code = run(args)
        if code:
            sys.exit(code)
