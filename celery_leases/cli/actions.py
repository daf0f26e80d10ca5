"""Commands that act: ``retry``, ``cancel``, ``release``, ``cursor``, ``reap``, ``purge``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from .. import control, routes
from ..db import Store
from ..errors import ArgumentsError
from ..reaper import reap as reap_pass
from .group import (
    Duration,
    JobId,
    LeaseKey,
    cli_app,
    cli_routed,
    cli_settings,
    cli_stores,
    database_option,
    find_job,
    short_repr,
)
from .merge import ask
from .view import span, warning_lines


@click.command()
@click.argument("job_id", metavar="ID", type=JobId())
@database_option
def retry(job_id: str, database: str | None) -> None:
    """Re-publish a failed or cancelled job from its checkpoint."""
    name, store, job = find_job(cli_stores(database), job_id)
    with routes.using(name):
        click.echo(control.retry(cli_app(), store, job.id))


@click.command()
@click.argument("job_id", metavar="ID", type=JobId())
@database_option
def cancel(job_id: str, database: str | None) -> None:
    """Cancel a job (a running one stops at its next checkpoint)."""
    name, store, job = find_job(cli_stores(database), job_id)
    with routes.using(name):
        click.echo(control.cancel(cli_app(), store, job.id))


@click.command()
@click.argument("job_id", metavar="ID", type=JobId())
@database_option
def release(job_id: str, database: str | None) -> None:
    """Expire a running job's lease now (its host is dead).

    The next reaper pass (or ``leases reap``) re-publishes the job to resume elsewhere.
    """
    _, store, job = find_job(cli_stores(database), job_id)
    click.echo(control.release(store, job.id))


@click.command()
@click.argument("key", type=LeaseKey())
@click.option("--set", "value", metavar="JSON", help="Set the cursor to this JSON value.")
@click.option("--clear", is_flag=True, help="Clear it: the key's next run starts afresh.")
@database_option
def cursor(key: str, value: str | None, clear: bool, database: str | None) -> None:
    """Show a lease key's cursor (where its next run starts), or set or clear it.

    It is set or cleared only while no job holds the key (none queued or running, and no
    follow-up waiting to start): cancel such a job or let it end first. With several leases
    databases, the database whose cursor of the key is set; to set one where none is, name
    the database with --database.
    """
    if value is not None and clear:
        raise click.BadParameter("give --set or --clear, not both")
    store, current = key_cursor(key, database, write=value is not None or clear)
    if value is None and not clear:
        click.echo("none" if current is None else json.dumps(current, ensure_ascii=False))
        return
    text = None
    if not clear:
        try:
            text = control.cursor_text(str(value))
        except ArgumentsError as exc:
            raise click.BadParameter(f"--set {short_repr(value)} is {exc}") from None
    click.echo(control.set_cursor(store, key, text))


def key_cursor(key: str, database: str | None, *, write: bool) -> tuple[Store, Any]:
    """Lease key ``key``'s cursor and the store of its database: ``database``'s (or the only
    one's), else the one whose cursor of the key is set. With several databases, ``--database``
    is needed to ``write`` where no cursor (or more than one) is set."""
    found = cli_stores(database)
    cursors = [(name, store, store.cursor(key)) for name, store in found]
    if len(found) > 1:
        cursors = [(name, store, value) for name, store, value in cursors if value is not None]
    if len(cursors) == 1:
        return cursors[0][1], cursors[0][2]
    if not cursors and not write:
        return found[0][1], None
    where = (
        f"Databases {', '.join(n for n, _, _ in cursors)} have" if cursors else "No database has"
    )
    raise click.MissingParameter(
        f"{where} a cursor of lease key {key!r}: name the one its jobs live in "
        f"({', '.join(name for name, _ in found)})",
        param_hint="'--database'",
        param_type="option",
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print what it did as JSON.")
@click.pass_context
def reap(ctx: click.Context, as_json: bool) -> None:
    """Run one reaper pass and print what it did.

    It re-publishes jobs whose lease expired, gives up on poison jobs, and purges finished jobs
    older than leases_retention, in every leases database; one that does not answer is
    skipped, said, and makes the exit code 1.
    """
    settings = cli_settings()
    report = reap_pass(cli_app())
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        click.echo(f"re-published {_jobs_text(report.republished)} whose lease had expired")
        if report.gave_up:
            click.echo(
                f"gave up on {_jobs_text(report.gave_up)}, now failed: 'leases show' says why"
            )
        click.echo(
            f"purged {report.purged} finished jobs older than {span(settings.retention)} "
            f"(leases_retention)"
        )
    if report.unreachable:
        click.echo(
            f"Error: database {', '.join(report.unreachable)} did not answer, its jobs were not "
            f"reaped; the next pass tries again",
            err=True,
        )
    if report.publish_failed:
        click.echo(
            f"Error: could not publish {_jobs_text(report.publish_failed)}; the next pass retries",
            err=True,
        )
    if report.publish_failed or report.unreachable:
        ctx.exit(1)


def _jobs_text(ids: Sequence[str]) -> str:
    noun = "job" if len(ids) == 1 else "jobs"
    return f"{len(ids)} {noun}" + (f" ({', '.join(ids)})" if ids else "")


@click.command()
@click.option(
    "--older-than",
    "older_than",
    required=True,
    type=Duration(),
    help="Age since the job finished: 30s, 15m, 12h, 7d.",
)
@database_option
@click.pass_context
def purge(ctx: click.Context, older_than: float, database: str | None) -> None:
    """Delete jobs that finished longer ago than --older-than (in every leases database: a
    database that does not answer is named in a warning and the command exits with 1)."""
    batch = cli_settings().reap_batch
    answers, unanswered = ask(
        cli_stores(database), lambda store: store.purge_all(older_than=older_than, batch=batch)
    )
    if cli_routed():
        for name, purged in answers:
            click.echo(f"database {name}: purged {_finished_text(purged)}")
    total = sum(purged for _, purged in answers)
    click.echo(f"purged {_finished_text(total)} older than {span(older_than)}")
    for warning in unanswered:
        click.echo(warning_lines(warning))
    if unanswered:
        ctx.exit(1)


def _finished_text(n: int) -> str:
    return f"{n} finished {'job' if n == 1 else 'jobs'}"


#: The commands of this module (``cli/__init__.py`` adds them to the group).
COMMANDS = (
    retry,
    cancel,
    release,
    cursor,
    reap,
    purge,
)
