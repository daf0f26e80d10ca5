"""A Django team's own tests of its leased tasks, on a fresh ``startproject`` set up as
docs/django.md says (PostgreSQL and MariaDB): ``manage.py test`` and pytest-django exit 0 and
leave no test database, with and without ``--keepdb`` / ``--reuse-db`` and ``--parallel``,
while the tests run leased tasks (in a ``TestCase``, in a ``TransactionTestCase``, on the pytest
plugin's worker). The tests the project holds check the crash helpers on the guide's pattern
(a checkpoint inside ``atomic()``): ``assert_resumable`` passes on the guide's task and fails on
one that starts over, and the plugin's worker resumes it on Django's test database; the
guide's own test sample (its ``# billing/tests.py``) runs beside them, as the page writes it.

A checkpoint inside ``atomic()`` with the leases at a URL of their own: the same database as
Django's joins the block; another database is refused, and nothing is lost (without the rule:
invoices ``[0, 2, 3, 4]`` after a crash between the checkpoint and the block's commit).

One project per database for the module; each ``manage.py test`` or ``pytest`` run is a few
seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from tests.django.test_guide import GUIDE, Project, follow_guide, guide_samples
from tests.support.service import require

#: billing/tests.py: what the team's tests do with leased tasks (both runners run it).
TESTS_PY = '''\
import uuid

from celery import shared_task
from django.db import transaction
from django.test import TestCase, TransactionTestCase

from billing.models import Invoice
from billing.tasks import invoice_orders
from celery_leases.contrib.django import DjangoLeasedTask
from celery_leases.testing import assert_resumable


@shared_task(base=DjangoLeasedTask, bind=True, name="billing.tests.from_zero")
def from_zero(self, batch, count):
    """invoice_orders, but every attempt starts over (it never reads its checkpoint)."""
    for number in range(count):
        with transaction.atomic():
            Invoice.objects.get_or_create(batch=batch, number=number)
            self.checkpoint({"next": number + 1}, progress=(number + 1, count))


def numbers(batch):
    return list(Invoice.objects.filter(batch=batch).order_by("id").values_list("number", flat=True))


class InTheTestsTransaction(TestCase):
    def test_a_leased_task_runs_and_rolls_back_with_the_test(self):
        result = invoice_orders.apply(args=["case", 3])
        self.assertEqual(result.state, "SUCCESS")
        self.assertEqual(numbers("case"), [0, 1, 2])


class Committed(TransactionTestCase):
    def test_the_guides_task_resumes_from_its_committed_checkpoint(self):
        batch = uuid.uuid4().hex[:8]
        reset = lambda: Invoice.objects.filter(batch=batch).delete()
        run = assert_resumable(invoice_orders, [batch, 5], crash_after=[2, 1], reset=reset)
        self.assertEqual(numbers(batch), [0, 1, 2, 3, 4])
        self.assertEqual(run.attempts, 3)
        self.assertEqual(run.rolled_back, [{"next": 2}, {"next": 2}])

    def test_a_task_that_starts_over_fails_assert_resumable(self):
        batch = uuid.uuid4().hex[:8]
        reset = lambda: Invoice.objects.filter(batch=batch).delete()
        with self.assertRaisesRegex(AssertionError, "does not resume from its checkpoint"):
            assert_resumable(from_zero, [batch, 5], crash_after=[2, 1], reset=reset)
'''
#: billing/test_plugin.py: the pytest plugin's worker and crash helper, with pytest-django.
TEST_PLUGIN_PY = """\
import pytest

from billing.models import Invoice
from billing.tasks import invoice_orders


@pytest.fixture
def leases_app():
    from proj.celery import app
    return app


@pytest.mark.django_db(transaction=True)
def test_the_guides_task_resumes_on_the_plugins_worker(leased_worker, leases_crash):
    leases_crash.after_checkpoint(invoice_orders, 2)   # dies before block 2 commits
    result = invoice_orders.delay("plugin", 5)
    result.get(timeout=60)
    numbers = Invoice.objects.filter(batch="plugin").order_by("id").values_list("number", flat=True)
    assert list(numbers) == [0, 1, 2, 3, 4]
    assert leases_crash.job(result.id).attempts == 2
"""
PYTEST_INI = """\
[pytest]
DJANGO_SETTINGS_MODULE = proj.settings
python_files = tests.py test_*.py
filterwarnings = error
"""
#: A crash between a checkpoint inside atomic() and the block's commit, with the leases at
#: LEASES_URL (run by ``manage.py shell``); prints what happened as JSON.
CRASH_PY = """\
import json, uuid
import celery_leases
from celery import current_app
from billing.models import Invoice
from billing.tasks import invoice_orders
from celery_leases.testing import run_with_crashes

celery_leases.migrate(current_app)
batch = uuid.uuid4().hex[:8]
seen = {}
try:
    run = run_with_crashes(invoice_orders, [batch, 5], crash_after=[2])
    seen["attempts"] = run.attempts
except Exception as exc:
    seen["error"] = f"{type(exc).__name__}: {exc}"
seen["invoices"] = list(
    Invoice.objects.filter(batch=batch).order_by("id").values_list("number", flat=True)
)
print(json.dumps(seen))
"""


@dataclass
class TeamProject:
    project: Project
    kind: str
    #: SQLAlchemy URL of the server (no database), and the project's database name.
    server: str
    name: str

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=self.project.root,
            env=self.project.env | env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    def databases(self) -> list[str]:
        """The project's test databases on the server (``test_<name>``, its copies)."""
        return leftover_databases(self.server, self.kind, self.name)


def leftover_databases(server: str, kind: str, name: str) -> list[str]:
    """The databases on ``server`` whose name starts with ``test_<name>``."""
    engine = sa.create_engine(server)
    query = (
        "SELECT datname FROM pg_database"
        if kind == "postgres"
        else "SELECT schema_name FROM information_schema.schemata"
    )
    try:
        with engine.connect() as connection:
            names = connection.execute(sa.text(query)).scalars().all()
    finally:
        engine.dispose()
    return sorted(n for n in names if n.startswith(f"test_{name}"))


def _settings(kind: str, name: str, server: str) -> str:
    url = sa.engine.make_url(server)
    engine = {"postgres": "postgresql", "mariadb": "mysql"}[kind]
    lines = [
        "import os",
        "CELERY_BROKER_URL = 'memory://'",
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.{engine}', 'NAME': {name!r}, "
        f"'USER': {url.username!r}, 'PASSWORD': {url.password or ''!r}, "
        f"'HOST': {url.host!r}, 'PORT': {url.port or ''!r}}}}}",
        "if os.environ.get('LEASES_URL'):",
        "    CELERY_LEASES_DATABASE_URL = os.environ['LEASES_URL']",
    ]
    if kind == "mariadb":
        lines[:0] = ["import pymysql", "pymysql.install_as_MySQLdb()"]
    return "\n".join(lines) + "\n"


def _execute(server: str, *statements: str) -> None:
    engine = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            for statement in statements:
                connection.execute(sa.text(statement))
    finally:
        engine.dispose()


@pytest.fixture(scope="module", params=["postgres", "mariadb"])
def team(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TeamProject]:
    """The guide's project on a database of its own (and a second one for the leases)."""
    kind = request.param
    server_url = require(kind)
    server = sa.engine.make_url(server_url)
    server = server.set(database="postgres" if kind == "postgres" else None)
    server_text = server.render_as_string(hide_password=False)
    name = f"cl34_{uuid.uuid4().hex[:8]}"
    _execute(server_text, f"CREATE DATABASE {name}", f"CREATE DATABASE {name}_leases")
    try:
        project = follow_guide(
            tmp_path_factory.mktemp(kind), user_settings=_settings(kind, name, server_url)
        )
        (project.root / "billing" / "tests.py").write_text(TESTS_PY)
        # ... and the guide's own test sample, as the page writes it
        (sample,) = [
            s.code
            for s in guide_samples(GUIDE.read_text())
            if s.file and s.file[0] == "billing/tests.py"
        ]
        (project.root / "billing" / "test_from_guide.py").write_text(sample)
        (project.root / "billing" / "test_plugin.py").write_text(TEST_PLUGIN_PY)
        (project.root / "pytest.ini").write_text(PYTEST_INI)
        project.manage("migrate", "--verbosity", "0")
        yield TeamProject(project, kind, server_text, name)
    finally:
        force = " WITH (FORCE)" if kind == "postgres" else ""
        left = [name, f"{name}_leases", *leftover_databases(server_text, kind, name)]
        _execute(server_text, *(f"DROP DATABASE IF EXISTS {n}{force}" for n in left))


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def test_manage_py_test_exits_0_and_drops_its_test_databases(team: TeamProject) -> None:
    # Given the team's tests, which run leased tasks (a TestCase, TransactionTestCases)

    # When manage.py test runs them in two processes, then keeping the database, then not
    parallel = _ok(team.run("manage.py", "test", "--noinput", "--parallel", "2", "billing"))
    assert team.databases() == []
    _ok(team.run("manage.py", "test", "--noinput", "--keepdb", "billing"))
    kept = team.databases()
    again = _ok(team.run("manage.py", "test", "--noinput", "billing"))

    # Then every run passed, and the test databases are gone but the one --keepdb kept
    assert "Ran 4 tests" in parallel and "Ran 4 tests" in again
    assert kept == [f"test_{team.name}"]
    assert team.databases() == []


def test_pytest_django_exits_0_with_warnings_as_errors_and_drops_its_test_database(
    team: TeamProject,
) -> None:
    # When pytest-django runs the same tests and the plugin's worker test (warnings are
    # errors: a test database left behind is a warning there), reusing the database, then not
    reused = _ok(team.run("-m", "pytest", "-p", "no:cacheprovider", "--reuse-db"))
    done = _ok(team.run("-m", "pytest", "-p", "no:cacheprovider", "--create-db"))

    # Then both passed, and no test database is left
    assert "5 passed" in reused and "5 passed" in done, done
    assert team.databases() == []


@pytest.mark.parametrize("where", ["same database", "another database"])
def test_a_checkpoint_inside_atomic_with_a_leases_url_joins_its_block_or_is_refused(
    team: TeamProject, where: str
) -> None:
    # Given the leases at a URL of their own: Django's database, or a database of their own
    url = sa.engine.make_url(team.server)
    url = url.set(
        drivername="postgresql+psycopg" if team.kind == "postgres" else "mysql+pymysql",
        database=team.name if where == "same database" else f"{team.name}_leases",
    )

    # When the guide's task crashes between a checkpoint and its block's commit
    done = team.run(
        "manage.py",
        "shell",
        "-c",
        CRASH_PY,
        LEASES_URL=url.render_as_string(hide_password=False),
    )
    _ok(done)
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    # Then the checkpoint rolled back with the block, and it resumed losing nothing; or it
    # was refused at once, saying why and what to set, and nothing was written
    if where == "same database":
        assert seen == {"attempts": 2, "invoices": [0, 1, 2, 3, 4]}
    else:
        assert seen["invoices"] == []
        error = seen["error"]
        assert error.startswith("ConfigurationError: a checkpoint inside transaction.atomic()")
        assert "CELERY_LEASES_DATABASE_URL" in error and "after the block" in error
