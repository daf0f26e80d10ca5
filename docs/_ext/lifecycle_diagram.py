"""The lifecycle page's diagram and table, drawn from ``celery_leases.states`` at each build, so
the lifecycle a reader sees is the map the code runs.

- ``leases-lifecycle``: the states and the events between them, as a Graphviz picture
  (``states.dot()``, rendered by ``sphinx.ext.graphviz``: Graphviz's ``dot``, from Debian's
  package ``graphviz``, which ``make docs`` installs when missing).
- ``leases-transitions``: every transition as a table (state, event, next state, who).
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.ext.graphviz import graphviz
from sphinx.util.docutils import SphinxDirective

from celery_leases.states import TRANSITIONS, dot


class LifecycleDirective(SphinxDirective):
    """``.. leases-lifecycle::``: the diagram of a job's states and events."""

    def run(self) -> list[nodes.Node]:
        node = graphviz()
        node["code"] = dot()
        node["options"] = {"docname": self.env.docname}
        node["alt"] = "A job's states and the events between them"
        return [node]


class TransitionsDirective(SphinxDirective):
    """``.. leases-transitions::``: every transition, one row each."""

    def run(self) -> list[nodes.Node]:
        headers = ("state", "event", "next state", "who makes it")
        table = nodes.table()
        group = nodes.tgroup(cols=len(headers))
        table += group
        for width in (14, 16, 14, 40):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        head += self._row(headers)
        body = nodes.tbody()
        group += body
        for t in TRANSITIONS:
            source = "(no row)" if t.source is None else t.source.value
            target = "(deleted)" if t.target is None else t.target.value
            body += self._row((source, t.event.value, target, t.by))
        return [table]

    @staticmethod
    def _row(cells: tuple[str, ...]) -> nodes.row:
        row = nodes.row()
        for text in cells:
            entry = nodes.entry()
            entry += nodes.paragraph(text=text)
            row += entry
        return row


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.graphviz")
    app.add_directive("leases-lifecycle", LifecycleDirective)
    app.add_directive("leases-transitions", TransitionsDirective)
    app.config.graphviz_output_format = "svg"
    return {"parallel_read_safe": True, "parallel_write_safe": True}
