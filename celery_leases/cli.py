"""``celery -A proj leases ...``: look at leased jobs and act on them from the shell.

Registered under the ``celery.commands`` entry point. Every time shown is relative and comes from
the database clock (the store's ``age``, ``expires_in`` and ``checkpoint_age``), never from the
clock of the machine running the command. Colours only on a terminal; ``--json`` for scripts.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import click
from kombu.utils import json as kombu_json

from . import control
from .config import Settings, settings_for
from .errors import ArgumentsError, InvalidJobState, JobNotFound, LeaseError, StoreUnavailable
from .identity import checked_key
from .migrations import upgrade
from .reaper import reap as reap_pass
from .rows import Job, dumps
from .schema import CANCELLED, FAILED, MAX_ID_LENGTH, MAX_KEY_LENGTH, RUNNING, STATES
from .store import Store, store_for
from .view import (
    JOB_COLUMNS,
    JobFacts,
    Output,
    counts_text,
    job_table,
    span,
    stall_note,
)

#: Shortest id prefix accepted in place of a full job id.
MIN_PREFIX = 4


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


# -- parameters ----------------------------------------------------------------------------------


class Duration(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.2
    """A duration such as ``30s``, ``15m``, ``12h``, ``7d``, ``1h30m`` or plain seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int | float):
            return float(value)
        text = str(value).strip().lower()
        if re.fullmatch(r"\d+(\.\d+)?", text):
            return float(text)
        parts = _DURATION_PART.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            self.fail(f"{_short_repr(value)} is not a duration (use 30s, 15m, 12h, 7d)", param, ctx)
        return sum(float(n) * _UNITS[u] for n, u in parts)


class JobId(click.ParamType):  # type: ignore[type-arg]
    """A job id, or a unique prefix of one (at least ``MIN_PREFIX`` characters)."""

    name = "id"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = str(value)
        if (
            not text
            or len(text) > MAX_ID_LENGTH
            or any(ch.isspace() or not ch.isprintable() for ch in text)
        ):
            self.fail(
                f"{_short_repr(value)} is not a job id (1 to {MAX_ID_LENGTH} printable "
                f"characters, no spaces)",
                param,
                ctx,
            )
        return text


class LeaseKey(click.ParamType):  # type: ignore[type-arg]
    """A lease key the table can hold whole."""

    name = "key"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return checked_key(str(value))
        except ArgumentsError:
            self.fail(
                f"{_short_repr(value)} is not a lease key (1 to {MAX_KEY_LENGTH} characters)",
                param,
                ctx,
            )


def _short_repr(value: Any) -> str:
    text = repr(str(value))
    return text if len(text) <= 60 else text[:56] + "...'"


# -- the group -----------------------------------------------------------------------------------


class LeasesGroup(click.Group):
    """Turns every LeaseError and bad parameter into one line on stderr and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.BadParameter as exc:
            _fail(ctx, exc.format_message(), code=2)
        except LeaseError as exc:
            _fail(ctx, str(exc), code=1)


def _fail(ctx: click.Context, message: str, *, code: int) -> NoReturn:
    click.echo(f"Error: {' '.join(message.split())}", err=True)
    ctx.exit(code)


@click.group(cls=LeasesGroup)
def leases() -> None:
    """celery-leases jobs of the -A app: celery -A proj leases COMMAND."""


def _app() -> Any:
    """The -A app; without -A (or APP / CELERY_APP) celery hands plugins an empty default app."""
    ctx = click.get_current_context()
    root = ctx.find_root()
    if root.params.get("app") is None:
        _fail(
            ctx,
            f"celery leases needs your Celery app: celery -A proj leases {ctx.info_name} "
            f"(without -A celery uses an empty default app)",
            code=2,
        )
    return root.obj.app


def _settings() -> Settings:
    return settings_for(_app())


def _store() -> Store:
    return store_for(_settings())


# -- resolving ids -------------------------------------------------------------------------------


def find_job(store: Store, text: str) -> Job:
    """The job with id ``text``, or the only job whose id starts with it."""
    job = store.get(text)
    if job is not None:
        return job
    if len(text) >= MIN_PREFIX:
        ids = store.ids_starting_with(text, limit=5)
        if len(ids) == 1:
            job = store.get(ids[0])
            if job is not None:
                return job
        elif ids:
            shown = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
            raise LeaseError(f"job id prefix {text!r} is ambiguous ({shown}): give more of it")
    raise JobNotFound(f"no job {text!r} in table {store.table.name} of {store.safe_url}")


# -- commands ------------------------------------------------------------------------------------


@leases.command("list")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(STATES),
    help="Only jobs in this state (repeatable).",
)
@click.option("--task", metavar="NAME", help="Only jobs of this task name.")
@click.option(
    "--limit", default=50, show_default=True, type=click.IntRange(min=1), help="At most N jobs."
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array (all fields).")
def list_jobs(states: tuple[str, ...], task: str | None, limit: int, as_json: bool) -> None:
    """List jobs, newest first, with lease, checkpoint age and progress.

    LEASE is the time left on a running job's lease, CKPT the age of its last checkpoint,
    TRY its attempts; IDs are short prefixes, accepted by the other commands.
    """
    settings = _settings()
    store = store_for(settings)
    facts = JobFacts(_app(), settings)
    jobs = store.list_jobs(states=states, task=task, limit=limit)
    if as_json:
        click.echo(json.dumps([facts.as_dict(job) for job in jobs], indent=2))
        return
    out = Output()
    counts = store.count_by_state()
    total = sum(counts.values())
    if jobs:
        for text in job_table(out, facts, jobs, JOB_COLUMNS, min_bar=8, max_bar=20):
            click.echo(text)
    stalled = sum(1 for job in jobs if job.state == RUNNING and facts.stalled(job))
    dot = " · " if out.unicode else ", "
    summary = dot.join([f"showing {len(jobs)} of {total} jobs", *counts_text(counts, stalled)])
    click.echo(summary if total else "no jobs yet")
    for note in stall_note(facts, jobs):
        click.echo(note)


@leases.command()
@click.argument("job_id", metavar="ID", type=JobId())
@click.option("--json", "as_json", is_flag=True, help="Print the job as JSON.")
def show(job_id: str, as_json: bool) -> None:
    """One job in full, with its checkpoint. ID may be a unique prefix."""
    settings = _settings()
    job = find_job(store_for(settings), job_id)
    facts = JobFacts(_app(), settings)
    if as_json:
        click.echo(json.dumps(facts.as_dict(job), indent=2))
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
        ("task", job.task),
        ("key", job.lease_key),
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
        app = click.get_current_context().find_root().params.get("app")
        again = "to resume it" if job.checkpoint is not None else "to run it again"
        click.echo(f"{again}: celery -A {app} leases retry {job.id}")


def _compact(value: Any) -> str:
    text = str(kombu_json.dumps(value, ensure_ascii=False))
    return text if len(text) <= 200 else text[:197] + "..."


@leases.command()
@click.argument("job_id", metavar="ID", type=JobId())
def retry(job_id: str) -> None:
    """Re-publish a failed or cancelled job from its checkpoint."""
    store = _store()
    click.echo(control.retry(_app(), store, find_job(store, job_id).id))


@leases.command()
@click.argument("job_id", metavar="ID", type=JobId())
def cancel(job_id: str) -> None:
    """Cancel a job (a running one stops at its next checkpoint)."""
    store = _store()
    click.echo(control.cancel(_app(), store, find_job(store, job_id).id))


@leases.command()
@click.argument("job_id", metavar="ID", type=JobId())
def release(job_id: str) -> None:
    """Expire a running job's lease now (its host is dead).

    The next reaper pass (or ``leases reap``) re-publishes the job to resume elsewhere.
    """
    store = _store()
    click.echo(control.release(store, find_job(store, job_id).id))


@leases.command()
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
    store = _store()
    if value is None and not clear:
        current = store.cursor(key)
        click.echo("none" if current is None else json.dumps(current, ensure_ascii=False))
        return
    text = None if clear else _json_text(value)
    if not store.set_cursor(key, text):
        raise InvalidJobState(
            f"lease key {key!r} is held by a job (queued, running, or with a follow-up to "
            f"start); its cursor is left as it is: cancel the job or let it end, then try again"
        )
    click.echo(f"cursor of {key!r} {'cleared' if clear else 'set to ' + str(text)}")


def _json_text(value: Any) -> str:
    """``value`` as the store's JSON text, or a BadParameter saying why it is not JSON."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    try:
        return dumps(json.loads(str(value), parse_constant=refuse))
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise click.BadParameter(f"--set {_short_repr(value)} is not JSON ({why})") from None


@leases.command()
@click.option("--json", "as_json", is_flag=True, help="Print what it did as JSON.")
@click.pass_context
def reap(ctx: click.Context, as_json: bool) -> None:
    """Run one reaper pass and print what it did.

    It re-publishes jobs whose lease expired, gives up on poison jobs, and purges finished jobs
    older than leases_retention.
    """
    settings = _settings()
    report = reap_pass(_app())
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


@leases.command("init-db")
def init_db() -> None:
    """Create the jobs table and its migration history, and say where (a table that exists
    is brought up to date)."""
    click.echo(upgrade(_store()).describe())


@leases.command("upgrade")
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
    click.echo(upgrade(_store(), revision=revision).describe())


@leases.command()
@click.option(
    "--older-than",
    "older_than",
    required=True,
    type=Duration(),
    help="Age since the job finished: 30s, 15m, 12h, 7d.",
)
def purge(older_than: float) -> None:
    """Delete jobs that finished longer ago than --older-than."""
    settings = _settings()
    store = store_for(settings)
    purged = store.purge_all(older_than=older_than, batch=settings.reap_batch)
    noun = "job" if purged == 1 else "jobs"
    click.echo(f"purged {purged} finished {noun} older than {span(older_than)}")


@leases.command()
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
@click.pass_context
def watch(ctx: click.Context, interval: float, once: bool, limit: int) -> None:
    """Running jobs with progress bars, refreshed until Ctrl-C.

    On a terminal the screen is redrawn; otherwise (ssh pipes, CI logs) a block is printed per
    refresh.
    """
    settings = _settings()
    store = store_for(settings)
    facts = JobFacts(_app(), settings)
    out = Output()
    try:
        while True:
            try:
                lines = watch_frame(out, store, facts, limit=limit, interval=interval)
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
    out: Output, store: Store, facts: JobFacts, *, limit: int, interval: float
) -> list[str]:
    """One refresh of ``watch``: a summary line and the running jobs."""
    jobs = store.list_jobs(states=[RUNNING], limit=limit)
    counts = store.count_by_state()
    stalled = sum(1 for job in jobs if facts.stalled(job))
    stamp = time.strftime("%H:%M:%S")
    title = f"celery leases watch: {store.table.name} at {stamp}, every {interval:g}s"
    lines = [
        out.style(title, "header") + " (Ctrl-C stops)",
        ", ".join(counts_text(counts, stalled)) if counts else "no jobs",
        "",
    ]
    hidden = 0
    if out.tty:
        room = max(out.height - 6, 1)
        hidden = max(len(jobs) - room, 0)
        jobs = jobs[:room]
    if not jobs:
        return [*lines, "no running jobs"]
    columns = [c for c in JOB_COLUMNS if c.header != "TOKEN"]
    lines += job_table(out, facts, jobs, columns, min_bar=10, max_bar=30)
    if hidden:
        lines.append(f"... and {hidden} more running (not shown: the terminal is full)")
    lines += stall_note(facts, jobs)
    return lines


__all__ = ["leases"]
