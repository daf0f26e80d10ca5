"""docs/api.md is the API reference generated from the docstrings, and is kept up to date."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import celery_leases

ROOT = Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "api_reference", ROOT / "scripts/api_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_is_what_the_docstrings_say_now() -> None:
    text = generator().render()

    assert (ROOT / "docs/api.md").read_text() == text, (
        "docs/api.md is out of date: run python scripts/api_reference.py"
    )


def test_the_api_reference_has_an_entry_for_every_exported_name() -> None:
    text = (ROOT / "docs/api.md").read_text()

    main = text[: text.index("## Django (")]  # the other public modules follow
    headings = [line for line in main.splitlines() if line.startswith("### ")]
    assert len(headings) == len(celery_leases.__all__)
    for name, heading in zip(celery_leases.__all__, headings, strict=True):
        assert heading.startswith((f"### `{name}", f"### `class {name}")), (name, heading)
