"""Commands that act: ``retry``, ``cancel``, ``release``, ``cursor``, ``reap``, ``purge``."""

from __future__ import annotations

import json
from collections.abc import Sequence

import click

from .. import control
from ..db import store_for
from ..errors import ArgumentsError
from ..reaper import reap as reap_pass
from .group import Duration, JobId, LeaseKey, cli_app, cli_settings, cli_store, find_job, short_repr
from .view import (
    span,
)


@click.command()
@click.argument("job_id", metavar="ID", type=JobId())
def retry(job_id: str) -> None:
    """Re-publish a failed or cancelled job from its checkpoint."""
    store = cli_store()
    click.echo(control.retry(cli_app(), store, find_job(store, job_id).id))


@click.command()
@click.argument("job_id", metavar="ID", type=JobId())
def cancel(job_id: str) -> None:
    """Cancel a job (a running one stops at its next checkpoint)."""
    store = cli_store()
    click.echo(control.cancel(cli_app(), store, find_job(store, job_id).id))


@click.command()
@click.argument("job_id", metavar="ID", type=JobId())
def release(job_id: str) -> None:
    """Expire a running job's lease now (its host is dead).

    The next reaper pass (or ``leases reap``) re-publishes the job to resume elsewhere.
    """
    store = cli_store()
    click.echo(control.release(store, find_job(store, job_id).id))


@click.command()
@click.argument("key", type=LeaseKey())
@click.option("--set", "value", metavar="JSON", help="Set the cursor to this JSON value.")
@click.option("--clear", is_flag=True, help="Clear it: the key's next run starts afresh.")
def cursor(key: str, value: str | None, clear: bool) -> None:
    """Show a lease key's cursor (where its next run starts), or set or clear it.

    It is set or cleared only while no job holds the key (none queued or running, and no
    follow-up waiting to start): cancel such a job or let it end first.
    """
    if value is not None and clear:
        raise click.BadParameter("give --set or --clear, not both")
    store = cli_store()
    if value is None and not clear:
        current = store.cursor(key)
        click.echo("none" if current is None else json.dumps(current, ensure_ascii=False))
        return
    text = None
    if not clear:
        try:
            text = control.cursor_text(str(value))
        except ArgumentsError as exc:
            raise click.BadParameter(f"--set {short_repr(value)} is {exc}") from None
    click.echo(control.set_cursor(store, key, text))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print what it did as JSON.")
@click.pass_context
def reap(ctx: click.Context, as_json: bool) -> None:
    """Run one reaper pass and print what it did.

    It re-publishes jobs whose lease expired, gives up on poison jobs, and purges finished jobs
    older than leases_retention.
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
    if report.publish_failed:
        click.echo(
            f"Error: could not publish {_jobs_text(report.publish_failed)}; the next pass retries",
            err=True,
        )
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
def purge(older_than: float) -> None:
    """Delete jobs that finished longer ago than --older-than."""
    settings = cli_settings()
    store = store_for(settings)
    purged = store.purge_all(older_than=older_than, batch=settings.reap_batch)
    noun = "job" if purged == 1 else "jobs"
    click.echo(f"purged {purged} finished {noun} older than {span(older_than)}")


#: The commands of this module (``cli/__init__.py`` adds them to the group).
COMMANDS = (
    retry,
    cancel,
    release,
    cursor,
    reap,
    purge,
)
