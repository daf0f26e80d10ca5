"""A local Sphinx extension for the celery-leases docs.

- ``leases-fixtures``: documents the fixtures a pytest plugin module declares (autodoc does
  not see them: a ``@pytest.fixture`` is no plain function), each with its docstring.
- Celery's own task attributes are left out of ``LeasedTask``'s entry (see
  ``skip_celery_bound_attributes``).
- A check at the end of reading: every public name (``celery_leases.__all__``, the
  ``__all__`` of the other public modules, the plugin's fixtures) has an entry in the API
  reference; a missing one is a warning, so the strict build fails.
"""

from __future__ import annotations

import importlib
import inspect
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


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("leases-fixtures", FixturesDirective)
    app.connect("autodoc-skip-member", skip_celery_bound_attributes)
    app.connect("env-check-consistency", check_every_public_name)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
