"""Settings of the example project. The database comes from SHOP_DATABASE: ``sqlite`` (the
default, ``db.sqlite3`` here), ``postgres`` or ``mariadb`` (SHOP_DB_* say where)."""

import importlib.util
import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example-only-not-a-secret")
DEBUG = os.environ.get("SHOP_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_leases.contrib.django",  # the jobs table's migrations and admin
    "billing",
]
if importlib.util.find_spec("django_celery_beat"):
    # beat's schedule in the database: celery -A shop beat -S django_celery_beat.schedulers:
    # DatabaseScheduler (the reaper's entry, from schedule_reaper, is stored there too).
    INSTALLED_APPS.append("django_celery_beat")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "shop.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

_database = os.environ.get("SHOP_DATABASE", "sqlite")
if _database == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("SHOP_DB_NAME", "shop"),
            "USER": os.environ.get("SHOP_DB_USER", "postgres"),
            "PASSWORD": os.environ.get("SHOP_DB_PASSWORD", ""),
            "HOST": os.environ.get("SHOP_DB_HOST", "127.0.0.1"),
            "PORT": os.environ.get("SHOP_DB_PORT", "5432"),
        }
    }
elif _database == "mariadb":
    # PyMySQL stands in for mysqlclient here, so the example installs without a compiler;
    # with mysqlclient installed, drop these two lines: celery-leases follows Django's driver.
    import pymysql

    pymysql.version_info = (2, 2, 1, "final", 0)  # Django 5.2 asks for mysqlclient >= 2.2.1
    pymysql.install_as_MySQLdb()
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": os.environ.get("SHOP_DB_NAME", "shop"),
            "USER": os.environ.get("SHOP_DB_USER", "root"),
            "PASSWORD": os.environ.get("SHOP_DB_PASSWORD", ""),
            "HOST": os.environ.get("SHOP_DB_HOST", "127.0.0.1"),
            "PORT": os.environ.get("SHOP_DB_PORT", "3306"),
            "OPTIONS": {"charset": "utf8mb4"},
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("SHOP_DB_NAME", str(BASE_DIR / "db.sqlite3")),
            "OPTIONS": {"timeout": 30},  # a worker's checkpoint may hold the write lock
        }
    }

# SHOP_ATOMIC_REQUESTS=1: each request in one transaction; a task run eagerly in a view
# (SHOP_EAGER=1) then runs inside it, and commits or rolls back with the request.
DATABASES["default"]["ATOMIC_REQUESTS"] = os.environ.get("SHOP_ATOMIC_REQUESTS") == "1"

if os.environ.get("SHOP_LEASES_DB_NAME"):
    # The leases in a database of their own (an SQLite file here): migrate it with
    # ``manage.py migrate --database leases``; checkpoints then join atomic(using="leases").
    DATABASES["leases"] = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["SHOP_LEASES_DB_NAME"],
        "OPTIONS": {"timeout": 30},
    }
    CELERY_LEASES_DATABASE_ALIAS = "leases"

if os.environ.get("SHOP_LEASES_ROUTED_URL"):
    # A second leases database, for the jobs sent to the queue "routed" (leases_routes):
    # ``manage.py migrate`` of the leases database migrates it too.
    CELERY_LEASES_DATABASES = {"routed": os.environ["SHOP_LEASES_ROUTED_URL"]}
    CELERY_LEASES_ROUTES = {"queues": {"routed": "routed"}}
    if os.environ.get("SHOP_LEASES_ROUTED_SQLITE"):
        # The same database as a DATABASES entry (an SQLite file here), for the admin to read
        # its jobs, keys and groups.
        DATABASES["routed"] = {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ["SHOP_LEASES_ROUTED_SQLITE"],
            "OPTIONS": {"timeout": 30},
        }

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Celery, read by shop/celery.py (namespace CELERY): CELERY_BROKER_URL is broker_url.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND") or None
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "shop")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# SHOP_EAGER=1: tasks run in the caller, as some test settings do.
CELERY_TASK_ALWAYS_EAGER = os.environ.get("SHOP_EAGER") == "1"
# celery-leases: the leases live in DATABASES["default"] (CELERY_LEASES_DATABASE_ALIAS);
# CELERY_LEASES_* are the leases_* settings.
CELERY_LEASES_TABLE = os.environ.get("SHOP_LEASES_TABLE", "celery_leases_jobs")
CELERY_LEASES_DURATION = float(os.environ.get("SHOP_LEASE_SECONDS", "30"))
