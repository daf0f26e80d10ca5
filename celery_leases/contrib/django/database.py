"""Where a Django project's leases live: by default in its own database (``DATABASES``).

The Django side reads the same settings as the Celery app that loads them with
``app.config_from_object("django.conf:settings", namespace="CELERY")``: ``CELERY_LEASES_TABLE``
is ``leases_table``, and so on. ``CELERY_LEASES_DATABASE_ALIAS`` (default ``"default"``) names
the database; without ``CELERY_LEASES_DATABASE_URL`` the SQLAlchemy URL is built from that
database's ``DATABASES`` entry, with the driver Django itself uses, so a checkpoint can run on
Django's own connection (``transaction.py``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import sqlalchemy as sa

from ...db import Store, store_for
from ...errors import ConfigurationError
from ...settings import DEFAULTS, Settings, validate

APP = "celery_leases.contrib.django"
#: Django settings of their own (every other ``CELERY_LEASES_<NAME>`` is ``leases_<name>``).
ALIAS_SETTING = "CELERY_LEASES_DATABASE_ALIAS"

#: PostgreSQL ``OPTIONS`` that are Django's, not libpq's.
_DJANGO_ONLY_OPTIONS = ("isolation_level", "server_side_binding", "pool", "assume_role")


def alias() -> str:
    """The Django database alias the leases live in (``CELERY_LEASES_DATABASE_ALIAS``)."""
    from django.conf import settings

    name = getattr(settings, ALIAS_SETTING, "default")
    if name not in settings.DATABASES:
        raise ConfigurationError(
            f"{ALIAS_SETTING} is {name!r}, which is not in DATABASES "
            f"({', '.join(settings.DATABASES)})"
        )
    return str(name)


def url_for(name: str) -> str:
    """The SQLAlchemy URL of Django's database ``name``, with the driver Django uses."""
    from django.db import connections

    config = connections[name].settings_dict
    engine = config["ENGINE"]
    options = dict(config.get("OPTIONS") or {})
    if engine == "django.db.backends.sqlite3":
        path = str(config["NAME"])
        if in_memory(config):
            raise ConfigurationError(
                f"database {name!r} is an in-memory SQLite database, which no second "
                f"connection can see: give it a file (in tests: DATABASES[...]['TEST']['NAME'])"
            )
        return f"sqlite:///{path}"
    if engine == "django.db.backends.postgresql":
        # Django prefers psycopg 3, as SQLAlchemy's postgresql+psycopg does.
        driver = "psycopg" if importlib.util.find_spec("psycopg") else "psycopg2"
        query = {
            k: str(v)
            for k, v in options.items()
            if k not in _DJANGO_ONLY_OPTIONS and isinstance(v, str | int)
        }
        return _url(f"postgresql+{driver}", config, query)
    if engine == "django.db.backends.mysql":
        return _url(
            f"mysql+{_mysql_driver()}", config, {"charset": options.get("charset", "utf8mb4")}
        )
    raise ConfigurationError(
        f"database {name!r} uses {engine}, which celery-leases does not support: set "
        f"CELERY_LEASES_DATABASE_URL (PostgreSQL, MariaDB/MySQL or SQLite)"
    )


def in_memory(config: dict[str, Any]) -> bool:
    """Whether the ``DATABASES`` entry ``config`` is an in-memory SQLite database."""
    path = str(config.get("NAME"))
    return config.get("ENGINE") == "django.db.backends.sqlite3" and (
        path == ":memory:" or "mode=memory" in path
    )


def _mysql_driver() -> str:
    """``mysqldb`` (mysqlclient, Django's driver) or ``pymysql`` when PyMySQL stands in for it
    (``pymysql.install_as_MySQLdb()``)."""
    try:
        import MySQLdb
    except ImportError:
        return "pymysql"
    return "pymysql" if MySQLdb.__name__ == "pymysql" else "mysqldb"


def _url(driver: str, config: dict[str, Any], query: dict[str, str]) -> str:
    port = config.get("PORT")
    url = sa.engine.URL.create(
        driver,
        username=config.get("USER") or None,
        password=config.get("PASSWORD") or None,
        host=config.get("HOST") or None,
        port=int(port) if port else None,
        database=config.get("NAME") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


def installed() -> bool:
    """Whether this is a configured Django project with the leases app installed."""
    from django.conf import settings

    if not settings.configured:
        return False
    apps = getattr(settings, "INSTALLED_APPS", ())
    return any(a == APP or a.startswith(f"{APP}.") for a in apps)


def default_url() -> str | None:
    """The leases database URL when the Celery app names none (``config.settings_for``): the
    Django database's, in a project with the leases app installed; None elsewhere."""
    try:
        if not installed():
            return None
    except ImportError:
        return None
    return url_for(alias())


def leases_url() -> str:
    """Where the leases live: ``CELERY_LEASES_DATABASE_URL``, or the Django database's URL."""
    from django.conf import settings

    explicit = getattr(settings, "CELERY_LEASES_DATABASE_URL", None)
    return str(explicit) if explicit else url_for(alias())


def in_django_database(url: str) -> bool:
    """Whether leases at ``url`` live in a Django database whose transactions a checkpoint
    can join (:func:`joinable_alias`)."""
    return joinable_alias(url) is not None


def joinable_alias(url: str) -> str | None:
    """The alias of the Django database that leases at ``url`` live in, reached with the
    driver Django uses for it, so the store's statements can run on Django's own connection
    and join its ``atomic()`` blocks: ``CELERY_LEASES_DATABASE_ALIAS`` first, then the other
    ``DATABASES`` entries in order. None when ``url`` names no Django database, or names one
    through another driver."""
    from django.db import connections

    wanted = sa.engine.make_url(url)
    first = alias()
    for name in [first, *(a for a in connections.settings if a != first)]:
        try:
            django_url = sa.engine.make_url(url_for(name))
        except ConfigurationError:  # in-memory SQLite, an engine celery-leases cannot use
            continue
        if same_database(wanted, django_url) and wanted.drivername == django_url.drivername:
            return name
    return None


def alias_of(url: str) -> str | None:
    """The alias of the Django database that ``url`` names, whatever its driver; None when it
    names none."""
    from django.db import connections

    wanted = sa.engine.make_url(url)
    for name in connections.settings:
        try:
            if same_database(wanted, sa.engine.make_url(url_for(name))):
                return str(name)
        except ConfigurationError:
            continue
    return None


#: Host names that name this machine, taken as one.
_LOCAL = {None, "", "localhost", "127.0.0.1", "::1"}
#: Each database family's port when a URL gives none.
_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}


def same_database(a: sa.engine.URL, b: sa.engine.URL) -> bool:
    """Whether the URLs ``a`` and ``b`` name one database (whatever their driver, user or
    options): the same server and database name, or the same SQLite file."""
    family_a, family_b = a.get_backend_name(), b.get_backend_name()
    if {family_a, family_b} <= {"mysql", "mariadb"}:
        family_a = family_b = "mysql"
    if family_a != family_b:
        return False
    if family_a == "sqlite":
        return bool(a.database) and _file(a.database) == _file(b.database)
    port = _PORTS.get(family_a)
    host_a = "localhost" if a.host in _LOCAL else a.host
    host_b = "localhost" if b.host in _LOCAL else b.host
    return (host_a, a.port or port, a.database) == (host_b, b.port or port, b.database)


def _file(path: str | None) -> str:
    import os

    return os.path.realpath(path) if path else ""


def django_key(name: str) -> str:
    """The Django setting of ``leases_<name>``: ``CELERY_LEASES_<NAME>``."""
    return f"CELERY_LEASES_{name.upper()}"


def raw_settings() -> dict[str, Any]:
    """The ``CELERY_LEASES_*`` Django settings by name (``duration``), unchecked; each one
    unset is at its default."""
    from django.conf import settings as django

    return {name: getattr(django, django_key(name), d) for name, d in DEFAULTS.items()}


def settings() -> Settings:
    """The leases settings as the Celery app reads them from Django's (``CELERY_LEASES_*``)."""
    raw = raw_settings()
    raw["database_url"] = leases_url()
    return validate(raw, spell=django_key)


def store() -> Store:
    """The store of the project's leases table (shared with the tasks in this process)."""
    return store_for(settings())
