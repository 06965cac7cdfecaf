"""The kvguard session object (plugin/session.py), on the toy engine (fast): one place judges
budgets-file items and fixture tests alike, and a failure of the whole session is pytest's exit
status, never a failed-test count."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

import pytest_kvguard
from pytest_kvguard.gate.outcome import Outcome
from pytest_kvguard.plugin.session import Against, KvguardSession, Verdict
from pytest_kvguard.scenarios.base import Check

pytestmark = pytest.mark.usefixtures("fake_engine")

SAME_CHECK = """\
version: 1
checks:
  - name: forgets
    engine: fake
    model: tiny.gguf
    policy: window
    params: {tokens: 400, cap: 64}
    budgets: {max_ppl_increase_pct: 5}
"""
SAME_TEST = """
import pytest

@pytest.mark.kv_budget(max_ppl_increase_pct=5)
def test_forgets(kvguard):
    kvguard.stream(engine="fake", model="tiny.gguf", policy="window", cap=64, tokens=400)
"""


def test_an_item_and_a_fixture_test_are_judged_by_the_session_alike(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same failing check, declared in a budgets file and run from a marked test: both go
    through ``KvguardSession.judge`` and fail with the same text (the item adds its line)."""
    judged: list[tuple[str, Verdict]] = []
    judge = KvguardSession.judge

    def spy(
        self: KvguardSession, check: Check[Any], outcome: Outcome, against: Against | None = None
    ) -> Verdict:
        verdict = judge(self, check, outcome, against)
        judged.append((check.where, verdict))
        return verdict

    monkeypatch.setattr(KvguardSession, "judge", spy)
    gate.makefile(".yaml", budgets=SAME_CHECK)
    gate.makepyfile(test_same=SAME_TEST)
    result = gate.runpytest("--kvguard", "budgets.yaml", "test_same.py")
    result.assert_outcomes(failed=2)
    assert sorted(where for where, _ in judged) == ["budgets.yaml:3", "test_same.py::test_forgets"]
    (item_failure, fixture_failure) = [v.failure for _, v in sorted(judged, key=lambda j: j[0])]
    assert item_failure is not None and item_failure.startswith("max_ppl_increase_pct: ")
    assert item_failure == fixture_failure
    assert all(v.outcome.verdict == "FAIL" for _, v in judged)
    result.stdout.fnmatch_lines([f"{item_failure} [[]budgets.yaml:3]"])
    result.stdout.fnmatch_lines([item_failure])


def test_judge_compares_with_the_baseline_or_the_other_run_and_says_why_it_fails(
    gate: pytest.Pytester,
) -> None:
    """``judge`` alone, on a real outcome: a passing run passes; against another run that
    failed, it fails naming that run; a run not compared keeps its outcome and says why."""
    holds = SAME_CHECK.replace("window", "sink").replace("cap: 64", "cap: 64, sinks: 1")
    gate.makefile(
        ".yaml", budgets=holds.replace("max_ppl_increase_pct: 5", "max_ppl_increase_pct: 20")
    )
    gate.makepyfile(
        test_judge="""
from pytest_kvguard.plugin.session import Against, KvguardSession

def test_judge(pytestconfig):
    session = KvguardSession.of(pytestconfig)
    (check,) = session.budgets_file.checks
    passed = session.run(check)
    assert passed.passed and passed.failure is None and passed.outcome.verdict == "PASS"
    failed = session.judge(check, passed.outcome, Against("/other/python", error="it died"))
    assert failed.failure == "upgrade preview: the run in /other/python failed: it died"
    assert not failed.passed and failed.outcome.baseline_status == "preview failed"
    skipped = session.judge(check, passed.outcome, Against(not_compared="not previewed: why"))
    assert skipped.passed and skipped.outcome.baseline_status == "not previewed: why"
"""
    )
    result = gate.runpytest("--kvguard", "budgets.yaml", "test_judge.py")
    result.assert_outcomes(passed=2)  # the check, and the test that judged it again


def test_a_session_level_failure_is_the_exit_status_not_a_failed_test(
    gate: pytest.Pytester,
) -> None:
    gate.makepyfile(
        test_fine="""
from pytest_kvguard.plugin.session import KvguardSession

def test_fine(pytestconfig):
    KvguardSession.of(pytestconfig).fail("kvguard: the whole run fails for this reason")
"""
    )
    recorder = gate.inline_run("--kvguard-json", "report.json")
    recorder.assertoutcome(passed=1)
    assert recorder.ret == pytest.ExitCode.TESTS_FAILED
    finished = recorder.getcall("pytest_sessionfinish")
    assert finished.session.testsfailed == 0
    assert finished.session.exitstatus == pytest.ExitCode.TESTS_FAILED
    result = gate.runpytest("--kvguard-json", "report.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["kvguard: the whole run fails for this reason", "*1 passed*"])
    assert '"pytest_exitstatus": 1' in (gate.path / "report.json").read_text()


def test_a_session_level_failure_leaves_a_worse_exit_status_alone(gate: pytest.Pytester) -> None:
    gate.makepyfile(
        test_bad="""
import pytest
from pytest_kvguard.plugin.session import KvguardSession

def test_bad(pytestconfig):
    KvguardSession.of(pytestconfig).fail("kvguard: a reason")
    pytest.exit("stopped", returncode=pytest.ExitCode.INTERNAL_ERROR)
"""
    )
    result = gate.runpytest()
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR


def test_nothing_in_kvguard_assigns_testsfailed() -> None:
    """pytest counts failed tests; kvguard fails a session through its exit status."""
    package = Path(pytest_kvguard.__file__).parent
    assigned = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            named = any(isinstance(t, ast.Attribute) and t.attr == "testsfailed" for t in targets)
            if named or (isinstance(node, ast.Constant) and node.value == "testsfailed"):
                assigned.append(f"{path.relative_to(package)}:{node.lineno}")
    assert assigned == []
