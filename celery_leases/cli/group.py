"""The ``celery leases`` group: its parameters (durations, job ids, lease keys), the -A app,
and how an error becomes one line and an exit code."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import click

from .. import routes
from ..config import settings_for
from ..db import Store, store_for
from ..db.identity import checked_key
from ..db.rows import Job
from ..db.schema import MAX_ID_LENGTH, MAX_KEY_LENGTH
from ..errors import ArgumentsError, JobNotFound, LeaseError
from ..settings import Settings

MIN_PREFIX = 4

F = TypeVar("F", bound=Callable[..., Any])


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
            self.fail(f"{short_repr(value)} is not a duration (use 30s, 15m, 12h, 7d)", param, ctx)
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
                f"{short_repr(value)} is not a job id (1 to {MAX_ID_LENGTH} printable "
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
                f"{short_repr(value)} is not a lease key (1 to {MAX_KEY_LENGTH} characters)",
                param,
                ctx,
            )


def short_repr(value: Any) -> str:
    text = repr(str(value))
    return text if len(text) <= 60 else text[:56] + "...'"


# -- the group -----------------------------------------------------------------------------------


class LeasesGroup(click.Group):
    """Turns every LeaseError and bad parameter into one line on stderr and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.BadParameter as exc:
            fail(ctx, exc.format_message(), code=2)
        except LeaseError as exc:
            fail(ctx, str(exc), code=1)


def fail(ctx: click.Context, message: str, *, code: int) -> NoReturn:
    click.echo(f"Error: {' '.join(message.split())}", err=True)
    ctx.exit(code)


@click.group(cls=LeasesGroup)
def leases() -> None:
    """celery-leases jobs of the -A app: celery -A proj leases COMMAND."""


@dataclass(frozen=True)
class Host:
    """The group run by another command line than ``celery`` (``manage.py leases``): the
    root context's ``obj``, in place of Celery's."""

    #: The Celery app the commands act for.
    app: Any
    #: How a user runs the group, for the hints commands print (``python manage.py leases``).
    command: str
    no_color: bool = False


def cli_command() -> str:
    """How the user runs this group, for hints: ``celery -A proj leases``, or the host's."""
    root = click.get_current_context().find_root()
    if isinstance(root.obj, Host):
        return root.obj.command
    return f"celery -A {root.params.get('app')} leases"


def cli_app() -> Any:
    """The -A app; without -A (or APP / CELERY_APP) celery hands plugins an empty default app."""
    ctx = click.get_current_context()
    root = ctx.find_root()
    if isinstance(root.obj, Host):
        return root.obj.app
    if root.params.get("app") is None:
        fail(
            ctx,
            f"celery leases needs your Celery app: celery -A proj leases {ctx.info_name} "
            f"(without -A celery uses an empty default app)",
            code=2,
        )
    return root.obj.app


def cli_settings() -> Settings:
    return settings_for(cli_app())


# -- databases -----------------------------------------------------------------------------------


def database_option(command: F) -> F:
    """The ``--database NAME`` option of a command that otherwise covers every database."""
    return click.option(
        "--database",
        metavar="NAME",
        help="Only this leases database ('default', or a name of leases_databases); "
        "default: every one.",
    )(command)


def cli_stores(database: str | None) -> list[tuple[str, Store]]:
    """The name and store of every leases database (``'default'`` first), or of ``database``
    alone: a name the app does not know is a :class:`click.BadParameter` naming those it
    knows."""
    settings = cli_settings()
    if database is None:
        return routes.stores(settings)
    known = routes.names(settings)
    if database not in known:
        raise click.BadParameter(
            f"{database!r} is not a leases database of this app (it has {', '.join(known)})",
            param_hint="'--database'",
        )
    return [(database, store_for(routes.on(settings, database)))]


def cli_routed() -> bool:
    """Whether the app has more than one leases database (or routes): the commands then name
    the database of what they show."""
    return routes.routed(cli_settings())


# -- resolving ids -------------------------------------------------------------------------------


def find_job(stores: Sequence[tuple[str, Store]], text: str) -> tuple[str, Store, Job]:
    """The job with id ``text``, or the only job whose id starts with it, in any of ``stores``
    (the whole id first, in every database), with its database's name and store. A database
    that does not answer is passed over when another holds the job; its error is raised when
    none does."""
    errors: list[LeaseError] = []
    answering = list(stores)
    for name, store in list(answering):
        try:
            job = store.get(text)
        except LeaseError as exc:
            errors.append(exc)
            answering.remove((name, store))
            continue
        if job is not None:
            return name, store, job
    if len(text) >= MIN_PREFIX:
        found: list[tuple[str, Store, str]] = []
        for name, store in answering:
            try:
                found += [(name, store, i) for i in store.ids_starting_with(text, limit=5)]
            except LeaseError as exc:
                errors.append(exc)
        if len(found) == 1:
            name, store, job_id = found[0]
            job = store.get(job_id)
            if job is not None:
                return name, store, job
        elif found:
            ids = [job_id for _, _, job_id in found]
            shown = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
            raise LeaseError(f"job id prefix {text!r} is ambiguous ({shown}): give more of it")
    if errors:
        raise errors[0]
    where = ", ".join(store.safe_url for _, store in stores)
    raise JobNotFound(f"no job {text!r} in table {stores[0][1].table.name} of {where}")


# -- commands ------------------------------------------------------------------------------------

__all__ = [
    "MIN_PREFIX",
    "Duration",
    "Host",
    "JobId",
    "LeaseKey",
    "cli_app",
    "cli_command",
    "cli_routed",
    "cli_settings",
    "cli_stores",
    "database_option",
    "fail",
    "find_job",
    "leases",
    "short_repr",
]
