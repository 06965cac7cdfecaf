"""The plugin's pytest mechanics, on the toy engine (fast). Real engines: test_llama_cpp.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

pytestmark = pytest.mark.usefixtures("fake_engine")

CHECKS = """\
version: 1
defaults:
  engine: fake
  model: tiny.gguf
  params: {{tokens: 400, cap: 64}}
checks:
  - name: toy-sink
    policy: sink
    params: {{sinks: 1}}
    budgets: {{max_ppl_increase_pct: {sink_budget}, max_kv_entries: 64}}
  - name: toy-window
    policy: window
    budgets: {{max_ppl_increase_pct: 5}}
    expect: violation
    reason: the toy forgets once its sink is gone
"""


def write_budgets(pytester: pytest.Pytester, sink_budget: float = 20) -> Path:
    return pytester.makefile(".yaml", budgets=CHECKS.format(sink_budget=sink_budget))


def test_gate_passes_and_catches_negative_control(gate: pytest.Pytester) -> None:
    write_budgets(gate)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "out/report.json")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*= kvguard =*", "toy-sink *PASS", "toy-window *CAUGHT"])
    report = json.loads((gate.path / "out/report.json").read_text())
    assert report["verdict"] == "pass" and report["complete"] is True
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert verdicts == {"toy-sink": "PASS", "toy-window": "CAUGHT"}
    sink = next(c for c in report["checks"] if c["name"] == "toy-sink")
    assert sink["metrics"]["first_eviction"] == 64
    assert sink["metrics"]["kv_entries"] == 64
    assert len(sink["model_sha256"]) == 64 and sink["engine_version"] == "0.0-test"


def collected_ids(result: pytest.RunResult) -> set[str]:
    """The node ids ``--collect-only -q`` printed, in whatever order they were collected
    (pytest-randomly shuffles it)."""
    return {line for line in result.outlines if "::" in line and " " not in line}


def test_only_the_checks_run_without_test_paths(gate: pytest.Pytester) -> None:
    write_budgets(gate)
    gate.makepyfile(test_other="def test_other():\n    pass\n")
    result = gate.runpytest("--kvguard", "budgets.yaml", "--collect-only", "-q")
    assert collected_ids(result) == {"budgets.yaml::toy-sink", "budgets.yaml::toy-window"}
    both = gate.runpytest("--kvguard", "budgets.yaml", "test_other.py", "--collect-only", "-q")
    assert collected_ids(both) == {
        "test_other.py::test_other",
        "budgets.yaml::toy-sink",
        "budgets.yaml::toy-window",
    }


def test_collect_only_warns_of_no_check_that_never_ran(gate: pytest.Pytester) -> None:
    """Nothing runs under --collect-only, so no check is missing from the run, and no report
    is written that a CI job could read as a gate run (an earlier one is left alone)."""
    write_budgets(gate)
    (gate.path / "r.json").write_text("earlier")
    result = gate.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-json", "r.json", "--collect-only", "-q"
    )
    assert result.ret == pytest.ExitCode.OK
    assert len(collected_ids(result)) == 2
    result.stdout.no_fnmatch_line("*never ran*")
    result.stdout.fnmatch_lines(["kvguard: --collect-only: no JSON report written"])
    assert (gate.path / "r.json").read_text() == "earlier"


def test_k_selects_checks(gate: pytest.Pytester) -> None:
    write_budgets(gate)
    result = gate.runpytest("--kvguard", "budgets.yaml", "-k", "sink")
    result.assert_outcomes(passed=1, deselected=1)


@pytest.mark.parametrize(
    ("offset", "passes"), [(-0.01, False), (0.0, True), (0.01, True)], ids=["below", "at", "above"]
)
def test_budget_edge_on_the_measured_value(
    gate: pytest.Pytester, offset: float, passes: bool
) -> None:
    # First learn the exact measured increase, then set the budget just below, at and above it.
    write_budgets(gate, sink_budget=1000)
    gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json", "-k", "sink")
    measured = json.loads((gate.path / "r.json").read_text())["checks"][0]["metrics"]
    limit = measured["ppl_increase_pct"] + offset
    write_budgets(gate, sink_budget=limit)
    result = gate.runpytest("--kvguard", "budgets.yaml", "-k", "sink")
    if passes:
        result.assert_outcomes(passed=1, deselected=1)
    else:
        result.assert_outcomes(failed=1, deselected=1)


def test_tightened_budget_fails_with_one_line(gate: pytest.Pytester) -> None:
    write_budgets(gate, sink_budget=0)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    assert result.ret == 1
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "_* kvguard check toy-sink _*",
            "max_ppl_increase_pct: post-eviction perplexity increase over baseline budget 0%, "
            "measured *% [[]budgets.yaml:7]",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    result.stdout.fnmatch_lines(["toy-sink *FAIL"])
    assert json.loads((gate.path / "r.json").read_text())["verdict"] == "fail"


def test_negative_control_that_passes_fails_the_run(gate: pytest.Pytester) -> None:
    gate.makefile(
        ".yaml",
        budgets=CHECKS.format(sink_budget=20).replace(
            "max_ppl_increase_pct: 5}", "max_kv_entries: 64}"
        ),
    )
    result = gate.runpytest("--kvguard", "budgets.yaml")
    assert result.ret == 1
    result.stdout.fnmatch_lines(
        [
            "negative control not caught: window/64 reidx step1 stayed within kv<=64 "
            "*[[]budgets.yaml:11]"
        ]
    )
    result.stdout.fnmatch_lines(["toy-window *MISSED"])


def test_engine_failure_is_an_error_row_not_a_pass(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_budgets(gate)
    monkeypatch.setenv("KVGUARD_FAKE_FAIL", "1")
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["budgets.yaml:7: fake decode failed (KVGUARD_FAKE_FAIL is set)"])
    result.stdout.no_fnmatch_line("*Traceback*")
    report = json.loads((gate.path / "r.json").read_text())
    assert report["verdict"] == "fail"
    assert {c["verdict"] for c in report["checks"]} == {"ERROR"}


def test_partial_run_is_not_a_pass(gate: pytest.Pytester) -> None:
    write_budgets(gate, sink_budget=0)
    result = gate.runpytest("--kvguard", "budgets.yaml", "-x", "--kvguard-json", "r.json")
    result.assert_outcomes(failed=1)
    report = json.loads((gate.path / "r.json").read_text())
    assert report["complete"] is False and report["verdict"] == "fail"
    assert report["missing_checks"] == ["budgets.yaml::toy-window"]


def test_lf_reruns_only_the_failed_check(gate: pytest.Pytester) -> None:
    write_budgets(gate, sink_budget=0)
    gate.runpytest("--kvguard", "budgets.yaml")
    result = gate.runpytest("--kvguard", "budgets.yaml", "--lf")
    result.assert_outcomes(failed=1, deselected=1)


def test_junit_carries_the_figures(gate: pytest.Pytester) -> None:
    write_budgets(gate)
    gate.runpytest("--kvguard", "budgets.yaml", "--junitxml", "junit.xml")
    case = ElementTree.parse(gate.path / "junit.xml").find(".//testcase[@name='toy-sink']")
    assert case is not None
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert properties["kvguard.verdict"] == "PASS"
    assert properties["kvguard.kv_entries"] == "64"
    assert float(properties["kvguard.ppl_increase_pct"]) > 0
    assert json.loads(properties["kvguard"])["name"] == "toy-sink"


def test_step_summary_is_markdown_on_github_actions(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = gate.path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    write_budgets(gate, sink_budget=0)
    gate.runpytest("--kvguard", "budgets.yaml")
    text = summary.read_text()
    assert text.startswith("earlier step\n## kvguard: FAIL\n")  # appended, never overwritten
    assert "| check " in text and "| toy-window " in text and "CAUGHT" in text
    assert "- **toy-sink** (FAIL): max_ppl_increase_pct: " in text


BASELINE_CHECKS = (
    CHECKS
    + """baseline_tolerances:
  post_eviction_ppl: 2%
"""
)


def _save_baseline(gate: pytest.Pytester) -> dict[str, Any]:
    gate.makefile(".yaml", budgets=BASELINE_CHECKS.format(sink_budget=20))
    gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "base.json")
    report: dict[str, Any] = json.loads((gate.path / "base.json").read_text())
    return report


def test_same_run_against_its_own_baseline_passes(gate: pytest.Pytester) -> None:
    _save_baseline(gate)
    result = gate.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-baseline", "base.json", "--kvguard-json", "r.json"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["kvguard baseline: base.json (2 checks, saved *)"])
    result.stdout.no_fnmatch_line("*WARNING*")
    statuses = {c["name"]: c["baseline_status"] for c in json.loads(
        (gate.path / "r.json").read_text())["checks"]}  # fmt: skip
    assert statuses == {
        "toy-sink": "within tolerance",
        "toy-window": "not compared (negative control)",
    }


def test_baseline_better_than_reality_fails_naming_figure_values_and_upgrades(
    gate: pytest.Pytester,
) -> None:
    report = _save_baseline(gate)
    sink = next(c for c in report["checks"] if c["name"] == "toy-sink")
    real = sink["metrics"]["post_eviction_ppl"]
    sink["metrics"]["post_eviction_ppl"] = real / 1.05  # the baseline claims 5% better
    sink["engine_version"] = "0.0-old"
    sink["model_sha256"] = "0" * 64
    (gate.path / "base.json").write_text(json.dumps(report))
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-baseline", "base.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["kvguard: changed since the baseline: fake 0.0-old -> 0.0-test (1 check); model *"]
    )
    result.stdout.fnmatch_lines(
        [
            f"regressed against baseline: post_eviction_ppl {real / 1.05:,.4g} -> {real:,.4g} "
            "(+5.00%), tolerance +2% [[]since baseline: fake 0.0-old -> 0.0-test; "
            "model tiny.gguf sha256 000000000000 -> *] [[]budgets.yaml:7]"
        ]
    )


def test_baseline_from_another_machine_is_compared_but_said_loudly(gate: pytest.Pytester) -> None:
    report = _save_baseline(gate)
    report["machine"]["cpu"] = "Apple M3 Max"
    (gate.path / "base.json").write_text(json.dumps(report))
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-baseline", "base.json")
    result.assert_outcomes(passed=2)
    warning = "kvguard WARNING: the baseline comes from a different machine (cpu Apple M3 Max -> *"
    result.stdout.fnmatch_lines([warning, "*", warning])  # in the header and at the end


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "base.json:1: baseline is not JSON*"),
        ('{"schema": 1, "complete": false, "missing_checks": ["x"], "checks": []}',
         "baseline base.json comes from an incomplete run (missing: x)*"),
        ('{"schema": 99}', "base.json is not a kvguard report of schema 1*"),
    ],
    ids=["not_json", "incomplete", "schema"],
)  # fmt: skip
def test_unusable_baseline_is_a_usage_error(
    gate: pytest.Pytester, content: str, message: str
) -> None:
    write_budgets(gate)
    (gate.path / "base.json").write_text(content)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-baseline", "base.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])


def test_report_header_names_budgets_engine_and_model(gate: pytest.Pytester) -> None:
    write_budgets(gate)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--collect-only")
    result.stdout.fnmatch_lines(
        ["kvguard: budgets *budgets.yaml (2 checks, sha256 *)", "kvguard engines: fake *",
         "kvguard model: tiny.gguf = *tiny.gguf"]
    )  # fmt: skip


MARKER_TEST = """
import pytest

@pytest.mark.kv_budget(max_ppl_increase_pct={budget})
def test_sink_holds(kvguard):
    result = kvguard.stream(engine="fake", model="tiny.gguf", policy="{policy}", cap=64,
                            sinks={sinks}, tokens=400)
    assert result.metrics["first_eviction"] == 64
"""


def test_marker_budget_passes(gate: pytest.Pytester) -> None:
    gate.makepyfile(MARKER_TEST.format(budget=20, policy="sink", sinks=1))
    result = gate.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["test_sink_holds *PASS"])


def test_marker_budget_violation_is_one_line(gate: pytest.Pytester) -> None:
    gate.makepyfile(MARKER_TEST.format(budget=5, policy="window", sinks=None))
    result = gate.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["max_ppl_increase_pct: post-eviction perplexity increase over baseline budget 5%, "
         "measured *%"]
    )  # fmt: skip


def test_marker_memory_budgets_in_human_units(gate: pytest.Pytester) -> None:
    # The toy holds 64 B per entry: 64 entries = 4 KiB at the cap, and it stays there.
    gate.makepyfile(
        """
import pytest

@pytest.mark.kv_budget(bounded=True, max_kv_bytes="4 KiB")
def test_within(kvguard):
    kvguard.stream(engine="fake", model="tiny.gguf", policy="sink", cap=64, sinks=1, tokens=400)

@pytest.mark.kv_budget(max_kv_bytes="3 KiB")
def test_over(kvguard):
    kvguard.stream(engine="fake", model="tiny.gguf", policy="sink", cap=64, sinks=1, tokens=400)
"""
    )
    result = gate.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*max_kv_bytes: KV bytes held at the end budget 3.00 KiB, measured 4.00 KiB*"]
    )


def test_marker_without_scenario_fails(gate: pytest.Pytester) -> None:
    gate.makepyfile(
        "import pytest\n@pytest.mark.kv_budget(max_kv_entries=10)\ndef test_x():\n    pass\n"
    )
    result = gate.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ran no kvguard scenario*"])


def test_misspelt_marker_budget_is_a_usage_error(gate: pytest.Pytester) -> None:
    gate.makepyfile(
        "import pytest\n@pytest.mark.kv_budget(max_ppl_increse_pct=10)\ndef test_x():\n    pass\n"
    )
    result = gate.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: *test_x: bad @pytest.mark.kv_budget: *max_ppl_increse_pct*"]
    )


BAD_INPUTS = {
    "malformed": (
        "version: 1\nchecks:\n  - name: a\n    policy: [sink\n",
        "budgets.yaml:4: malformed YAML*",
    ),
    "wrong_type": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    policy: sink\n    params: {cap: many}\n",
        "budgets.yaml:7: params.cap must be an integer, got 'many'*",
    ),
    "unknown_key": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    polcy: sink\n",
        "budgets.yaml:6: unknown check key 'polcy' (fix: did you mean 'policy'?*",
    ),
    "unknown_policy": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    policy: sinks\n    params: {cap: 64}\n",
        "budgets.yaml:6: unknown policy 'sinks' (fix: use one of full, window, sink, swa, *",
    ),
    "unknown_scenario": (
        "version: 1\nchecks:\n  - name: a\n    scenario: stram\n",
        "budgets.yaml:4: unknown scenario 'stram' (fix: did you mean 'stream'?*",
    ),
    "unknown_budget": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    policy: sink\n    params: {cap: 64, tokens: 400}\n    budgets:\n      max_ppl: 3\n",
        "budgets.yaml:9: unknown budget 'max_ppl'*",
    ),
    "missing_model": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: gone.gguf\n",
        "budgets.yaml:5: model file 'gone.gguf' not found*",
    ),
    "unknown_model": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: llama-9000\n",
        "budgets.yaml:5: unknown model 'llama-9000' (fix: use one of smollm2-135m, gemma3-270m*",
    ),
    "engine_not_installed": (
        "version: 1\nchecks:\n  - name: a\n    engine: ghost\n",
        "budgets.yaml:4: engine 'ghost' is not installed (fix: pip install ghost)",
    ),
    "no_eviction": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    policy: sink\n    params: {cap: 64, tokens: 64}\n    budgets: {max_kv_entries: 9}\n",
        "budgets.yaml:7: tokens 64 <= cap 64: eviction would never start*",
    ),
    "version": ("version: 2\nchecks: []\n", "budgets.yaml:1: unsupported budgets file version 2*"),
    "missing_text": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    policy: sink\n    params: {cap: 64, tokens: 400, text: nope.txt}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:7: text file 'nope.txt' not found*",
    ),
    "memory_lengths_order": (
        "version: 1\nchecks:\n  - name: a\n    scenario: memory\n    engine: fake\n"
        "    model: tiny.gguf\n    policy: sink\n    params: {cap: 64, lengths: [512, 256]}\n"
        "    budgets: {max_kv_deviation_pct: 1}\n",
        "budgets.yaml:8: lengths must be distinct and ascending, got [[]512, 256] "
        "(fix: write lengths: [[]256, 512])",
    ),
    "bounded_without_cap": (
        "version: 1\nchecks:\n  - name: a\n    scenario: memory\n    engine: fake\n"
        "    model: tiny.gguf\n    policy: full\n    params: {lengths: [64, 128]}\n"
        "    budgets:\n      bounded: true\n",
        "budgets.yaml:10: bounded needs a policy with a cap and a run that goes past it*",
    ),
    "bounded_not_a_flag": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    policy: sink\n    params: {cap: 64, tokens: 400}\n    budgets:\n"
        "      bounded: yes please\n",
        "budgets.yaml:9: budget bounded must be true or false, got 'yes please'*",
    ),
    "bad_size": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    policy: sink\n    params: {cap: 64, tokens: 400}\n    budgets:\n"
        "      max_kv_bytes: 6 MB/s\n",
        "budgets.yaml:9: budget max_kv_bytes must be a size, got '6 MB/s'*",
    ),
    "bad_tolerance": (
        CHECKS.format(sink_budget=20) + "baseline_tolerances:\n  post_eviction_ppl: lots\n",
        "budgets.yaml:17: baseline tolerance for post_eviction_ppl must be a percentage*",
    ),
    "unknown_tolerance": (
        CHECKS.format(sink_budget=20) + "baseline_tolerances:\n  post_eviction_pp: 2%\n",
        "budgets.yaml:17: unknown baseline figure 'post_eviction_pp' (fix: did you mean "
        "'post_eviction_ppl'?*",
    ),
    "sweep_with_policy": (
        "version: 1\nchecks:\n  - name: a\n    scenario: sweep\n    engine: fake\n"
        "    model: tiny.gguf\n    policy: sink\n    params: {cap: 64, tokens: 400}\n"
        "    budgets: {min_sink_gain_pct: 1}\n",
        "budgets.yaml:7: a sweep chooses its policies (0 sinks: window; more: sink)*",
    ),
    "sweep_sinks_past_cap": (
        "version: 1\nchecks:\n  - name: a\n    scenario: sweep\n    engine: fake\n"
        "    model: tiny.gguf\n    params: {cap: 64, tokens: 400, sinks: [0, 63]}\n"
        "    budgets: {min_sink_gain_pct: 1}\n",
        "budgets.yaml:7: 63 sinks leave no room under cap 64*",
    ),
    "recall_budget_not_a_flag": (
        "version: 1\nchecks:\n  - name: a\n    scenario: recall\n    engine: fake\n"
        "    model: tiny.gguf\n    policy: full\n    budgets:\n      must_recall: 1\n",
        "budgets.yaml:9: budget must_recall must be true or false, got 1*",
    ),
    "control_without_reason": (
        "version: 1\nchecks:\n  - name: a\n    engine: fake\n    model: tiny.gguf\n"
        "    policy: window\n    params: {cap: 64, tokens: 400}\n    budgets: {max_kv_entries: 9}\n"
        "    expect: violation\n",
        "budgets.yaml:9: a negative control needs a reason*",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_without_traceback(gate: pytest.Pytester, case: str) -> None:
    text, expected = BAD_INPUTS[case]
    gate.makefile(".yaml", budgets=text)
    result = gate.runpytest("--kvguard", "budgets.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: *{expected}"])
    errors = [line for line in result.stderr.lines if line.strip()]
    assert len(errors) == 1, errors
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_missing_budgets_file(gate: pytest.Pytester) -> None:
    result = gate.runpytest("--kvguard", "nope.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: *nope.yaml: cannot read budgets file: No such file*"])


def test_help_does_not_import_an_engine(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--help",
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        ["kvguard: KV-cache policy regression gate:", "*--kvguard=BUDGETS_YAML*"]
    )
    probe = pytester.makepyfile(
        probe="""
import sys, subprocess
import pytest
pytest.main(["--help"])
assert "llama_cpp" not in sys.modules, "pytest --help imported llama_cpp"
assert "mlx" not in sys.modules
print("NO-ENGINE-IMPORTED")
"""
    )
    run = pytester.run(sys_executable(), str(probe))
    run.stdout.fnmatch_lines(["NO-ENGINE-IMPORTED"])


def sys_executable() -> str:
    import sys

    return sys.executable


def test_plot_is_written_next_to_the_json(gate: pytest.Pytester) -> None:
    write_budgets(gate)
    result = gate.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-json", "out/r.json", "--kvguard-plot"
    )
    result.assert_outcomes(passed=2)
    png = gate.path / "out" / "r.kv-bytes.png"
    result.stdout.fnmatch_lines([f"kvguard: plot written to {Path('out') / 'r.kv-bytes.png'}"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The stream checks' samples behind the plot: at the cap and at the end.
    sink = json.loads((gate.path / "out/r.json").read_text())["checks"][0]
    assert [(s["tokens"], s["held"]) for s in sink["detail"]["samples"]] == [(64, 64), (400, 64)]


def test_plot_without_json_is_a_usage_error(gate: pytest.Pytester) -> None:
    write_budgets(gate)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-plot")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --kvguard-plot writes next to the JSON report*"])


def test_bounded_budget_on_a_stream_check(gate: pytest.Pytester) -> None:
    gate.makefile(
        ".yaml",
        budgets=CHECKS.format(sink_budget=20).replace(
            "max_kv_entries: 64}", "max_kv_entries: 64, bounded: true, max_kv_bytes: 4 KiB}"
        ),
    )
    result = gate.runpytest("--kvguard", "budgets.yaml", "-k", "sink", "--kvguard-json", "r.json")
    result.assert_outcomes(passed=1, deselected=1)
    metrics = json.loads((gate.path / "r.json").read_text())["checks"][0]["metrics"]
    assert metrics["kv_growth_after_cap_bytes"] == 0 and metrics["kv_bytes"] == 64 * 64


SWEEP_AND_RECALL = """\
version: 1
defaults:
  engine: fake
  model: tiny.gguf
checks:
  - name: toy-sweep
    scenario: sweep
    params: {tokens: 400, cap: 64, sinks: [0, 1, 2], positions: [reindexed, absolute]}
    budgets: {min_sink_gain_pct: 50, max_position_gap_pct: 1}
  - name: toy-recall
    scenario: recall
    policy: full
    params: {filler_tokens: 100}
    budgets: {max_kv_entries: 10000}
"""


def test_sweep_and_recall_tables(gate: pytest.Pytester) -> None:
    gate.makefile(".yaml", budgets=SWEEP_AND_RECALL)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "check * positions * full * S=0 * S=1 * S=2 *",
            "toy-sweep * reindexed * 1.08 * (+*%) *PASS",
            "* absolute *",
            "check * policy * prompt * fact evicted * recalled * full cache *",
            "toy-recall * full * no * PASS",
        ]
    )
    sweep = json.loads((gate.path / "r.json").read_text())["checks"][0]
    # The toy forgets once its sink is gone: no sinks is far worse, positions do not matter.
    assert sweep["metrics"]["sink_gain_pct"] > 50
    assert sweep["metrics"]["position_gap_pct"] == 0


def _schema() -> dict[str, Any]:
    from pytest_kvguard.gate.report import report_schema

    return report_schema()


def test_report_with_every_kind_of_row_matches_the_schema(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jsonschema

    gate.makefile(".yaml", budgets=SWEEP_AND_RECALL + REPLAY_AND_PARITY)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    result.assert_outcomes(passed=5)
    report = json.loads((gate.path / "r.json").read_text())
    jsonschema.validate(report, _schema())
    assert report["schema"] == 2 and len(report["checks"]) == 5
    monkeypatch.setenv("KVGUARD_FAKE_FAIL", "1")  # ERROR rows and an incomplete run validate too
    gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json", "-x")
    failed = json.loads((gate.path / "r.json").read_text())
    jsonschema.validate(failed, _schema())
    # -x: the first check that decodes errors and the run stops (edit_replay's toy prefix
    # cache decodes without feed(), so it may pass before that, in a shuffled order).
    verdicts = [check["verdict"] for check in failed["checks"]]
    assert failed["complete"] is False and verdicts.count("ERROR") == 1
    bad_figure = json.loads(json.dumps(report))
    bad_figure["checks"][0]["metrics"]["post_eviction_ppl"] = "12.1"
    bad_detail = json.loads(json.dumps(report))
    bad_detail["checks"][0]["detail"]["samples"] = "none"  # the scenario's own detail schema
    for broken in (bad_figure, bad_detail):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, _schema())


REPLAY_AND_PARITY = """\
  - name: toy-replay-swa
    scenario: edit_replay
    policy: swa
    params: {followup: edit, message: 1}
    budgets: {max_reprefill_fraction: 0.99}
    expect: violation
    reason: the toy's sliding window lost the prefix before an early edit
  - name: toy-replay-full
    scenario: edit_replay
    policy: full
    params: {followup: edit, message: -3}
    budgets: {min_reused_tokens: 100}
  - name: toy-parity
    scenario: parity
    engines: [fake, fake2]
    params: {tokens: 400}
    budgets: {max_mean_abs_nll_diff: 0}
"""


def test_edit_replay_mechanics_on_the_toy_engine(gate: pytest.Pytester) -> None:
    """The scenario's flow (prefill, common prefix, keep, re-prefill) on the toy's prefix cache."""
    gate.makefile(".yaml", budgets=SWEEP_AND_RECALL.split("  - name: toy-sweep")[0]
                  + REPLAY_AND_PARITY)  # fmt: skip
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["check * follow-up * prompt * split * reused * re-prefilled *"])
    checks = {c["name"]: c for c in json.loads((gate.path / "r.json").read_text())["checks"]}
    swa, full = checks["toy-replay-swa"]["metrics"], checks["toy-replay-full"]["metrics"]
    # The split is where the two rendered prompts' tokens first differ.
    from kvguard_fake_engine import FakeEngine

    from pytest_kvguard.inputs.chats import followup, history, load_conversation

    toy, chat = FakeEngine(), load_conversation("tutor", Path("."))
    before = toy.chat_ids(history(chat))
    after = toy.chat_ids(followup(chat, "edit", 1))
    split = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
    assert (swa["split"], swa["prompt_tokens"]) == (split, len(after))
    assert swa["reused_tokens"] == 0 and swa["reprefill_tokens"] == len(after)  # slid out
    assert 0 < full["split"] == full["reused_tokens"] < full["prompt_tokens"]  # prefix kept
    assert checks["toy-parity"]["metrics"]["mean_abs_nll_diff"] == 0  # the same toy twice


def test_fixture_and_budgets_file_build_the_same_check(gate: pytest.Pytester) -> None:
    """One meaning, two spellings: the same keys give the same spec and the same figures."""
    gate.makefile(
        ".yaml",
        budgets="version: 1\nchecks:\n  - name: same\n    scenario: parity\n"
        "    engines: [fake, fake2]\n    model: tiny.gguf\n    budgets: {max_ppl_diff_pct: 1}\n",
    )
    gate.makepyfile(
        """
import json
from pathlib import Path
from pytest_kvguard.gate.budgets_file import load_budgets_file

def test_same(kvguard):
    outcome = kvguard.parity(engines=("fake", "fake2"), model="tiny.gguf")
    (check,) = load_budgets_file(Path("budgets.yaml")).checks
    assert outcome.tokens == check.spec.tokens == 1500  # the table's default, both ways
"""
    )
    result = gate.runpytest("test_fixture_and_budgets_file_build_the_same_check.py")
    result.assert_outcomes(passed=1)


def test_fixture_refuses_what_the_budgets_file_refuses(gate: pytest.Pytester) -> None:
    gate.makepyfile(
        """
def test_typo(kvguard):
    kvguard.stream(engine="fake", model="tiny.gguf", policy="sink", cpa=64)

def test_no_scenario(kvguard):
    kvguard.stream_it()
"""
    )
    result = gate.runpytest()
    result.assert_outcomes(failed=2)
    # One call each: the two tests may run in either order.
    result.stdout.fnmatch_lines(
        ["*::test_typo: unknown stream parameter 'cpa' (fix: did you mean 'cap'?*"]
    )
    result.stdout.fnmatch_lines(
        ["*kvguard has no scenario 'stream_it' (scenarios: stream, parity, *"]
    )
    result.stdout.no_fnmatch_line("*During handling*")


def _xdist_gate(gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.RunResult:
    """The toy budgets file on two xdist workers, with a step summary file and a JSON report."""
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(gate.path / "summary.md"))
    write_budgets(gate)
    _register_fake_engine_in_subprocesses(gate)
    return gate.runpytest_subprocess(
        "-n", "2", "--kvguard", "budgets.yaml", "--kvguard-json", "r.json"
    )  # fmt: skip


def test_xdist_controller_alone_writes_report_table_and_summary(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _xdist_gate(gate, monkeypatch)
    result.assert_outcomes(passed=2)
    assert result.stdout.str().count("= kvguard =") == 1
    text = (gate.path / "summary.md").read_text()
    assert text.count("## kvguard:") == 1 and text.startswith("## kvguard: pass")
    report = json.loads((gate.path / "r.json").read_text())
    assert report["complete"] is True and report["verdict"] == "pass"
    assert {c["name"] for c in report["checks"]} == {"toy-sink", "toy-window"}


def test_xdist_engine_errors_are_rows_of_one_failed_report(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGUARD_FAKE_FAIL", "1")
    result = _xdist_gate(gate, monkeypatch)
    result.assert_outcomes(failed=2)
    report = json.loads((gate.path / "r.json").read_text())
    assert (report["verdict"], report["complete"]) == ("fail", False)
    assert sorted(c["verdict"] for c in report["checks"]) == ["ERROR", "ERROR"]
    text = (gate.path / "summary.md").read_text()
    assert text.count("## kvguard: FAIL") == 1 and text.count("(ERROR): ") == 2


def _register_fake_engine_in_subprocesses(gate: pytest.Pytester) -> None:
    """xdist workers are new processes: a conftest registers the toy engine in each."""
    tests = Path(__file__).parent
    gate.makeconftest(
        f"import sys\nsys.path.insert(0, {str(tests)!r})\n"
        "import kvguard_fake_engine\nfrom pytest_kvguard.engines import ENGINES\n"
        "ENGINES['fake'] = kvguard_fake_engine.INFO\n"
    )


def test_chunked_stream_and_generate_report_their_chunk_gap(gate: pytest.Pytester) -> None:
    """Mechanics only (the toy keeps its sinks on every path): a chunked stream check runs the
    same policy one token at a time too, and a generate check scores only its replies."""
    gate.makefile(
        ".yaml",
        budgets="""
version: 1
defaults: {engine: fake, model: tiny.gguf, params: {cap: 64, tokens: 400}}
checks:
  - name: chunked
    policy: sink
    params: {chunk: 16}
    budgets: {max_chunk_gap_pct: 5}
  - name: turns
    scenario: generate
    policy: sink
    params: {prompt: 30, reply: 10}
    budgets: {max_chunk_gap_pct: 5}
""",
    )
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    assert result.ret == 0, result.stdout.str()
    checks = {c["name"]: c for c in json.loads((gate.path / "r.json").read_text())["checks"]}
    chunked = checks["chunked"]
    assert chunked["policy"] == "sink4/64 reidx step1 chunk16"
    assert "single_token" in chunked["seconds"]
    assert chunked["metrics"]["chunk_gap_pct"] == pytest.approx(0.0, abs=1e-9)
    turns = checks["turns"]["metrics"]
    # 10 turns of 30 + 10 tokens; replies fed after token 64 (the first that does not fit)
    # are scored: turns 1 to 9.
    assert turns["scored_tokens"] == 9 * 10
    assert checks["turns"]["detail"] == {"turns": 10, "prefill_step": 2048}


def test_the_fixture_takes_chunk_and_runs_generate(gate: pytest.Pytester) -> None:
    gate.makepyfile(
        """
import pytest

@pytest.mark.kv_budget(max_chunk_gap_pct=5)
def test_chunked(kvguard):
    result = kvguard.stream(engine="fake", model="tiny.gguf", policy="sink", cap=64,
                            tokens=400, chunk=16)
    assert result.policy.endswith("chunk16") and "chunk_gap_pct" in result.metrics

@pytest.mark.kv_budget(max_chunk_gap_pct=5)
def test_turns(kvguard):
    result = kvguard.generate(engine="fake", model="tiny.gguf", policy="sink", cap=64,
                              tokens=400, prompt=30, reply=10)
    assert result.metrics["scored_tokens"] == 90
"""
    )
    gate.runpytest().assert_outcomes(passed=2)


def test_checks_run_in_file_order_whatever_shuffles_the_session(gate: pytest.Pytester) -> None:
    """pytest-randomly shuffles the session; a budgets file's checks are put back in the order
    the file declares them (which check computes a shared run follows it), test files and all."""
    names = [f"toy-{i}" for i in range(6)]
    gate.makefile(
        ".yaml",
        budgets="version: 1\ndefaults: {engine: fake, model: tiny.gguf, params: {tokens: 200}}\n"
        "checks:\n"
        + "".join(
            f"  - name: {n}\n    policy: sink\n    params: {{cap: {64 + i}}}\n"
            "    budgets: {max_kv_entries: 70}\n"
            for i, n in enumerate(names)
        ),  # fmt: skip
    )
    gate.makepyfile(test_other="def test_other():\n    pass\n")
    for seed in (1, 2, 3):
        result = gate.runpytest("--kvguard", "budgets.yaml", "test_other.py", "-p", "randomly",
                                f"--randomly-seed={seed}",
                                "--kvguard-json", "r.json", "-v")  # fmt: skip
        result.assert_outcomes(passed=7)
        result.stdout.fnmatch_lines([f"*Using --randomly-seed={seed}*"])
        report = json.loads((gate.path / "r.json").read_text())
        assert [c["name"] for c in report["checks"]] == names
