"""``celery -A proj leases ...``: look at leased jobs and act on them from the shell.

Registered under the ``celery.commands`` entry point. Every time shown is relative and comes from
the database clock (the store's ``age``, ``expires_in`` and ``checkpoint_age``), never from the
clock of the machine running the command. Colours only on a terminal; ``--json`` for scripts.
"""

from __future__ import annotations

from . import actions, jobs, table
from .group import leases

# Each command module's commands, under ``celery -A proj leases``.
for _module in (jobs, actions, table):
    for _command in _module.COMMANDS:
        leases.add_command(_command)

__all__ = ["leases"]
