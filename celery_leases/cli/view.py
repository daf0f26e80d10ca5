"""How the ``celery leases`` commands show jobs: tables, progress bars, relative times.

Plain text that reads in a 100-column terminal and in CI logs; colours only on a terminal.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import click

from ..db import rows
from ..db.rows import Job, StateCounts
from ..db.schema import MAX_ID_LENGTH, RUNNING, STATES, WAITING
from ..settings import Settings

STYLES: dict[str, dict[str, Any]] = {
    "queued": {"fg": "cyan"},
    "waiting": {"fg": "cyan", "dim": True},
    "running": {"fg": "bright_blue", "bold": True},
    "stalled": {"fg": "yellow", "bold": True},
    "done": {"fg": "green"},
    "failed": {"fg": "red", "bold": True},
    "cancelled": {"fg": "magenta"},
    "superseded": {"fg": "magenta", "dim": True},
    "expired": {"fg": "red"},
    "dim": {"dim": True},
    "bar": {"fg": "green"},
    "header": {"bold": True},
}


# -- output --------------------------------------------------------------------------------------


class Output:
    """How to write to stdout: colours, Unicode bars and the width to fit."""

    def __init__(self) -> None:
        ctx = click.get_current_context()
        stream = sys.stdout
        self.tty = stream.isatty()
        self.colour = self.tty and not ctx.find_root().obj.no_color
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "█░…".encode(encoding)
            self.unicode = True
        except (UnicodeEncodeError, LookupError):
            self.unicode = False

    @property
    def width(self) -> int:
        return shutil.get_terminal_size((100, 30)).columns

    @property
    def height(self) -> int:
        return shutil.get_terminal_size((100, 30)).lines

    def style(self, text: str, name: str | None) -> str:
        if not self.colour or name is None or not text:
            return text
        return click.style(text, **STYLES[name])

    def bar(self, done: int | None, total: int | None, width: int) -> tuple[str, str]:
        """(plain, styled) progress text: a bar and a percentage, a count, or ``-``."""
        if done is None:
            return "-", self.style("-", "dim")
        if not total:
            text = f"{done:,} done"
            return text, text
        done = min(max(done, 0), total)
        filled = done * width // total
        full, empty = ("█", "░") if self.unicode else ("#", "-")
        percent = f"{done * 100 // total:3d}%"
        plain = full * filled + empty * (width - filled) + " " + percent
        styled = (
            self.style(full * filled, "bar")
            + self.style(empty * (width - filled), "dim")
            + " "
            + percent
        )
        return plain, styled

    def clip(self, text: str, width: int, where: str) -> str:
        if len(text) <= width:
            return text
        dots = "…" if self.unicode else "~"
        keep = width - 1
        if where == "start":
            return dots + text[len(text) - keep :]
        if where == "middle":
            head = keep - keep // 2
            return text[:head] + dots + text[len(text) - keep // 2 :]
        return text[:keep] + dots


@dataclasses.dataclass
class Column:
    header: str
    right: bool = False
    #: Where a too-long value is cut (``start``, ``middle``, ``end``); None never shrinks.
    clip: str | None = None
    minimum: int = 8


Cell = tuple[str, str]  # (plain text, text with colours)


def table(out: Output, columns: Sequence[Column], rows: Sequence[Mapping[str, Cell]]) -> list[str]:
    """Lines of an aligned table fitting ``out.width``; clippable columns shrink first."""
    cells = [[row[c.header] for c in columns] for row in rows]
    widths = [max([len(c.header), *(len(r[i][0]) for r in cells)]) for i, c in enumerate(columns)]
    excess = sum(widths) + 2 * (len(columns) - 1) - out.width
    while excess > 0:
        shrinkable = [i for i, c in enumerate(columns) if c.clip and widths[i] > c.minimum]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1

    def line(cells: Sequence[Cell]) -> str:
        parts = []
        for i, (column, (plain, styled)) in enumerate(zip(columns, cells, strict=True)):
            if len(plain) > widths[i]:
                clipped = out.clip(plain, widths[i], column.clip or "end")
                styled = styled.replace(plain, clipped) if out.colour else clipped
                plain = clipped
            pad = " " * (widths[i] - len(plain))
            last = i == len(columns) - 1
            parts.append(pad + styled if column.right else styled + ("" if last else pad))
        return "  ".join(parts).rstrip()

    header = [(c.header, out.style(c.header, "header")) for c in columns]
    return [line(header), *(line(row) for row in cells)]


def span(seconds: float) -> str:
    """A compact duration: ``4.2s``, ``37s``, ``4m05s``, ``3h07m``, ``2d04h``, ``7d``."""
    seconds = abs(seconds)
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    s = round(seconds)
    for big, small, size, unit in (
        (86400, 3600, "d", "h"),
        (3600, 60, "h", "m"),
        (60, 1, "m", "s"),
    ):
        if s >= big:
            whole, rest = divmod(s, big)
            part = rest // small
            return f"{whole}{size}{part:02d}{unit}" if part else f"{whole}{size}"
    return f"{s}s"


# -- jobs as text --------------------------------------------------------------------------------


class JobFacts:
    """The facts about jobs the commands show, derived from database-clock values."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self._stall: dict[str, float | None] = {}

    def stall_timeout(self, task_name: str) -> float | None:
        """The task's ``lease_stall_timeout``, else ``leases_stall_timeout`` (seconds)."""
        if task_name not in self._stall:
            own = getattr(self.app.tasks.get(task_name), "lease_stall_timeout", None)
            self._stall[task_name] = own if own is not None else self.settings.stall_timeout
        return self._stall[task_name]

    @staticmethod
    def since(job: Job, moment: float | None) -> float | None:
        """Seconds from a recorded moment to now, both by the database clock."""
        return None if moment is None else job.created_at + job.age - moment

    def quiet_for(self, job: Job) -> float | None:
        """Seconds this attempt has run without a checkpoint (running jobs only)."""
        if job.state != RUNNING:
            return None
        moments = [m for m in (job.claimed_at, job.checkpoint_at) if m is not None]
        return self.since(job, max(moments)) if moments else None

    def stalled(self, job: Job) -> bool:
        limit = self.stall_timeout(job.task)
        quiet = self.quiet_for(job)
        return limit is not None and quiet is not None and quiet > limit

    def shown_state(self, job: Job) -> str:
        if job.waiting:
            return WAITING
        return "stalled" if self.stalled(job) else job.state

    def as_dict(self, job: Job) -> dict[str, Any]:
        """The job as JSON-ready values; its message in Celery's JSON form."""
        found = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
        found["message"] = json.loads(job.message.dumps())
        found["result"] = json.loads(rows.dumps_result(job.result) or "null")
        return {**found, "stalled": self.stalled(job)}


def short_ids(jobs: Sequence[Job]) -> dict[str, str]:
    """The shortest prefixes (8 characters or more) that tell the shown jobs apart."""
    ids = {job.id for job in jobs}
    length = 8
    while length < MAX_ID_LENGTH and len({i[:length] for i in ids}) < len(ids):
        length += 2
    return {i: i[:length] for i in ids}


JOB_COLUMNS = [
    Column("ID", clip="end"),
    Column("STATE"),
    Column("TASK", clip="start", minimum=12),
    Column("OWNER", clip="middle", minimum=10),
    Column("TRY", right=True),
    Column("LEASE", right=True),
    Column("CKPT", right=True),
    Column("PROGRESS"),
]


def job_columns(routed: bool) -> list[Column]:
    """The columns of a table of jobs: with a DATABASE column when ``routed``."""
    if not routed:
        return JOB_COLUMNS
    return [JOB_COLUMNS[0], Column("DATABASE", clip="end"), *JOB_COLUMNS[1:]]


def job_rows(
    out: Output,
    facts: JobFacts,
    jobs: Sequence[Job],
    bar_width: int,
    databases: Sequence[str] | None = None,
) -> list[dict[str, Cell]]:
    """A table row of each job; ``databases``: the database of each (its DATABASE cell)."""
    ids = short_ids(jobs)
    rows = []
    for job, database in zip(jobs, databases or [""] * len(jobs), strict=True):
        state = facts.shown_state(job)
        if job.state == RUNNING and job.expires_in is not None:
            lease = span(job.expires_in) if job.expires_in > 0 else "expired"
            lease_cell = (lease, out.style(lease, "expired" if lease == "expired" else None))
        else:
            lease_cell = ("-", out.style("-", "dim"))
        ckpt = "-" if job.checkpoint_age is None else span(job.checkpoint_age)
        ckpt_dim = "dim" if ckpt == "-" else None
        # "celery@" is the default node name prefix: it tells nothing and costs a column.
        owner = (job.owner or "-").removeprefix("celery@")
        rows.append(
            {
                "ID": (ids[job.id], ids[job.id]),
                "STATE": (state, out.style(state, state)),
                "TASK": (job.task, job.task),
                "OWNER": (owner, out.style(owner, None if job.owner else "dim")),
                "TRY": (str(job.attempts), str(job.attempts)),
                "LEASE": lease_cell,
                "CKPT": (ckpt, out.style(ckpt, "stalled" if state == "stalled" else ckpt_dim)),
                "PROGRESS": out.bar(job.progress_done, job.progress_total, bar_width),
                "DATABASE": (database, database),
            }
        )
    return rows


def job_table(
    out: Output,
    facts: JobFacts,
    jobs: Sequence[Job],
    columns: Sequence[Column],
    *,
    min_bar: int,
    max_bar: int,
    databases: Sequence[str] | None = None,
) -> list[str]:
    """The jobs as table lines; progress bars grow from ``min_bar`` to ``max_bar`` characters
    into spare width. ``databases``: the database of each job (``job_columns(True)``)."""
    rows = job_rows(out, facts, jobs, min_bar, databases)
    widths = [max([len(c.header), *(len(row[c.header][0]) for row in rows)]) for c in columns]
    spare = out.width - sum(widths) - 2 * (len(columns) - 1)
    if spare > 0 and max_bar > min_bar:
        rows = job_rows(out, facts, jobs, min_bar + min(spare, max_bar - min_bar), databases)
    return table(out, columns, rows)


#: Each finished state is counted up to this many jobs by ``list`` and ``watch`` (shown as
#: ``10,000+ done``): a count reads at most this many index entries, whatever the table holds.
COUNT_CAP = 10_000


def counts_text(counts: StateCounts, stalled: int) -> list[str]:
    """``["1 queued", "4 running (1 stalled)", "10,000+ done", ...]``; running always, other
    states if any; a capped count ends in ``+``."""
    parts = []
    for state in STATES:
        n = counts.counts.get(state, 0)
        if n or state == RUNNING:
            extra = f" ({stalled} stalled)" if state == RUNNING and stalled else ""
            parts.append(f"{jobs_count(n, state in counts.capped)} {state}{extra}")
    return parts


def jobs_count(n: int, capped: bool) -> str:
    """``n`` as ``list`` shows it: ``10,000+`` when at least that many."""
    return f"{n:,}+" if capped else f"{n:,}"


def stall_note(facts: JobFacts, jobs: Sequence[Job]) -> list[str]:
    stalled = [job for job in jobs if facts.stalled(job)]
    if not stalled:
        return []
    limits = sorted({span(facts.stall_timeout(job.task) or 0) for job in stalled})
    return [
        f"stalled: no checkpoint for over {' / '.join(limits)} (leases_stall_timeout); "
        f"its lease is no longer renewed"
    ]


def warning_lines(text: str) -> str:
    """``warning: text``, wrapped to the width of the rest of the output."""
    return textwrap.fill(f"warning: {text}", width=100, subsequent_indent="  ")
