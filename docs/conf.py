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

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# Document what celery-leases says, not the docstrings of the Celery methods it overrides.
autodoc_inherit_docstrings = False
