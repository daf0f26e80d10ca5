"""Commands that show jobs: ``list``, ``show``, ``watch``."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import click
from kombu.utils import json as kombu_json

from ..db import Store
from ..db.schema import CANCELLED, FAILED, RUNNING, STATES, WAITING
from ..errors import StoreUnavailable
from ..groups import rate_text
from .group import (
    JobId,
    cli_app,
    cli_command,
    cli_routed,
    cli_settings,
    cli_stores,
    database_option,
    find_job,
)
from .merge import ask, read_jobs
from .view import (
    COUNT_CAP,
    Column,
    JobFacts,
    Output,
    counts_text,
    job_columns,
    job_table,
    jobs_count,
    span,
    stall_note,
    table,
    warning_lines,
)


@click.command("list")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([*STATES, WAITING]),
    help="Only jobs in this state (repeatable; waiting: a group's, not admitted yet).",
)
@click.option("--task", metavar="NAME", help="Only jobs of this task name.")
@click.option("--group", metavar="NAME", help="Only jobs of this group (lease_group).")
@click.option(
    "--limit", default=50, show_default=True, type=click.IntRange(min=1), help="At most N jobs."
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array (all fields).")
@database_option
@click.pass_context
def list_jobs(
    ctx: click.Context,
    states: tuple[str, ...],
    task: str | None,
    group: str | None,
    limit: int,
    as_json: bool,
    database: str | None,
) -> None:
    """List jobs, newest first, with lease, checkpoint age and progress.

    LEASE is the time left on a running job's lease, CKPT the age of its last checkpoint,
    TRY its attempts; IDs are short prefixes, accepted by the other commands. A finished
    state is counted up to 10,000 (shown as 10,000+), whatever the table holds.

    With several leases databases, their jobs are listed together (DATABASE says where each
    lives); a database that does not answer is named in a warning, the others are listed,
    and the command exits with 1.
    """
    app, settings, routed = cli_app(), cli_settings(), cli_routed()
    found = cli_stores(database)
    facts = JobFacts(app, settings)
    listing = read_jobs(
        app,
        found,
        states=states,
        task=task,
        group=group,
        limit=limit,
        count_cap=None if as_json else COUNT_CAP,
    )
    jobs = listing.jobs
    if as_json:
        shown = [
            {**facts.as_dict(job), **({"database": name} if routed else {})}
            for job, name in zip(jobs, listing.databases, strict=True)
        ]
        click.echo(json.dumps(shown, indent=2))
        for warning in listing.warnings:
            click.echo(warning_lines(warning), err=True)
    else:
        out = Output()
        counts = listing.counts
        assert counts is not None
        total = jobs_count(counts.total, bool(counts.capped))
        if jobs:
            for text in job_table(
                out,
                facts,
                jobs,
                job_columns(routed),
                min_bar=8,
                max_bar=20,
                databases=listing.databases,
            ):
                click.echo(text)
        stalled = sum(1 for job in jobs if job.state == RUNNING and facts.stalled(job))
        dot = " · " if out.unicode else ", "
        summary = dot.join([f"showing {len(jobs)} of {total} jobs", *counts_text(counts, stalled)])
        click.echo(summary if counts.total else "no jobs yet")
        for note in stall_note(facts, jobs):
            click.echo(note)
        for warning in listing.warnings:
            click.echo(warning_lines(warning))
    if listing.unanswered:
        ctx.exit(1)


@click.command()
@click.argument("job_id", metavar="ID", type=JobId())
@click.option("--json", "as_json", is_flag=True, help="Print the job as JSON.")
@database_option
def show(job_id: str, as_json: bool, database: str | None) -> None:
    """One job in full, with its checkpoint. ID may be a unique prefix."""
    routed = cli_routed()
    where, _, job = find_job(cli_stores(database), job_id)
    facts = JobFacts(cli_app(), cli_settings())
    if as_json:
        shown = {**facts.as_dict(job), **({"database": where} if routed else {})}
        click.echo(json.dumps(shown, indent=2))
        return
    out = Output()
    state = facts.shown_state(job)
    quiet = facts.quiet_for(job)
    limit = facts.stall_timeout(job.task)
    status = out.style(job.state, job.state)
    if state == "stalled" and quiet is not None and limit is not None:
        status += out.style(
            f" (stalled: no checkpoint for {span(quiet)}, over {span(limit)})", "stalled"
        )
    if job.stop_requested:
        status += f", {job.stop_requested} requested at its next checkpoint"

    def ago(moment: float | None) -> str | None:
        seconds = facts.since(job, moment)
        return None if seconds is None else f"{span(seconds)} ago"

    lease = "-"
    if job.state == RUNNING and job.expires_in is not None:
        left = job.expires_in
        lease = f"{span(left)} left" if left > 0 else f"expired {span(left)} ago, to be reaped"
    progress = "-"
    if job.progress_done is not None:
        _, styled = out.bar(job.progress_done, job.progress_total, 20)
        count = f"{job.progress_done:,}" + (
            f" / {job.progress_total:,}" if job.progress_total else ""
        )
        progress = styled if job.progress_total else count
        if job.progress_total:
            progress += f"  ({count})"
    attempts = f"{job.attempts} (token {job.token})"
    if job.stalled_attempts:
        attempts += f", {job.stalled_attempts} in a row ended without a checkpoint"
    fields = [
        ("database", where if routed else None),
        ("task", job.task),
        ("key", job.lease_key),
        ("group", _group_text(job, ago)),
        ("follow-up", f"job {job.followup_id}, when this one ends" if job.followup_id else None),
        ("state", status),
        ("owner", job.owner),
        ("attempts", attempts),
        ("lease", lease),
        ("progress", progress),
        ("created", ago(job.created_at)),
        ("claimed", ago(job.claimed_at)),
        ("renewed", ago(job.renewed_at) if job.state == RUNNING else None),
        ("checkpoint", ago(job.checkpoint_at)),
        ("finished", ago(job.finished_at)),
        ("args", _compact(job.args)),
        ("kwargs", _compact(job.kwargs) if job.kwargs else None),
        ("parent", job.message.headers.get("parent_id")),
        ("routing", _compact(job.route) if job.route else None),
        ("error", out.style(job.error, "failed") if job.error else None),
        ("result", _compact(job.result) if job.result is not None else None),
    ]
    click.echo(out.style(f"job {job.id}", "header"))
    for name, value in fields:
        if value is not None and value != "-":
            click.echo(f"  {name:<11} " + value.replace("\n", "\n" + " " * 14))
    if job.checkpoint is None:
        click.echo("checkpoint: none")
    else:
        click.echo("checkpoint:")
        for text in json.dumps(job.checkpoint, indent=2, ensure_ascii=False).splitlines():
            click.echo(f"  {text}")
    if job.state in (FAILED, CANCELLED):
        again = "to resume it" if job.checkpoint is not None else "to run it again"
        click.echo(f"{again}: {cli_command()} retry {job.id}")


def _compact(value: Any) -> str:
    text = str(kombu_json.dumps(value, ensure_ascii=False))
    return text if len(text) <= 200 else text[:197] + "..."


@click.command()
@click.option(
    "--interval",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between refreshes.",
)
@click.option("--once", is_flag=True, help="Print one refresh and exit.")
@click.option(
    "--limit",
    default=100,
    show_default=True,
    type=click.IntRange(min=1),
    help="At most N jobs (a terminal shows what fits).",
)
@database_option
@click.pass_context
def watch(
    ctx: click.Context, interval: float, once: bool, limit: int, database: str | None
) -> None:
    """Running jobs with progress bars, refreshed until Ctrl-C.

    On a terminal the screen is redrawn; otherwise (ssh pipes, CI logs) a block is printed per
    refresh. With several leases databases, the running jobs of all of them.
    """
    found = cli_stores(database)
    facts = JobFacts(cli_app(), cli_settings())
    out = Output()
    columns = job_columns(cli_routed())
    try:
        while True:
            try:
                lines = watch_frame(out, found, facts, columns, limit=limit, interval=interval)
            except StoreUnavailable as exc:
                if once:
                    raise
                lines = [f"Error: {exc} (retrying every {span(interval)})"]
            if out.tty:
                click.echo("\x1b[H\x1b[2J" + "\n".join(lines), nl=True)
            else:
                click.echo("\n".join([*lines, ""]))
            if once:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        ctx.exit(0)


def watch_frame(
    out: Output,
    stores: list[tuple[str, Store]],
    facts: JobFacts,
    columns: list[Column],
    *,
    limit: int,
    interval: float,
) -> list[str]:
    """One refresh of ``watch``: a summary line and the running jobs of ``stores``."""
    listing = read_jobs(facts.app, stores, states=[RUNNING], limit=limit, count_cap=COUNT_CAP)
    jobs, counts = listing.jobs, listing.counts
    assert counts is not None
    stalled = sum(1 for job in jobs if facts.stalled(job))
    stamp = time.strftime("%H:%M:%S")
    title = f"celery leases watch: {stores[0][1].table.name} at {stamp}, every {interval:g}s"
    lines = [
        out.style(title, "header") + " (Ctrl-C stops)",
        ", ".join(counts_text(counts, stalled)) if counts.total else "no jobs",
        "",
    ]
    # Below the jobs, where it moves no line of theirs.
    warned = [
        out.style(line, "stalled")
        for warning in listing.warnings
        for line in warning_lines(warning).splitlines()
    ]
    hidden = 0
    if out.tty:
        room = max(out.height - 6, 1)
        hidden = max(len(jobs) - room, 0)
        jobs = jobs[:room]
    if not jobs:
        return [*lines, "no running jobs", *warned]
    lines += job_table(
        out, facts, jobs, columns, min_bar=10, max_bar=30, databases=listing.databases
    )
    if hidden:
        lines.append(f"... and {hidden} more running (not shown: the terminal is full)")
    lines += stall_note(facts, jobs)
    return [*lines, *warned]


@click.command("groups")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@database_option
@click.pass_context
def list_groups(ctx: click.Context, as_json: bool, database: str | None) -> None:
    """List the job groups (lease_group): each one's limit, its jobs admitted (in the broker or
    running) and waiting in the database, its rate and its bucket's tokens now.

    With several leases databases, the groups of all of them (DATABASE says where each
    lives); a database that does not answer is named in a warning and the command exits
    with 1."""
    routed = cli_routed()
    answers, unanswered = ask(cli_stores(database), lambda store: store.groups())
    found = [(name, g) for name, groups in answers for g in groups]
    if len(answers) > 1:
        found.sort(key=lambda pair: pair[1].name)
    if as_json:
        shown = [
            {**dataclasses.asdict(g), **({"database": name} if routed else {})} for name, g in found
        ]
        click.echo(json.dumps(shown, indent=2))
    elif not found:
        click.echo("no groups yet")
    else:
        out = Output()
        columns = [
            Column("GROUP", clip="end", minimum=12),
            *([Column("DATABASE", clip="end")] if routed else []),
            Column("LIMIT", right=True),
            Column("ADMITTED", right=True),
            Column("WAITING", right=True),
            Column("RATE", right=True),
            Column("TOKENS", right=True),
        ]

        def cell(text: str) -> tuple[str, str]:
            return text, out.style(text, "dim" if text == "-" else None)

        rows = [
            {
                "GROUP": cell(g.name),
                "DATABASE": cell(name),
                "LIMIT": cell("-" if g.limit is None else str(g.limit)),
                "ADMITTED": cell(str(g.admitted)),
                "WAITING": cell(str(g.waiting)),
                "RATE": cell("-" if g.rate is None else rate_text(g.rate)),
                "TOKENS": cell("-" if g.rate is None else f"{g.tokens:.2f}"),
            }
            for name, g in found
        ]
        for text in table(out, columns, rows):
            click.echo(text)
    for warning in unanswered:
        click.echo(warning_lines(warning), err=as_json)
    if unanswered:
        ctx.exit(1)


def _group_text(job: Any, ago: Any) -> str | None:
    group: str | None = job.lease_group
    if group is None:
        return None
    if job.waiting:
        return f"{group}, waiting for its admission"
    admitted = ago(job.admitted_at)
    return group + (f", admitted {admitted}" if admitted else "")


#: The commands of this module (``cli/__init__.py`` adds them to the group).
COMMANDS = (
    list_groups,
    list_jobs,
    show,
    watch,
)
