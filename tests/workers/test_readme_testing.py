"""The docs' testing samples (docs/testing.md, "Crash a task, resume it, compare"), run as a
user's project would run them: its code blocks written out as the files they name
(``# proj/tasks.py``, ...) beside a ``proj/celery.py``, then a fresh pytest over them
(pytester, the plugin from its entry point)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
SECTION = "## Crash a task, resume it, compare"


def samples() -> dict[str, str]:
    """The section's Python blocks, by the path each one names on its first line."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index(SECTION) :]
    end = section.find("\n## ", len(SECTION))
    section = section if end == -1 else section[:end]
    files = {}
    for block in re.findall(r"```python\n(.*?)```", section, flags=re.S):
        first, _, _ = block.partition("\n")
        match = re.fullmatch(r"# ([\w/]+\.py)", first.strip())
        assert match, f"a sample in {SECTION!r} does not name its file: {first!r}"
        files[match.group(1)] = block
    return files


def test_the_readme_names_a_task_module_a_conftest_and_two_tests() -> None:
    assert set(samples()) == {
        "proj/tasks.py",
        "tests/test_import.py",
        "tests/conftest.py",
        "tests/test_import_worker.py",
    }


def test_the_readmes_testing_samples_pass_as_written(pytester: pytest.Pytester) -> None:
    (pytester.path / "proj").mkdir()
    (pytester.path / "proj" / "__init__.py").write_text("")
    (pytester.path / "proj" / "celery.py").write_text(
        'from celery import Celery\n\napp = Celery("proj")\n'
    )
    (pytester.path / "tests").mkdir()
    for name, code in samples().items():
        (pytester.path / name).write_text(code)
    result = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "--rootdir", str(pytester.path), "tests", timeout=120
    )
    result.assert_outcomes(passed=2)
