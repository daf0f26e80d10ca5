"""Sphinx configuration of the celery-leases docs: Markdown pages (MyST), the API from the
docstrings (autodoc), the furo theme. Built with warnings as errors (``make docs``), offline."""

from __future__ import annotations

import sys
from pathlib import Path

import celery_leases
from celery_leases.settings import markdown_table

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "celery-leases"
author = "The celery-leases authors"
copyright = "The celery-leases authors"
release = version = celery_leases.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "leases_docs",  # _ext/leases_docs.py: the fixtures directive, the API completeness check
    "lifecycle_diagram",  # _ext/lifecycle_diagram.py: the lifecycle's diagram and table
]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

html_theme = "furo"
html_title = f"celery-leases {release}"
html_static_path = ["_static"]
html_css_files = ["leases.css"]

myst_enable_extensions = ["substitution", "deflist"]
myst_heading_anchors = 3

# The settings table is rendered from the declaration itself (``Settings``' fields, through
# ``markdown_table()``), so it cannot drift from the code.
myst_substitutions = {"settings_table": markdown_table()}

# Every cross-reference must resolve, so a renamed or removed function fails the build. Nothing
# is fetched (no intersphinx): the standard library's classes in signatures are left unlinked,
# and so are the library's own classes that signatures name but the API reference does not
# document (users get them from the functions that return them, never construct them).
nitpicky = True
nitpick_ignore = [
    ("py:class", "collections.abc.Callable"),
    ("py:class", "collections.abc.Iterable"),
    ("py:class", "collections.abc.Sequence"),
    ("py:class", "celery_leases.message.Message"),
    ("py:class", "celery_leases.settings.Settings"),
    ("py:class", "celery_leases.db.store.Store"),
    ("py:class", "celery_leases.lease.Hold"),
]
# autodoc renders Callable[[], T] as the text "collections.abc.Callable[[]" and a class.
nitpick_ignore_regex = [("py:class", r"collections\.abc\.Callable\[.*")]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# Document what celery-leases says, not the docstrings of the Celery methods it overrides.
autodoc_inherit_docstrings = False
