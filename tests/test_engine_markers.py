"""The per-engine markers of tests/conftest.py: a test that needs an engine is skipped, with the
reason, only where that engine is not installed; an engine test that names no engine fails."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import conftest
import pytest

from pytest_kvguard.engines import ENGINES

HOOKS = f"""
import importlib.util

spec = importlib.util.spec_from_file_location("suite_conftest", {str(Path(conftest.__file__))!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
pytest_runtest_setup = suite.pytest_runtest_setup


def pytest_configure(config):
    for name in ("engine", *suite.ENGINE_MARKERS):
        config.addinivalue_line("markers", name)
"""

TESTS = """
import pytest

@pytest.mark.mlx
def test_needs_mlx():
    pass

@pytest.mark.llama_cpp
def test_needs_llama_cpp():
    pass

@pytest.mark.engine
def test_names_no_engine():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """The suite's hooks where mlx is missing and llama_cpp is installed (whatever is here)."""
    monkeypatch.setitem(ENGINES, "mlx", replace(ENGINES["mlx"], import_name="no_such_mlx_lm"))
    monkeypatch.setitem(ENGINES, "llama_cpp", replace(ENGINES["llama_cpp"], import_name="json"))
    pytester.makeconftest(HOOKS)
    pytester.makepyfile(TESTS)
    pytester.makeini("[pytest]\naddopts = -p no:randomly\n")
    return pytester


def test_a_missing_engine_skips_with_the_reason_and_a_present_one_runs(
    suite: pytest.Pytester,
) -> None:
    result = suite.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1, errors=1)  # refused at setup
    result.stdout.fnmatch_lines(
        [
            "*test_names_no_engine is marked engine but names no engine*",
            "SKIPPED *engine mlx is not installed (pip install *pytest-kvguard[[]mlx[]]*",
        ],
        consecutive=False,
    )


def test_a_per_engine_marker_makes_an_engine_test(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-m", "not engine")
    result.assert_outcomes(deselected=3)
