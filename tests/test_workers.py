"""Engine workers, on the toy engine (fast): a crash or a hang costs one check, not the run;
the upgrade preview judges one environment's run against another's.

The same on real engines (a real SIGILL in llama.cpp, a real hang, a real mlx-lm release):
test_engine_upgrades.py.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.gate.engine_pythons import Environments, parse_assignments
from pytest_kvguard.isolation.workers import describe_exit

pytestmark = pytest.mark.usefixtures("fake_engine")

THREE_CHECKS = """\
version: 1
defaults:
  engine: fake
  model: tiny.gguf
  params: {tokens: 400, cap: 64}
checks:
  - name: toy-sink
    policy: sink
    params: {sinks: 1}
    budgets: {max_ppl_increase_pct: 20, max_kv_entries: 64}
    TIMEOUT
  - name: toy-window
    policy: window
    budgets: {max_ppl_increase_pct: 5}
    expect: violation
    reason: the toy forgets once its sink is gone
  - name: toy-replay
    scenario: edit_replay
    policy: full
    params: {followup: edit, message: -3}
    budgets: {min_reused_tokens: 100}
"""


def write_checks(gate: pytest.Pytester, timeout: str = "") -> None:
    gate.makefile(".yaml", budgets=THREE_CHECKS.replace("TIMEOUT", timeout))


def report_of(gate: pytest.Pytester) -> dict:  # type: ignore[type-arg]
    return json.loads((gate.path / "report.json").read_text())  # type: ignore[no-any-return]


def test_a_crashed_worker_costs_one_check_and_the_run_goes_on(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_checks(gate)
    monkeypatch.setenv("KVGUARD_FAKE_CRASH", "sink")  # the toy aborts decoding under sink
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "report.json")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*budgets.yaml:*: engine worker died: SIGABRT (aborted) while running toy-sink on fake",
        "*toy-window *CAUGHT*",
        "*1 check(s) lost to an engine worker that died or hung*: toy-sink",
    ])  # fmt: skip
    report = report_of(gate)
    rows = {c["name"]: c for c in report["checks"]}
    assert set(rows) == {"toy-sink", "toy-window", "toy-replay"}
    assert rows["toy-sink"]["verdict"] == "ERROR" and rows["toy-sink"]["lost"] is True
    assert "SIGABRT" in rows["toy-sink"]["error"]
    assert rows["toy-window"]["verdict"] == "CAUGHT" and rows["toy-replay"]["verdict"] == "PASS"
    assert report["missing_checks"] == [] and report["lost_checks"] == ["toy-sink"]
    assert report["verdict"] == "fail" and report["complete"] is False  # never a baseline


def test_a_crash_in_another_checks_policy_decoded_together_costs_only_that_check(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """toy-window runs first, and its window decodes together with toy-sink's planned sink
    policy, which aborts: toy-window is run again alone and judged; only toy-sink is lost."""
    head, sink, window, replay = THREE_CHECKS.replace("TIMEOUT", "").split("  - name: ")
    gate.makefile(".yaml", budgets="  - name: ".join([head, window, sink, replay]))
    monkeypatch.setenv("KVGUARD_FAKE_CRASH", "sink")
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "report.json")
    result.assert_outcomes(passed=2, failed=1)
    rows = {c["name"]: c for c in report_of(gate)["checks"]}
    assert rows["toy-window"]["verdict"] == "CAUGHT"
    assert rows["toy-sink"]["verdict"] == "ERROR" and "SIGABRT" in rows["toy-sink"]["error"]
    assert report_of(gate)["lost_checks"] == ["toy-sink"]


def test_a_hung_worker_is_killed_at_the_checks_time_limit(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_checks(gate, timeout="timeout: 2")
    monkeypatch.setenv("KVGUARD_FAKE_HANG", "sink")
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "report.json")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["*engine worker timed out after 2 s while running toy-sink on fake; killed*"]
    )
    report = report_of(gate)
    assert report["lost_checks"] == ["toy-sink"] and len(report["checks"]) == 3


def test_the_session_time_limit_applies_where_a_check_sets_none(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_checks(gate)
    monkeypatch.setenv("KVGUARD_FAKE_HANG", "window")
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-timeout", "2")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*timed out after 2 s while running toy-window on fake*"])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "timeout: 0",
            "budgets.yaml:11: timeout must be a finite number of seconds above 0, got 0",
        ),
        ("timeout: soon", "budgets.yaml:11: timeout must be a finite number of seconds above 0"),
        ("timeout: .inf", "budgets.yaml:11: timeout must be a finite number of seconds above 0"),
    ],
)
def test_a_bad_timeout_names_its_line(gate: pytest.Pytester, value: str, message: str) -> None:
    write_checks(gate, timeout=value)
    result = gate.runpytest("--kvguard", "budgets.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_a_bad_session_timeout_is_refused(gate: pytest.Pytester) -> None:
    write_checks(gate)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-timeout", "soon")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvguard-timeout 'soon' is not a number of seconds*"])


def _other_python(folder: Path, **environment: str) -> Path:
    """A stand-in for another environment's python: this interpreter under other variables."""
    script = folder / "other-python"
    unset = " ".join(f"-u {k}" for k, v in environment.items() if not v)
    sets = " ".join(f"{k}={v}" for k, v in environment.items() if v)
    script.write_text(f'#!/bin/sh\nexec env {unset} {sets} "{sys.executable}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_upgrade_preview_judges_this_run_against_the_other(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This environment's toy drops the cap (an upgrade that broke it); the other, 'older' one
    applies it. One pytest run shows both versions' figures and fails on what changed."""
    write_checks(gate)
    monkeypatch.setenv("KVGUARD_FAKE_NO_CAP", "1")
    monkeypatch.setenv("KVGUARD_FAKE_VERSION", "0.2-new")
    older = _other_python(gate.path, KVGUARD_FAKE_NO_CAP="", KVGUARD_FAKE_VERSION="0.1-old")
    result = gate.runpytest(
        "--kvguard", "budgets.yaml", f"--kvguard-against=fake={older}",
        "--kvguard-json", "report.json",
    )  # fmt: skip
    result.stdout.fnmatch_lines([
        f"kvguard upgrade preview: every check also runs against fake * ({older})",
        "upgrade preview (fake 0.1-old -> 0.2-new):",
        "*check*figure*against*this run*change*verdict*",
        "toy-sink *kv_bytes *4,096 *25,600 *+525.00% *FAIL",
        "*kv_entries *64 *400 *+525.00%",
    ])  # fmt: skip
    rows = {c["name"]: c for c in report_of(gate)["checks"]}
    sink = rows["toy-sink"]
    assert sink["verdict"] == "FAIL" and sink["baseline_status"] == "regressed"
    assert sink["against"]["engine_version"] == "0.1-old" and sink["engine_version"] == "0.2-new"
    assert sink["against"]["metrics"]["kv_entries"] == 64 and sink["metrics"]["kv_entries"] == 400
    regression = next(v for v in sink["violations"] if v.startswith("regressed against"))
    assert regression.startswith("regressed against fake 0.1-old (upgrade preview): ")
    assert "kv_entries 64 -> 400" in regression
    assert "fake 0.1-old -> 0.2-new" in sink["baseline_changes"]
    assert rows["toy-replay"]["baseline_status"] == "within tolerance"  # no cap to drop
    assert rows["toy-window"]["baseline_status"] == "not compared (negative control)"


def test_upgrade_preview_of_an_unchanged_engine_is_within_tolerance(gate: pytest.Pytester) -> None:
    write_checks(gate)
    result = gate.runpytest("--kvguard", "budgets.yaml", f"--kvguard-against={sys.executable}")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["toy-sink*(no compared figure changed)*PASS"])


def test_upgrade_preview_and_baseline_are_one_or_the_other(gate: pytest.Pytester) -> None:
    write_checks(gate)
    gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "report.json")
    result = gate.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-baseline", "report.json",
        f"--kvguard-against={sys.executable}",
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvguard-against and --kvguard-baseline*(fix: use one*"])


def test_engine_python_from_the_budgets_file_with_its_line(gate: pytest.Pytester) -> None:
    gate.makefile(
        ".yaml",
        budgets=THREE_CHECKS.replace("TIMEOUT", "") + "engine_python:\n  fake: no/such/python\n",
    )
    result = gate.runpytest("--kvguard", "budgets.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*budgets.yaml:23: engine_python.fake: no Python interpreter at *no/such/python*"
         "(fix: pass the python of a virtual environment (kvguard env*"]
    )  # fmt: skip


def test_engine_python_runs_the_engine_there(gate: pytest.Pytester) -> None:
    other = _other_python(gate.path, KVGUARD_FAKE_VERSION="9.9-elsewhere")
    write_checks(gate)
    result = gate.runpytest(
        "--kvguard", "budgets.yaml", f"--kvguard-engine-python=fake={other}", "-p", "no:xdist"
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"kvguard engine environment: fake * runs in {other}",
                                 "toy-sink*fake 9.9-elsewhere*PASS"])  # fmt: skip


def test_assignments_name_an_engine_and_an_interpreter(tmp_path: Path) -> None:
    assert parse_assignments([f"fake={sys.executable}"], "--x") == {"fake": sys.executable}
    assert parse_assignments([sys.executable], "--x", every_engine=True) == {"*": sys.executable}
    with pytest.raises(KvguardError, match="names no engine"):
        parse_assignments([sys.executable], "--x")
    with pytest.raises(KvguardError, match="unknown engine 'nope'"):
        parse_assignments([f"nope={sys.executable}"], "--x")
    with pytest.raises(KvguardError, match="no Python interpreter at"):
        parse_assignments([f"fake={tmp_path / 'python'}"], "--x")


def test_a_check_runs_its_engines_in_one_environment() -> None:
    split = Environments(python={"fake2": "/other/python"})
    assert split.python_for(["fake"]) == sys.executable
    with pytest.raises(KvguardError, match="different Python environments"):
        split.python_for(["fake", "fake2"])
    preview = Environments(against={"fake": "/old/python"})
    assert preview.against_for(["fake"]) == ("/old/python", None)
    assert preview.against_for(["fake2"]) == (None, None)
    assert preview.against_for(["fake", "fake2"]) == (
        None, "not previewed: fake2 has no --kvguard-against environment"
    )  # fmt: skip


def test_exit_statuses_read_as_causes() -> None:
    assert describe_exit(-4) == "SIGILL (illegal instruction)"
    assert describe_exit(-9) == "SIGKILL (killed; out of memory?)"
    assert describe_exit(-11) == "SIGSEGV (segmentation fault)"
    assert describe_exit(3) == "exit code 3"


def test_an_environment_that_cannot_start_a_worker_is_one_line_per_check(
    gate: pytest.Pytester,
) -> None:
    """Not a crash: the worker never got to a check, so no check counts as lost."""
    broken = gate.path / "broken-python"
    broken.write_text(
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'gguf'\" >&2\nexit 1\n"
    )
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    write_checks(gate)
    result = gate.runpytest(
        "--kvguard", "budgets.yaml", f"--kvguard-engine-python=fake={broken}",
        "--kvguard-json", "report.json",
    )  # fmt: skip
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines([
        f"*budgets.yaml:7: the engine worker could not start with {broken}: "
        "ModuleNotFoundError: No module named 'gguf' (fix: check that environment has the engine*"
    ])  # fmt: skip
    report = report_of(gate)
    assert report["lost_checks"] == [] and {c["verdict"] for c in report["checks"]} == {"ERROR"}
