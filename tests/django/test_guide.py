"""The Django guide (docs/django.md) followed on a fresh project, its code samples taken from
the page as written: ``django-admin startproject proj``, ``startapp billing``, the
``proj/celery.py`` of Celery's "First steps with Django", then the guide's ``# settings.py``,
``# proj/celery.py, ...``, ``# billing/tasks.py`` and ``# billing/views.py`` samples and its
keyed webhook sync (added to billing/tasks.py).
``manage.py check``, ``migrate``, ``showmigrations`` and ``sqlmigrate`` run on it, then a real
``celery -A proj worker`` runs the keyed sync: triggered twice while it runs (one follow-up),
its pool process killed between two pages (it resumes from the key's cursor), every event
written once. A sample changed in the guide is what this test runs; one that stops working
fails it.

SQLite only (the project's own ``db.sqlite3``, as ``startproject`` makes it): the example
project runs on PostgreSQL and MariaDB in tests/django/test_project.py and test_worker.py.

The user's part, which the guide leaves to the reader, is supplied here and nothing else is
changed: the models ``Invoice`` and ``Event`` (billing/models.py) and their import into
billing/tasks.py; ``fetch_page`` ("yours: the upstream API"), a stand-in serving pages of a
JSON file (billing/upstream.py); the broker settings; ``"billing"`` in ``INSTALLED_APPS``.
Placeholders are transformed, each in one place: ``INSTALLED_APPS = [..., "x"]`` becomes
``INSTALLED_APPS += ["x"]``. The view is called from a ``manage.py shell`` inside
``transaction.atomic()``, as a request under ``ATOMIC_REQUESTS`` runs it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from celery_leases.db.rows import Job
from celery_leases.db.store import Store
from tests.support.cli import store_of
from tests.support.service import private_redis_url
from tests.support.worker import REPO_ROOT, Spawner

T = TypeVar("T")
GUIDE = REPO_ROOT / "docs" / "django.md"
#: The section of the guide whose sample is the keyed sync (it names no file).
KEYED_SECTION = "A keyed webhook sync with the ORM"
#: The first line of a sample that says which file of the project it belongs to.
FILE_COMMENT = re.compile(r"# (?P<path>[\w/]+\.py)\b,?\s*(?P<where>.*)")
#: The guide's placeholder for the project's own apps.
INSTALLED_APPS = re.compile(r"^INSTALLED_APPS = \[\.\.\., (?P<apps>.+)\]$", re.MULTILINE)

#: proj/celery.py and proj/__init__.py as Celery's "First steps with Django" writes them.
CELERY_PY = """\
import os

from celery import Celery

# Set the default Django settings module for the 'celery' program.
os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'proj.settings')

app = Celery('proj')

# Using a string here means the worker doesn't have to serialize
# the configuration object to child processes.
# - namespace='CELERY' means all celery-related configuration keys
#   should have a `CELERY_` prefix.
app.config_from_object('django.conf:settings', namespace='CELERY')

# Load task modules from all registered Django apps.
app.autodiscover_tasks()


@app.task(bind=True, ignore_result=True)
def debug_task(self):
    print(f'Request: {self.request!r}')
"""
INIT_PY = """\
# This will make sure the app is always imported when
# Django starts so that shared_task will use this app.
from .celery import app as celery_app

__all__ = ('celery_app',)
"""

# -- the user's part ------------------------------------------------------------------------------

MODELS_PY = """\
from django.db import models


class Invoice(models.Model):
    batch = models.CharField(max_length=20)
    number = models.IntegerField()


class Event(models.Model):
    account_id = models.IntegerField()
    upstream_id = models.IntegerField()
    kind = models.CharField(max_length=20)
"""
#: The upstream API of the sync, a stand-in: an account's events from events.json next to
#: manage.py, PAGE at a time; page n waits until gate.txt holds a number above n, so the test
#: holds the sync between two pages.
UPSTREAM_PY = """\
import json
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = 3


@dataclass
class Page:
    items: list
    next_cursor: int
    has_more: bool


def fetch_page(account_id, after):
    start = after or 0
    while start // PAGE >= int((ROOT / "gate.txt").read_text()):
        time.sleep(0.05)
    events = json.loads((ROOT / "events.json").read_text())[str(account_id)]
    items = events[start : start + PAGE]
    end = start + len(items)
    return Page(items, end, end < len(events))
"""
USER_IMPORTS = """\
# The user's own models and upstream API (tests/django/test_guide.py):
from billing.models import Event, Invoice
from billing.upstream import fetch_page
"""
ACCOUNT = 7
EVENTS = 12  # 4 pages of 3
SYNC = "billing.tasks.sync_account"
INVOICES = "billing.tasks.invoice_orders"


# -- the guide's samples --------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """A fenced Python sample of the guide, under its ``## `` section."""

    section: str
    code: str

    @property
    def file(self) -> tuple[str, str] | None:
        """(path, the rest of its first-line comment) when the sample names its file."""
        match = FILE_COMMENT.fullmatch(self.code.splitlines()[0])
        return (match["path"], match["where"]) if match else None


def guide_samples(text: str) -> list[Sample]:
    """Every fenced ``python`` block of the guide's Markdown ``text``."""
    samples, section, block = [], "", None
    for line in text.splitlines():
        if block is None and line.startswith("## "):
            section = line[3:].strip()
        elif block is None and line.strip() == "```python":
            block = []
        elif block is not None and line.strip() == "```":
            samples.append(Sample(section, "\n".join(block) + "\n"))
            block = None
        elif block is not None:
            block.append(line)
    return samples


@dataclass(frozen=True)
class Guide:
    """What the guide asks a project to hold: settings lines, lines for proj/celery.py (and
    the start of the line they follow), billing/tasks.py and billing/views.py."""

    settings: str
    celery: str
    celery_after: str
    tasks: str
    views: str


def read_guide(path: Path = GUIDE) -> Guide:
    samples = guide_samples(path.read_text())
    files = {s.file[0]: (s.file[1], s.code) for s in samples if s.file}
    expected = {"settings.py", "proj/celery.py", "billing/tasks.py", "billing/views.py"}
    assert expected <= files.keys(), files.keys()
    (keyed,) = [s.code for s in samples if s.section == KEYED_SECTION]

    settings, found = INSTALLED_APPS.subn(r"INSTALLED_APPS += [\g<apps>]", files["settings.py"][1])
    assert found == 1, "the guide's INSTALLED_APPS placeholder changed: update this test"
    where, celery = files["proj/celery.py"]
    after = re.fullmatch(r"after (?P<call>[\w.]+)\(\.\.\.\)", where)
    assert after, f"proj/celery.py sample placed {where!r}: update this test"
    tasks, views = files["billing/tasks.py"][1] + "\n" + keyed, files["billing/views.py"][1]
    kept = {"settings": settings, "celery": celery, "tasks": tasks, "views": views}
    for name, code in kept.items():
        code_only = "\n".join(line.partition("#")[0] for line in code.splitlines())
        assert "..." not in code_only, f"a new placeholder in the {name} sample: update this test"
    return Guide(settings, celery, after["call"] + "(", tasks, views)


# -- the project ----------------------------------------------------------------------------------


@dataclass
class Project:
    """A project made by ``startproject proj`` in ``parent`` and set up as the guide says."""

    root: Path
    env: dict[str, str]

    def manage(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"manage.py {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    def shell(self, code: str) -> subprocess.Popen[str]:
        """``manage.py shell -c code``, started (``.communicate()`` it)."""
        return subprocess.Popen(
            [sys.executable, "manage.py", "shell", "-c", code],
            cwd=self.root,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def gate(self, pages: int) -> None:
        """Let the upstream serve its first ``pages`` pages."""
        (self.root / "gate.txt").write_text(str(pages))


def follow_guide(parent: Path, *, user_settings: str, guide: Guide | None = None) -> Project:
    """``startproject proj`` and ``startapp billing`` in ``parent``, Celery's proj/celery.py, then
    the guide's samples with the user's part (``user_settings``: the broker and the like)."""
    guide = guide or read_guide()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "DJANGO_"))}
    env |= {"PYTHONPATH": str(parent / "proj"), "PYTHONUNBUFFERED": "1"}
    django_admin = [sys.executable, "-m", "django"]  # django-admin, from this interpreter
    subprocess.run([*django_admin, "startproject", "proj"], cwd=parent, env=env, check=True)
    project = Project(parent / "proj", env)
    project.manage("startapp", "billing")
    package = project.root / "proj"
    (package / "__init__.py").write_text(INIT_PY)
    celery = CELERY_PY.splitlines(keepends=True)
    (at,) = [n for n, line in enumerate(celery) if line.startswith(guide.celery_after)]
    (package / "celery.py").write_text(
        "".join(celery[: at + 1]) + guide.celery + "".join(celery[at + 1 :])
    )
    with (package / "settings.py").open("a") as settings:
        settings.write("\n" + guide.settings + '\nINSTALLED_APPS += ["billing"]\n' + user_settings)
    billing = project.root / "billing"
    (billing / "models.py").write_text(MODELS_PY)
    (billing / "upstream.py").write_text(UPSTREAM_PY)
    (billing / "tasks.py").write_text(USER_IMPORTS + "\n" + guide.tasks)
    (billing / "views.py").write_text(guide.views)
    events = [{"upstream_id": n, "kind": "charge"} for n in range(EVENTS)]
    (project.root / "events.json").write_text(json.dumps({str(ACCOUNT): events}))
    project.gate(1000)
    project.manage("makemigrations", "billing")
    return project


# -- the test -------------------------------------------------------------------------------------


def wait_for(what: str, check: Callable[[], T | None], *, timeout: float = 30) -> T:
    deadline = time.monotonic() + timeout
    while (found := check()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)
    return found


@pytest.fixture
def broker() -> Iterator[str]:
    with private_redis_url() as url:
        yield url


@pytest.mark.e2e
def test_the_django_guide_followed_on_a_fresh_project_runs_a_keyed_sync_exactly_once(
    tmp_path: Path, broker: str, queue_name: str, spawn: Spawner
) -> None:
    # Given a fresh project set up as the guide says, checked and migrated
    user_settings = f"CELERY_BROKER_URL = {broker!r}\nCELERY_TASK_DEFAULT_QUEUE = {queue_name!r}\n"
    project = follow_guide(tmp_path, user_settings=user_settings)
    assert "System check identified no issues" in project.manage("check")
    migrated = project.manage("migrate")
    assert "celery-leases: leases table celery_leases_jobs in " in migrated
    shown = project.manage("showmigrations", "celery_leases")
    names = sorted(
        p.stem for p in (REPO_ROOT / "celery_leases/contrib/django/migrations").glob("0*.py")
    )
    assert [line.strip() for line in shown.splitlines()[1:]] == [f"[X] {n}" for n in names]
    sql = project.manage("sqlmigrate", "celery_leases", "0003")
    assert "-- celery-leases revision " in sql, sql
    assert "UPDATE celery_leases_jobs_version SET version_num=" in sql, sql
    store = store_of({"leases_database_url": f"sqlite:///{project.root / 'db.sqlite3'}"})
    try:
        run_the_keyed_sync(project, store, spawn)
    finally:
        store.engine.dispose()


def run_the_keyed_sync(project: Project, store: Store, spawn: Spawner) -> None:
    # When the sync of an account is triggered, and a worker serves it one page at a time
    project.gate(1)
    first = project.shell(
        f"from billing.tasks import sync_account\nprint(sync_account.delay({ACCOUNT}).id)"
    )
    worker = spawn.worker("proj", env=project.env, cwd=project.root)
    job_id = printed(first)[-1]
    at_page(store, job_id, 1)

    # ... triggered twice more while it runs, and an invoice batch sent by the guide's view
    triggers = project.shell(
        "from django.db import transaction\nfrom django.test import RequestFactory\n"
        "from billing.tasks import sync_account\nfrom billing.views import invoice\n"
        f"print(sync_account.delay({ACCOUNT}).id)\nprint(sync_account.delay({ACCOUNT}).id)\n"
        "with transaction.atomic():  # the request's, under ATOMIC_REQUESTS\n"
        "    print(invoice(RequestFactory().post('/'), '2024-05').status_code)\n"
    )
    follow_up, again, status = printed(triggers)[-3:]

    # ... and its pool process killed between two pages
    project.gate(2)
    at_page(store, job_id, 2)
    (pool,) = worker.children()
    os.kill(pool, signal.SIGKILL)
    project.gate(1000)

    # Then the triggers were one follow-up, the killed run resumed from the key's cursor, and
    # every event was written once; the key's cursor is at the end of the upstream's pages
    assert follow_up == again != job_id
    done = wait_for("the follow-up done", lambda: ended(store, follow_up), timeout=60)
    first_run = store.get(job_id)
    assert first_run is not None and (first_run.state, first_run.attempts) == ("done", 2)
    assert (done.state, done.attempts) == ("done", 1)
    assert {j.id for j in store.list_jobs(task=SYNC, limit=10)} == {job_id, follow_up}
    events = rows(project, f"SELECT upstream_id FROM billing_event WHERE account_id = {ACCOUNT}")
    assert events == list(range(EVENTS))
    assert store.cursor(f"account:{ACCOUNT}") == EVENTS
    # ... and the view's batch, sent when its transaction committed, was invoiced once
    assert status == "202"
    (batch,) = store.list_jobs(task=INVOICES, limit=10)
    invoiced = wait_for("the invoices done", lambda: ended(store, batch.id), timeout=60)
    assert invoiced.state == "done"
    assert rows(project, "SELECT number FROM billing_invoice WHERE batch = '2024-05'") == list(
        range(500)
    )


def printed(shell: subprocess.Popen[str]) -> list[str]:
    """The words a ``manage.py shell`` printed, once it exited 0."""
    out, err = shell.communicate(timeout=60)
    assert shell.returncode == 0, err
    return out.split()


def at_page(store: Store, job_id: str, pages: int) -> None:
    """Wait until the job's checkpoint says ``pages`` pages are committed."""
    after = {"after": pages * 3}
    wait_for(
        f"page {pages} of {job_id}", lambda: ran(store, job_id, lambda j: j.checkpoint == after)
    )


def ended(store: Store, job_id: str) -> Job | None:
    return ran(store, job_id, lambda job: job.state in ("done", "failed", "cancelled"))


def ran(store: Store, job_id: str, so_far: Callable[[Job], bool]) -> Job | None:
    """The job once ``so_far(job)`` holds, else None."""
    job = store.get(job_id)
    return job if job is not None and so_far(job) else None


def rows(project: Project, query: str) -> list[int]:
    """The values of ``query``'s one column in the project's database, sorted."""
    connection = sqlite3.connect(project.root / "db.sqlite3")
    try:
        return sorted(value for (value,) in connection.execute(query))
    finally:
        connection.close()
