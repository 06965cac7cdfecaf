"""The per-engine markers of tests/conftest.py: a test that needs an engine is skipped, with the
reason, only where that engine is not installed, and fails with that reason instead where
engines are required (--require-engines, $KVGUARD_REQUIRE_ENGINES=1: .ci/run sets it); an engine
test that names no engine fails."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import conftest
import pytest

from pytest_kvguard.engines import ENGINES

ROOT = Path(__file__).resolve().parents[1]
REQUIRE = conftest.REQUIRE_ENGINES_ENV

HOOKS = f"""
import importlib.util

import pytest

spec = importlib.util.spec_from_file_location("suite_conftest", {str(Path(conftest.__file__))!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_addoption = suite.pytest_addoption
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
pytest_runtest_setup = suite.pytest_runtest_setup


def pytest_configure(config):
    suite.pytest_configure(config)
    for name in ("engine", *suite.ENGINE_MARKERS):
        config.addinivalue_line("markers", name)


@pytest.fixture
def not_installed(request):
    return lambda reason: suite.skip_or_fail(request.config, reason)
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
    """The suite's hooks where mlx is missing and llama_cpp is installed (whatever is here),
    engines not required (whatever the environment says: .ci/run requires them)."""
    monkeypatch.delenv(REQUIRE, raising=False)
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


MLX_REFUSED = [
    "*ERROR at setup of test_needs_mlx*",
    'engine mlx is not installed (pip install "pytest-kvguard[[]mlx[]]") '
    "(required here: KVGUARD_REQUIRE_ENGINES=1 or --require-engines)",
]
"""The mlx test's error: the reason it would be skipped for, on one line, and the setting."""


@pytest.mark.parametrize("how", ["variable", "option"])
def test_where_engines_are_required_a_missing_engine_fails_its_test_with_the_reason(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "variable":
        monkeypatch.setenv(REQUIRE, "1")
    result = suite.runpytest("-rs", *(["--require-engines"] if how == "option" else []))
    # Not a skip: the mlx test fails at setup, the run with it (exit 1).
    result.assert_outcomes(passed=1, errors=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(MLX_REFUSED, consecutive=True)
    result.stdout.no_fnmatch_line("SKIPPED *")


@pytest.mark.parametrize("value", ["0", "", "off"])
def test_the_variable_turned_off_keeps_the_skip(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(REQUIRE, value)
    result = suite.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the unnamed engine test, as ever
    result.stdout.fnmatch_lines(["SKIPPED *engine mlx is not installed (pip install *"])


def test_a_value_neither_on_nor_off_is_a_usage_error(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A typo must not turn the rule off unseen.
    monkeypatch.setenv(REQUIRE, "ture")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: KVGUARD_REQUIRE_ENGINES='ture' is neither on nor off (fix: set it to 1 or 0)"]
    )


def test_a_test_that_finds_its_engine_missing_as_it_runs_follows_the_same_rule(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tests/test_engine_layout.py's way, for an adapter whose engine has no marker.
    suite.makepyfile(
        test_runtime="def test_it(not_installed):\n"
        "    not_installed('engine ghost is not installed')\n"
    )
    skipped = suite.runpytest("-rs", "test_runtime.py")
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines(["SKIPPED *engine ghost is not installed"])
    monkeypatch.setenv(REQUIRE, "1")
    failed = suite.runpytest("test_runtime.py")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(
        [
            "*_ test_it _*",
            "engine ghost is not installed "
            "(required here: KVGUARD_REQUIRE_ENGINES=1 or --require-engines)",
        ],
        consecutive=True,
    )


def test_ci_requires_every_engine_for_the_test_suite() -> None:
    """.ci/run exports the variable before README command 2, which it runs as printed."""
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    exported = lines.index(f"export {REQUIRE}=1")
    suite_run = next(i for i, line in enumerate(lines) if line.startswith("bash .ci/install test"))
    assert exported < suite_run
