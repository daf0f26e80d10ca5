"""The check at worker and beat start: where the leases live, and the defaults that bite.

When a worker of an app that uses celery-leases starts, its main process validates the
settings (``worker_init``: a bad one stops it before it consumes anything, since a worker that
cannot read its settings would fail every leased task it receives); once it is ready
(``worker_ready``, when its logging is set up), it runs one cheap statement on the leases
database and logs where the leases live: the URL without password and the table (for SQLite,
the file's absolute path). Beat does both at ``beat_init``.

It warns when the default SQLite file (``celery_leases.sqlite3`` in the working directory)
meets a network broker, whose other workers or hosts cannot see that file, and when running
jobs in an SQLite file are held by workers on other hosts (a file shared over a network
filesystem, where SQLite's locking does not hold).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any
from urllib.parse import urlsplit

from celery import current_app
from celery.signals import beat_init, worker_init, worker_ready
from sqlalchemy.engine import make_url

from .. import routes
from ..config import settings_for, uses_leases
from ..db.dialects import dialect_for
from ..db.schema import RUNNING
from ..errors import ConfigurationError, LeaseError
from ..process import owner_host
from ..settings import DEFAULTS, Settings, redact

logger = logging.getLogger("celery_leases")

#: Broker URL schemes of brokers on the network (a worker on another host may use them).
NETWORK_BROKERS = (
    "amqp", "amqps", "pyamqp", "librabbitmq", "redis", "rediss", "sentinel", "sqs",
    "azurestoragequeues", "azureservicebus", "gcpubsub", "confluentkafka", "mongodb",
    "zookeeper", "consul", "etcd", "qpid",
)  # fmt: skip

#: Running jobs read to see which hosts meet an SQLite file.
OWNERS_SAMPLE = 100


def validate_at_worker_start(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None) or current_app
    if uses_leases(app):
        who = f"worker {getattr(sender, 'hostname', None) or socket.gethostname()}"
        settings = validated(app, who=who)
        try:
            # Before the pool forks: its processes share the driver and the statements.
            for _name, store in routes.stores(settings):
                store.warm()
        except ConfigurationError as exc:  # no driver for the URL, say
            logger.critical("celery-leases: %s does not start: %s", who, exc)
            raise SystemExit(f"celery-leases: {who} does not start: {exc}") from exc


def check_when_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None) or current_app
    if uses_leases(app):
        check(app, who=f"worker {getattr(sender, 'hostname', None) or socket.gethostname()}")


def check_at_beat_start(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None) or current_app
    if uses_leases(app):
        check(app, who="beat")


def check(app: Any, *, who: str) -> list[str]:
    """Validate ``app``'s settings, reach its leases database once, and log where the leases
    live and any warning; the warnings given. A bad setting is logged and stops the process
    (``SystemExit``)."""
    settings = validated(app, who=who)
    warnings = []
    for name, store in routes.stores(settings):
        place = where(store.settings)
        if routes.routed(settings):
            place = f"database {name!r}: {place}"
        try:
            warnings += _check(app, store.settings, store, place, who=who)
        finally:
            # A worker's main process (and beat) rarely needs the database after this: no
            # idle connection of its own is kept open for it (one per worker adds up).
            store.engine.dispose()
    return warnings


def _check(app: Any, settings: Settings, store: Any, place: str, *, who: str) -> list[str]:
    try:
        store.ping()
    except LeaseError as exc:
        logger.warning(
            "celery-leases: %s: the leases database is unreachable at start (%s); leased jobs "
            "are delivered again until it answers",
            who,
            exc,
        )
        return [str(exc)]
    logger.info("celery-leases: %s: leases live in %s", who, place)
    warnings = []
    try:
        store.check_schema()
    except ConfigurationError as exc:  # every leased job fails with it until it is done
        logger.error("celery-leases: %s: %s", who, exc)
        warnings.append(str(exc))
    warnings += default_file_warnings(app, settings)
    if store.dialect.file_based:
        warnings += shared_file_warnings(store, place)
    for warning in warnings:
        logger.warning("celery-leases: %s: %s", who, warning)
    return warnings


def validated(app: Any, *, who: str) -> Settings:
    """``app``'s settings; a bad one is logged and stops the process (``SystemExit``, whose
    message reaches stderr before logging is set up)."""
    try:
        settings = settings_for(app)
        if routes.routed(settings):
            split = routes.split_keys(app)
            if split:
                raise ConfigurationError("; ".join(split))
        return settings
    except ConfigurationError as exc:
        logger.critical("celery-leases: %s does not start: %s", who, exc)
        raise SystemExit(f"celery-leases: {who} does not start: {exc}") from exc


def where(settings: Settings) -> str:
    """The leases' place, for people: the URL without password (an SQLite file's absolute
    path) and the table."""
    url = make_url(settings.database_url)
    if dialect_for(url.get_backend_name()).file_based and url.database not in (
        None,
        "",
        ":memory:",
    ):
        shown = f"the SQLite file {os.path.abspath(url.database)}"  # type: ignore[type-var]
    else:
        shown = redact(settings.database_url)
    return f"{shown}, table {settings.table}"


def default_file_warnings(app: Any, settings: Settings) -> list[str]:
    """A warning when the default SQLite file meets a broker on the network."""
    if settings.database_url != DEFAULTS["database_url"]:
        return []
    broker = str(app.conf.broker_url or "amqp://")
    scheme = urlsplit(broker).scheme.lower()
    network = scheme in NETWORK_BROKERS or (scheme.startswith("sqla+") and "sqlite" not in scheme)
    if not network:
        return []
    return [
        f"leases_database_url is not set, so the leases live in the default SQLite file "
        f"{os.path.abspath('celery_leases.sqlite3')}, in this process's working directory, "
        f"while the broker ({scheme}://) is on the network: workers and beat in other "
        f"directories or on other hosts do not see these leases, and their jobs are never "
        f"resumed; set leases_database_url to a database every worker and beat reach"
    ]


def shared_file_warnings(store: Any, place: str) -> list[str]:
    """A warning when running jobs in this SQLite file are held by workers on other hosts."""
    try:
        running = store.list_jobs(states=[RUNNING], limit=OWNERS_SAMPLE)
    except LeaseError:
        return []
    here = _short(socket.gethostname())
    others = sorted(
        {
            _short(host)
            for host in (owner_host(job.owner) for job in running)
            if host and _short(host) != here
        }
    )
    if not others:
        return []
    return [
        f"{place} is used by workers on other hosts too ({', '.join(others)}): SQLite's "
        f"locking does not hold over a network filesystem, so leases there are not safe; "
        f"use PostgreSQL or MariaDB when several hosts run workers"
    ]


def _short(host: str) -> str:
    return host.split(".", 1)[0].lower()


#: Each signal and the receiver ``worker.connect`` connects to it.
RECEIVERS = (
    (worker_init, validate_at_worker_start),
    (worker_ready, check_when_worker_ready),
    (beat_init, check_at_beat_start),
)

__all__ = ["RECEIVERS", "check", "validated", "where"]
