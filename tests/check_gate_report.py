"""Checks of a gate run's JSON report, for a run pytest did not make itself: .ci/run runs the
quick gate (README command 1) and .ci/nightly the full bundled gate, then, for each,

    pytest tests/check_gate_report.py --gate-report kvguard-report.json

The report must be complete, passed and schema-valid, of the budgets file as it is now; each
row must give the verdict its check expects with consistent figures (gate_invariants); checks
that must agree across engines agree; and the quoted output of that budgets file, in README.md
and docs/**/*.md, is what the report measured. Not part of the test suite (its name does not
start with test_): it needs a report.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import GATE_REPORT
from gate_invariants import (
    FULL,
    QUICK,
    ROOT,
    SERVED_AGREEMENTS,
    assert_agreements,
    assert_row_holds,
    measured_on,
    readme_drift,
)

from pytest_kvguard.gate.budgets_file import BudgetsFile, load_budgets_file
from pytest_kvguard.gate.report import report_schema


def documentation() -> str:
    """README and every page of docs/: where quoted gate output may sit."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(page.read_text(encoding="utf-8") for page in pages)


def _report(config: pytest.Config) -> dict[str, Any]:
    """The report given with --gate-report (read and checked by conftest's pytest_configure)."""
    return config.stash[GATE_REPORT]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "row" in metafunc.fixturenames:
        rows = _report(metafunc.config)["checks"]
        metafunc.parametrize("row", rows, ids=[row["name"] for row in rows])


@pytest.fixture(scope="module")
def report(pytestconfig: pytest.Config) -> dict[str, Any]:
    return _report(pytestconfig)


@pytest.fixture(scope="module")
def budgets(report: dict[str, Any]) -> BudgetsFile:
    """The budgets file the report names, relative to the repository root where it is."""
    path = Path(report["budgets_file"])
    path = (path if path.is_absolute() else ROOT / path).resolve()
    if not path.is_relative_to(ROOT.resolve()):
        pytest.fail(
            f"the report is of {path}, outside this repository: README quotes and this check "
            "knows only the repository's budgets files",
            pytrace=False,
        )
    return load_budgets_file(path)


@pytest.fixture(scope="module")
def rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["checks"]}


def test_the_report_is_complete_passed_and_schema_valid(report: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(report, report_schema())
    red = [(r["name"], r["verdict"]) for r in report["checks"]
           if r["verdict"] not in ("PASS", "CAUGHT")]  # fmt: skip
    assert report["complete"] and report["verdict"] == "pass", (
        report["missing_checks"], report["lost_checks"], red)  # fmt: skip


def test_the_report_is_of_its_budgets_file_as_it_is_now(
    report: dict[str, Any], budgets: BudgetsFile
) -> None:
    assert report["budgets_sha256"] == budgets.sha256, "the budgets file changed since the run"
    assert [row["name"] for row in report["checks"]] == [c.name for c in budgets.checks]


def test_check(row: dict[str, Any], budgets: BudgetsFile) -> None:
    check = next(c for c in budgets.checks if c.name == row["name"])
    assert_row_holds(row, check)


def test_checks_that_must_agree_agree(
    rows: dict[str, dict[str, Any]], budgets: BudgetsFile
) -> None:
    applied = assert_agreements(rows)
    if budgets.path.resolve() == FULL.resolve():  # the full file has every pair
        assert len(applied) == 8, applied
    elif budgets.path.resolve() == QUICK.resolve():
        assert applied == SERVED_AGREEMENTS


def test_readme_quotes_what_the_report_measured(
    report: dict[str, Any], budgets: BudgetsFile
) -> None:
    compared, drift, everything = readme_drift(
        documentation(),
        str(budgets.path.relative_to(ROOT)),
        report["checks"],
        report["machine"],
    )
    assert not drift, "\n".join(drift)
    assert compared > 0
    if not everything:
        warnings.warn(
            f"README's output of {budgets.path.name} was measured on another machine or engine "
            f"version than this report ({measured_on(report['machine'])}): only its "
            f"machine-independent columns were compared ({compared} cells)",
            stacklevel=1,
        )
