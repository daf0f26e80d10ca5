"""The real services the tests run against, and how a test asks for one.

``require("postgres")`` returns the service's URL, or skips the test when the service does not
answer (fails it instead when ``CI=true``). Each URL can be overridden with an environment
variable: ``LEASES_TEST_POSTGRES_URL``, ``LEASES_TEST_PGBOUNCER_URL`` (PgBouncer in transaction
mode, started by ``scripts/services.sh``), ``LEASES_TEST_MARIADB_URL``,
``LEASES_TEST_REDIS_URL``, ``LEASES_TEST_RABBITMQ_URL``.

Celery settings travel to worker subprocesses as JSON in ``TEST_CELERY_CONFIG`` (plus the broker
URL alone in ``TEST_BROKER_URL``): build the environment with :func:`celery_env` in the test and
read it back in the app module with ``tests.support.apps.factory.make_app(...,
variables="celery_env")``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import pytest

if TYPE_CHECKING:
    from celery import Celery

POSTGRES_URL = os.environ.get(
    "LEASES_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
#: PgBouncer in transaction mode in front of POSTGRES_URL's database (scripts/services.sh).
PGBOUNCER_URL = os.environ.get(
    "LEASES_TEST_PGBOUNCER_URL", "postgresql+psycopg://postgres@127.0.0.1:6439/test"
)
MARIADB_URL = os.environ.get("LEASES_TEST_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("LEASES_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("LEASES_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")

URLS = {
    "postgres": POSTGRES_URL,
    "pgbouncer": PGBOUNCER_URL,
    "mariadb": MARIADB_URL,
    "redis": REDIS_URL,
    "rabbitmq": RABBITMQ_URL,
}

#: Seconds a reachability check may take before the service counts as unreachable.
CONNECT_TIMEOUT = 3

# service -> None (answers) or the error text; one check per service per test session.
_checked: dict[str, str | None] = {}


def in_ci() -> bool:
    """True when ``CI=true``: an unreachable service then fails a test instead of skipping it."""
    return os.environ.get("CI", "").lower() == "true"


def require(service: str) -> str:
    """Return the URL of ``service`` ("postgres", "mariadb", "redis", "rabbitmq").

    Skips the calling test when the service does not answer, or fails it when ``CI=true``.
    """
    url = URLS[service]
    if service not in _checked:
        try:
            _CHECKS[service](url)
        except Exception as exc:
            _checked[service] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        else:
            _checked[service] = None
    error = _checked[service]
    if error is not None:
        message = f"{service} unreachable at {url}: {error}"
        if in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return url


def _check_database(url: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT})
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    finally:
        engine.dispose()


def _check_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT
    )
    try:
        client.ping()
    finally:
        client.close()


def _check_rabbitmq(url: str) -> None:
    import kombu

    with kombu.Connection(url, connect_timeout=CONNECT_TIMEOUT) as connection:
        connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0)


_CHECKS = {
    "postgres": _check_database,
    "pgbouncer": _check_database,
    "mariadb": _check_database,
    "redis": _check_redis,
    "rabbitmq": _check_rabbitmq,
}


# Seconds a teardown DROP TABLE waits for locks. A lock still held then means the test leaked
# an open transaction (an engine it did not dispose of, a worker still alive).
DROP_LOCK_TIMEOUT = 10


def drop_tables(url: str, name: str) -> None:
    """Drop the table ``name`` and every table, view and function whose name starts with
    ``name`` plus ``_`` (its version table, PostgreSQL's view, a unit log), failing the test
    when a lock holds them longer than ``DROP_LOCK_TIMEOUT`` seconds."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            if engine.dialect.name == "postgresql":
                connection.execute(sa.text(f"SET lock_timeout = '{DROP_LOCK_TIMEOUT}s'"))
            elif engine.dialect.name in ("mysql", "mariadb"):
                connection.execute(sa.text(f"SET SESSION lock_wait_timeout = {DROP_LOCK_TIMEOUT}"))
            inspector = sa.inspect(connection)
            ours = [n for n in inspector.get_view_names() if n == name or n.startswith(f"{name}_")]
            for view in ours:  # PostgreSQL's <table>_view
                connection.execute(sa.text(f"DROP VIEW IF EXISTS {view}"))
            if engine.dialect.name == "postgresql":
                connection.execute(sa.text(f"DROP FUNCTION IF EXISTS {name}_jsonb(text)"))
            tables = [
                table
                for table in inspector.get_table_names()
                if table == name or table.startswith(f"{name}_")
            ]
            for table in tables:
                sa.Table(table, sa.MetaData()).drop(connection, checkfirst=True)
    except sa.exc.OperationalError as exc:
        pytest.fail(
            f"could not drop {name} on {engine.dialect.name} within {DROP_LOCK_TIMEOUT} s; did "
            f"the test leave a transaction open (an engine not disposed of)? {exc}",
            pytrace=False,
        )
    finally:
        engine.dispose()


def sqlite_result_backend(path: str | os.PathLike[str]) -> str:
    """A ``db+sqlite://`` result backend URL for the file ``path``, created in WAL mode (kept
    by the file): readers never wait for a writer, so a worker frozen in the middle of
    storing a result blocks only the other writers, which wait (``database_engine_options``
    of the test apps) instead of failing with "database is locked"."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(path)) as connection:
        connection.execute("PRAGMA journal_mode=WAL")
    return f"db+sqlite:///{path}"


def celery_env(settings: dict[str, Any]) -> dict[str, str]:
    """Environment variables that carry Celery ``settings`` to a worker or beat subprocess."""
    env = {"TEST_CELERY_CONFIG": json.dumps(settings)}
    if "broker_url" in settings:
        env["TEST_BROKER_URL"] = settings["broker_url"]
    return env


#: How long (seconds) a claim on a Redis database lasts if its test run dies without releasing it.
REDIS_CLAIM_TTL = 3600
#: Seconds to wait for a Redis database to be released when every one is claimed.
REDIS_CLAIM_WAIT = 240
_REDIS_CLAIM_KEY = "celery-leases-tests:claimed-db:{}"


def _claim_redis_db(client: Any, token: str, numbers: list[int]) -> int | None:
    for db in numbers:
        if client.set(_REDIS_CLAIM_KEY.format(db), token, nx=True, ex=REDIS_CLAIM_TTL):
            return int(db)
    return None


@contextlib.contextmanager
def private_redis_url() -> Iterator[str]:
    """Yield a Redis URL whose database number no other test (or test run) is using.

    Databases 1..N-1 of the server in ``REDIS_URL`` are claimed with a key in ``REDIS_URL``'s
    own database, so two tests (of parallel workers, or of other test runs on the machine)
    never share one; when every database is claimed, this waits for one to be released (up to
    ``REDIS_CLAIM_WAIT`` seconds). The database is flushed
    when claimed and when released. Redis pub/sub is server-wide, but kombu prefixes its fanout
    channels with the database number, so remote control stays private too.
    """
    import redis

    base = require("redis")
    client = redis.Redis.from_url(base, socket_timeout=CONNECT_TIMEOUT)
    token = uuid.uuid4().hex
    try:
        try:
            count = int(str(client.config_get("databases")["databases"]))
        except redis.RedisError:
            count = 16
        base_db = client.connection_pool.connection_kwargs.get("db", 0)
        deadline = time.monotonic() + REDIS_CLAIM_WAIT
        while True:
            db = _claim_redis_db(client, token, [n for n in range(count) if n != base_db])
            if db is not None:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"all {count - 1} Redis databases at {base} stayed claimed by tests for "
                    f"{REDIS_CLAIM_WAIT} s"
                )
            time.sleep(0.2)
        url = urlunsplit(urlsplit(base)._replace(path=f"/{db}"))
        private = redis.Redis.from_url(url, socket_timeout=CONNECT_TIMEOUT)
        try:
            private.flushdb()
            yield url
        finally:
            private.flushdb()
            private.close()
            if client.get(_REDIS_CLAIM_KEY.format(db)) == token.encode():
                client.delete(_REDIS_CLAIM_KEY.format(db))
    finally:
        client.close()


def delete_rabbitmq_entities(url: str, *, queues: Iterable[str], exchanges: Iterable[str]) -> None:
    """Delete ``queues`` and ``exchanges`` on the RabbitMQ at ``url``; missing ones are fine."""
    import kombu

    with kombu.Connection(url, connect_timeout=CONNECT_TIMEOUT) as connection:
        for queue in queues:
            connection.default_channel.queue_delete(queue)
        for exchange in exchanges:
            connection.default_channel.exchange_delete(exchange)


@contextlib.contextmanager
def celery_client(settings: dict[str, Any]) -> Iterator[Celery]:
    """A Celery app for the test process to send tasks and read results with, configured with
    ``settings``; every connection it opened is closed on exit (``Celery.close()`` alone leaves
    the result consumer's open, a ResourceWarning), and its pools leave kombu's registry (see
    :func:`close_app`)."""
    from celery import Celery

    app = Celery("test-client", set_as_current=False)
    app.conf.update(settings)
    try:
        yield app
    finally:
        consumer = getattr(app.backend, "result_consumer", None)
        if consumer is not None:
            # rpc:// raises AttributeError when it never started consuming.
            with contextlib.suppress(AttributeError):
                consumer.stop()
        close_app(app)


def close_app(app: Celery) -> None:
    """Close ``app`` and the broker connections it published with. ``app.close()`` alone
    leaves them open: kombu keeps producer pools in a process-wide registry keyed by URL."""
    from kombu import pools
    from kombu.utils.collections import eqhash

    key = eqhash(app.connection_for_write())
    for group in (pools.producers, pools.connections):
        pool = dict.pop(group, key, None)
        if pool is not None:
            pool.force_close_all()
    if app._pool is not None:
        app.pool.force_close_all()
    app.close()
