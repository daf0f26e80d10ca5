"""The package's metadata says what is true: its license, its floors, the versions CI tests."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

# The floors and the SQLAlchemy bound are what the version matrix changes: these run there too
# (tests/conftest.py cannot see the imports inside their bodies).
pytestmark = pytest.mark.versions

ROOT = Path(__file__).resolve().parents[2]
META = importlib.metadata.metadata("celery-leases")


def floors() -> dict[str, str]:
    """Package (lower case) -> the version after ``>=`` in its requirement."""
    found = {}
    for text in META.get_all("Requires-Dist") or []:
        requirement = Requirement(text)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                found[requirement.name.lower()] = spec.version
    return found


def test_the_license_is_bsd_3_clause_as_an_spdx_expression_with_its_file() -> None:
    assert META["License-Expression"] == "BSD-3-Clause"
    assert META.get_all("License-File") == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License\n")


def test_every_pin_of_the_oldest_matrix_entry_is_a_floor_the_package_declares() -> None:
    pins = dict(
        line.split("==")
        for line in (ROOT / "scripts/matrix/oldest.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    declared = floors()

    for name, version in pins.items():
        if name.lower() == "psycopg-binary":
            name = "psycopg"  # the wheel behind psycopg[binary]
        assert declared[name.lower()] == version, name
    assert declared["celery"] == "5.7.0"  # LeasedTask.retry_on_worker_lost needs 5.7


def test_the_python_classifiers_span_the_interpreters_the_matrix_runs() -> None:
    classifiers = META.get_all("Classifier") or []
    versions = [c.rsplit(" ", 1)[1] for c in classifiers if re.fullmatch(r".*Python :: 3\.\d+", c)]
    matrix = (ROOT / "scripts/matrix.sh").read_text()

    assert META["Requires-Python"] == f">={versions[0]}"
    assert f"/bin/python{versions[0]}" in matrix
    assert f"/bin/python{versions[-1]}" in matrix


def test_the_changelog_has_an_entry_for_this_version_or_unreleased_changes() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()

    assert "## [Unreleased]" in changelog or f"## [{META['Version']}]" in changelog


def test_sqlalchemy_is_bounded_below_its_next_minor_release_and_has_what_the_fast_path_calls() -> (
    None
):
    # The DBAPI fast path (celery_leases/db/dbapi.py) calls one private SQLAlchemy function;
    # the bound keeps releases that may drop it out, and the matrix's newest entry runs this
    # test on the newest release the bound admits.
    from sqlalchemy.sql.compiler import SQLCompiler

    (requirement,) = [
        Requirement(text)
        for text in META.get_all("Requires-Dist") or []
        if Requirement(text).name.lower() == "sqlalchemy"
    ]
    ceilings = [spec for spec in requirement.specifier if spec.operator == "<"]
    assert len(ceilings) == 1 and re.fullmatch(r"2\.\d+", ceilings[0].version), ceilings
    assert callable(getattr(SQLCompiler, "_process_parameters_for_postcompile", None))
