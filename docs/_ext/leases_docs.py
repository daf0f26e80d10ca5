"""A local Sphinx extension for the celery-leases docs.

- ``leases-fixtures``: documents the fixtures a pytest plugin module declares (autodoc does
  not see them: a ``@pytest.fixture`` is no plain function), each with its docstring.
- Celery's own task attributes are left out of ``LeasedTask``'s entry (see
  ``skip_celery_bound_attributes``).
- A check at the end of reading: every public name (``celery_leases.__all__``, the
  ``__all__`` of the other public modules, the plugin's fixtures) has an entry in the API
  reference; a missing one is a warning, so the strict build fails.
- ``{lines}`path```: the length of a file of the package (``wc -l``), or the sum over the files
  that space-separated globs match (``{lines}`db/**/*.py```), counted at build time. A page
  that gives a file's length with it (the architecture page's tables) must give every file of
  the package one: a file without a row, or a row naming no file, is a warning.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

from _pytest.fixtures import getfixturemarker
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

#: The package whose files ``{lines}`` counts, and the files it counts.
PACKAGE = Path(__file__).resolve().parents[2] / "celery_leases"
SOURCES = ("*.py", "**/*.py")

#: The modules whose public names the API reference documents, by their import path.
PUBLIC = ["celery_leases", "celery_leases.contrib.django", "celery_leases.testing"]
PLUGIN = "celery_leases.pytest_plugin"


def fixtures(module: ModuleType) -> dict[str, Any]:
    """The module's pytest fixtures by name, in the order they are declared."""
    return {name: value for name, value in vars(module).items() if getfixturemarker(value)}


class FixturesDirective(SphinxDirective):
    """``.. leases-fixtures:: module``: one entry per fixture, with its parameters."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module = importlib.import_module(self.arguments[0])
        lines: list[str] = []
        for name, fixture in fixtures(module).items():
            wrapped = inspect.unwrap(fixture)
            parameters = ", ".join(inspect.signature(wrapped).parameters)
            lines += [
                f".. py:function:: {name}({parameters})",
                f"   :module: {module.__name__}",
                "",
                "   *pytest fixture.*",
                "",
            ]
            lines += ["   " + line for line in (inspect.getdoc(wrapped) or "").splitlines()]
            lines.append("")
        container = nodes.section()
        container.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source=self.arguments[0]), container)
        return list(container.children)


def celery_bound_attributes() -> frozenset[str]:
    """The attributes Celery's ``Task.bind()`` sets on a task class from the app's
    configuration (``ignore_result``, ``priority``, ...), found by binding a throwaway class."""
    from celery import Celery, Task

    probe = type("Probe", (Task,), {})
    before = set(vars(probe))
    probe.bind(Celery("probe", set_as_current=False))
    return frozenset(set(vars(probe)) - before)


CELERY_BOUND = celery_bound_attributes()


def skip_celery_bound_attributes(
    app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: Any
) -> bool | None:
    """autodoc's read of ``LeasedTask.app`` binds the class to Celery's default app, which sets
    Celery's configuration attributes on it: they are Celery's (documented there, in Celery's
    own Sphinx roles), not members of ours. What a class of ours defines itself (a property,
    a method) stays."""
    own = inspect.isroutine(obj) or isinstance(obj, property)
    if what == "class" and name in CELERY_BOUND and not own:
        return True
    return None


def check_every_public_name(app: Sphinx, env: BuildEnvironment) -> None:
    documented = set(env.domains["py"].objects)
    public = [f"{path}.{name}" for path in PUBLIC for name in importlib.import_module(path).__all__]
    plugin = importlib.import_module(PLUGIN)
    public += [f"{PLUGIN}.{name}" for name in [*plugin.__all__, *fixtures(plugin)]]
    for name in public:
        if name not in documented:
            logger.warning("the API reference has no entry for %s", name)


def package_files() -> list[str]:
    """Every source file of the package, relative to it (``db/store/base.py``)."""
    return sorted({str(p.relative_to(PACKAGE)) for p in PACKAGE.glob("**/*.py")})


def line_count(path: Path) -> int:
    with path.open("rb") as file:
        return sum(1 for _ in file)


def lines_role(
    name: str,
    rawtext: str,
    text: str,
    lineno: int,
    inliner: Any,
    options: Any = None,
    content: Any = None,
) -> tuple[list[nodes.Node], list[nodes.system_message]]:
    """``{lines}`task.py``` -> ``319``; ``{lines}`cli/**/*.py contrib/**/*.py``` -> their
    sum, with a thousands separator."""
    env = inliner.document.settings.env
    files: set[Path] = set()
    for pattern in text.split():
        matched = {p for p in PACKAGE.glob(pattern) if p.is_file()}
        if not matched:
            message = inliner.reporter.warning(
                f"{{lines}}: no file of celery_leases/ matches {pattern!r}", line=lineno
            )
            return [inliner.problematic(rawtext, rawtext, message)], [message]
        files |= matched
    if len(text.split()) == 1 and len(files) == 1:  # one file: one row of the page's tables
        counted = _counted(env).setdefault(env.docname, set())
        counted.add(str(next(iter(files)).relative_to(PACKAGE)))
    total = sum(line_count(path) for path in files)
    return [nodes.Text(f"{total:,}")], []


def _counted(env: BuildEnvironment) -> dict[str, set[str]]:
    """The files whose lines each page counts one by one, by page."""
    if not hasattr(env, "leases_counted"):
        env.leases_counted = {}  # type: ignore[attr-defined]
    return env.leases_counted  # type: ignore[attr-defined,no-any-return]


def purge_counted(app: Sphinx, env: BuildEnvironment, docname: str) -> None:
    _counted(env).pop(docname, None)


def merge_counted(
    app: Sphinx, env: BuildEnvironment, docnames: set[str], other: BuildEnvironment
) -> None:
    for docname in docnames:
        if docname in _counted(other):
            _counted(env)[docname] = _counted(other)[docname]


def check_every_file_counted(app: Sphinx, env: BuildEnvironment) -> None:
    """A page that counts one file's lines counts every file's: a new module needs a row."""
    for docname, counted in sorted(_counted(env).items()):
        for missing in sorted(set(package_files()) - counted):
            logger.warning(
                "celery_leases/%s has no row in %s (a {lines} role of its own)",
                missing,
                docname,
                location=docname,
            )


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("leases-fixtures", FixturesDirective)
    app.add_role("lines", lines_role)
    app.connect("autodoc-skip-member", skip_celery_bound_attributes)
    app.connect("env-check-consistency", check_every_public_name)
    app.connect("env-purge-doc", purge_counted)
    app.connect("env-merge-info", merge_counted)
    app.connect("env-check-consistency", check_every_file_counted)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
