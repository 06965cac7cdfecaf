"""The model preview's pytest mechanics on the toy engine (fast), with GGUF headers made here.

The toy engine ignores the cap on a model file whose name has ``nocap`` in it: a candidate
model that regresses. Real models: ``test_model_preview_real.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_model_facts import MLX_CONFIG, MLX_TOKENIZER, write_folder, write_model

pytestmark = pytest.mark.usefixtures("fake_engine")

CHECKS = """\
version: 1
defaults:
  engine: fake
  model: tiny.gguf
  params: {tokens: 400, cap: 64}
checks:
  - name: toy-sink
    policy: sink
    params: {sinks: 1}
    budgets: {max_ppl_increase_pct: 20}
  - name: toy-window
    policy: window
    budgets: {max_ppl_increase_pct: 5}
    expect: violation
    reason: the toy forgets once its sink is gone
"""


@pytest.fixture
def models(gate: pytest.Pytester) -> pytest.Pytester:
    """tiny.gguf (the checks' model), a same-facts copy, and a candidate with one KV head that
    ignores the cap."""
    write_model(gate.path / "tiny.gguf")
    shutil.copy(gate.path / "tiny.gguf", gate.path / "tiny-copy.gguf")
    write_model(gate.path / "tiny-nocap.gguf", kv_heads=1)
    gate.makefile(".yaml", budgets=CHECKS)
    return gate


def test_a_candidate_that_regresses_fails_with_facts_and_both_runs(
    models: pytest.Pytester,
) -> None:
    result = models.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-against-model", "tiny.gguf=tiny-nocap.gguf",
        "--kvguard-json", "report.json",
    )  # fmt: skip
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "kvguard model preview: checks on tiny.gguf also run on tiny-nocap.gguf (*tiny-nocap.gguf)",
        "  KV heads: 2 -> 1",
        "  sha256: * -> *",
    ])  # fmt: skip
    result.stdout.fnmatch_lines([
        "*regressed against model tiny.gguf (model preview): *kv_entries 64 -> 400*"
        "[[]since model tiny.gguf (model preview): model tiny.gguf -> tiny-nocap.gguf, sha256 *",
        "*kvguard: changed since the model preview's other run: model tiny.gguf -> tiny-nocap*",
        "model preview (model tiny.gguf -> tiny-nocap.gguf):",
        "toy-sink * kv_bytes * 4,096 * 25,600 * FAIL",
        "* kv_entries * 64 * 400 *",
    ])  # fmt: skip
    report = json.loads((models.path / "report.json").read_text())
    (diff,) = report["model_preview"]
    assert diff["model"] == "tiny.gguf" and diff["candidate"] == "tiny-nocap.gguf"
    assert {"fact": "KV heads", "model": "2", "candidate": "1"} in diff["differences"]
    rows = {row["name"]: row for row in report["checks"]}
    sink = rows["toy-sink"]
    assert sink["model"] == "tiny-nocap.gguf" and sink["against"]["model"] == "tiny.gguf"
    assert sink["metrics"]["kv_entries"] == 400 and sink["against"]["metrics"]["kv_entries"] == 64
    assert sink["model_sha256"] != sink["against"]["model_sha256"]
    assert sink["verdict"] == "FAIL" and sink["against"]["verdict"] == "PASS"
    assert diff["compared_checks"] == 2  # the negative control runs on both too (MISSED)
    # A cache that never evicts never loses the sink: the negative control no longer catches.
    assert rows["toy-window"]["verdict"] == "MISSED"
    assert rows["toy-window"]["baseline_status"] == "not compared (negative control)"


def test_a_candidate_with_the_same_facts_passes_and_says_so(models: pytest.Pytester) -> None:
    result = models.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-against-model", "tiny.gguf=tiny-copy.gguf",
    )  # fmt: skip
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "kvguard model preview: checks on tiny.gguf also run on tiny-copy.gguf *",
        "  no cache-relevant fact differs",
        "model preview (model tiny.gguf -> tiny-copy.gguf):",
        "toy-sink * (no compared figure changed) * PASS",
    ])  # fmt: skip


def test_against_models_in_the_budgets_file_and_the_command_line_over_it(
    models: pytest.Pytester,
) -> None:
    models.makefile(".yaml", budgets=CHECKS + "against_models:\n  tiny.gguf: tiny-nocap.gguf\n")
    models.runpytest("--kvguard", "budgets.yaml").assert_outcomes(failed=2)
    overridden = models.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-against-model", "tiny.gguf=tiny-copy.gguf"
    )
    overridden.assert_outcomes(passed=2)
    overridden.stdout.fnmatch_lines(["*checks on tiny.gguf also run on tiny-copy.gguf*"])


def test_the_ini_twin(models: pytest.Pytester) -> None:
    models.makeini("[pytest]\nkvguard_against_model =\n    tiny.gguf=tiny-nocap.gguf\n")
    models.runpytest("--kvguard", "budgets.yaml").assert_outcomes(failed=2)


def test_an_engine_that_cannot_load_the_candidate_runs_once_and_says_not_previewed(
    models: pytest.Pytester,
) -> None:
    write_folder(models.path / "mlx-folder", MLX_CONFIG, MLX_TOKENIZER)
    result = models.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-against-model", "tiny.gguf=mlx-folder",
        "--kvguard-json", "report.json",
    )  # fmt: skip
    result.assert_outcomes(passed=2)
    rows = json.loads((models.path / "report.json").read_text())["checks"]
    assert {row["baseline_status"] for row in rows} == {
        "not previewed: engine fake cannot load a model folder (mlx-folder)"
    }
    assert all(row["against"] is None for row in rows)
    # Every check passed, but the preview compared nothing: the run does not pass.
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["kvguard: model preview compared nothing on mlx-folder: *"])


def test_a_preview_whose_checks_are_all_deselected_fails_and_says_why(
    models: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(models.path / "summary.md"))
    write_model(models.path / "other.gguf")
    other = (
        "  - name: toy-other\n    model: other.gguf\n    policy: sink\n"
        "    budgets: {max_ppl_increase_pct: 20}\n"
    )
    models.makefile(".yaml", budgets=CHECKS + other)
    result = models.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-against-model", "tiny.gguf=tiny-copy.gguf",
        "-k", "toy-other", "--kvguard-json", "report.json",
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "kvguard: model preview compared nothing on tiny-copy.gguf: no selected check on "
        "tiny.gguf ran on it (fix: *"
    ])  # fmt: skip
    report = json.loads((models.path / "report.json").read_text())
    assert report["pytest_exitstatus"] == 1 and report["verdict"] == "fail"
    assert report["model_preview"][0]["compared_checks"] == 0
    summary = (models.path / "summary.md").read_text()
    assert "## kvguard: FAIL" in summary and "model preview compared nothing" in summary


def test_a_budgets_file_swap_does_not_fail_a_run_that_selects_no_check_on_its_model(
    models: pytest.Pytester,
) -> None:
    write_model(models.path / "other.gguf")
    other = (
        "  - name: toy-other\n    model: other.gguf\n    policy: sink\n"
        "    budgets: {max_ppl_increase_pct: 20}\n"
    )
    models.makefile(
        ".yaml", budgets=CHECKS + other + "against_models:\n  tiny.gguf: tiny-copy.gguf\n"
    )
    result = models.runpytest("--kvguard", "budgets.yaml", "-k", "toy-other")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_the_command_line_overrides_a_budgets_file_candidate_without_reading_it(
    models: pytest.Pytester,
) -> None:
    models.makefile(".yaml", budgets=CHECKS + "against_models:\n  tiny.gguf: not-built-yet.gguf\n")
    result = models.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-against-model", "tiny.gguf=tiny-copy.gguf"
    )
    result.assert_outcomes(passed=2)


def test_the_model_is_matched_by_file_however_it_is_spelled(models: pytest.Pytester) -> None:
    spelled = str(models.path / "." / "tiny.gguf")
    result = models.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-against-model", f"{spelled}=tiny-nocap.gguf"
    )
    result.assert_outcomes(failed=2)


def test_an_architecture_an_engine_does_not_declare_is_not_previewed() -> None:
    from types import SimpleNamespace

    from pytest_kvguard.gate.model_preview import ModelSwap, not_previewed
    from pytest_kvguard.inputs.models import ModelRef

    swap = ModelSwap("smollm2-135m", Path("/m.gguf"), ModelRef("q.gguf", Path("/q.gguf")),
                     "qwen2", "--kvguard-against-model smollm2-135m=q.gguf")  # fmt: skip
    check: Any = SimpleNamespace(engines=("mlx",))
    assert not_previewed(check, swap) == (
        "not previewed: engine mlx cannot load GGUF architecture 'qwen2' (q.gguf)"
    )
    check = SimpleNamespace(engines=("llama_cpp",))  # llama.cpp's own list is asked at parse time
    assert not_previewed(check, swap) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tiny.gguf"], "--kvguard-against-model tiny.gguf: expected NAME=PATH (fix: write *"),
        (["tiny-copy.gguf=tiny-nocap.gguf"], "--kvguard-against-model tiny-copy.gguf=tiny-nocap"
         ".gguf: no check runs on model 'tiny-copy.gguf' (*tiny-copy.gguf) (fix: name a model "
         "the checks use: tiny.gguf)"),
        (["missing.gguf=tiny-copy.gguf"], "--kvguard-against-model missing.gguf=tiny-copy.gguf: "
         "model file 'missing.gguf' not found*"),
        (["tiny.gguf=./tiny.gguf"], "--kvguard-against-model tiny.gguf=./tiny.gguf: the "
         "candidate is tiny.gguf's own file (*tiny.gguf): the preview would compare the model "
         "with itself (fix: give the new file (kvguard quantize writes one))"),
        (["org/model=tiny-copy.gguf"], "--kvguard-against-model org/model=tiny-copy.gguf: model "
         "'org/model' is a hub id: a model preview reads both models' files, and those are not "
         "here (fix: *)"),
        (["tiny.gguf=http://localhost:8080"], "--kvguard-against-model tiny.gguf=http://localhost"
         ":8080: candidate 'http://localhost:8080' is a server's URL: a model preview reads both "
         "models' files, and those are not here (fix: *)"),
        (["tiny.gguf=tiny-copy.gguf", "--kvguard-against-model", "./tiny.gguf=tiny-nocap.gguf"],
         "--kvguard-against-model ./tiny.gguf=tiny-nocap.gguf: model *tiny.gguf already has a "
         "candidate (--kvguard-against-model tiny.gguf=tiny-copy.gguf) (fix: give one candidate "
         "per model)"),
        (["tiny.gguf=missing.gguf"], "--kvguard-against-model tiny.gguf=missing.gguf: candidate "
         "model file 'missing.gguf' not found*"),
        (["tiny.gguf=bad.gguf"], "--kvguard-against-model tiny.gguf=bad.gguf: candidate *bad.gguf "
         "is not a readable GGUF file: it starts with b'PK*', not the GGUF magic*"),
        (["tiny.gguf=cut.gguf"], "*candidate *cut.gguf is not a readable GGUF file: tensor "
         "token_embd.weight's data runs past the end of the file*"),
        (["tiny.gguf=empty-folder"],
         "*candidate *empty-folder: no config.json in the model folder*"),
        (["tiny.gguf=tiny-copy.gguf", "--kvguard-baseline=report.json"],
         "*--kvguard-against-model and --kvguard-baseline each give the run something to be "
         "judged against (fix: use one of them)"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_what_and_the_fix(
    models: pytest.Pytester, args: list[str], message: str
) -> None:
    (models.path / "bad.gguf").write_bytes(b"PK\x03\x04 a zip file")
    whole = (models.path / "tiny.gguf").read_bytes()
    (models.path / "cut.gguf").write_bytes(whole[: len(whole) - 8])
    (models.path / "empty-folder").mkdir()
    if any(a.startswith("--kvguard-baseline") for a in args):
        models.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "report.json")
    result = models.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-against-model", args[0], *args[1:]
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])
    assert "Traceback" not in result.stderr.str()


def test_a_bad_against_models_entry_names_the_budgets_file_and_line(
    models: pytest.Pytester,
) -> None:
    models.makefile(".yaml", budgets=CHECKS + "against_models:\n  tiny.gguf: missing.gguf\n")
    result = models.runpytest("--kvguard", "budgets.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: *budgets.yaml:17: against_models: candidate model file 'missing.gguf' not found*"]
    )


def _edit_replay_outcome(metrics: dict[str, float], model_path: str) -> Any:
    from pytest_kvguard.gate.outcome import Outcome
    from pytest_kvguard.scenarios.edit_replay import ReplayDetail

    return Outcome(
        name="smollm2-full-edit-end", scenario="edit_replay", engine="llama_cpp",
        engine_version="0.3.36", engine_info={}, model="smollm2-135m", model_path=model_path,
        model_sha256=model_path, kv_bytes_per_token=None, policy="full", tokens=1101, text="",
        text_sha256="", metrics=metrics, budgets={}, budget_text="", violations=[],
        expect_violation=False, reason=None, seconds={}, tokens_per_second=0.0,
        detail=ReplayDetail("edit #-3"),
    )  # fmt: skip


def test_a_preview_judges_the_reuse_excess_not_the_raw_gap_that_holds_the_floor() -> None:
    """Measured: SmolLM2 Q4_1 -> Q4_K_M moves smollm2-full-edit-end's raw reuse gap 0 ->
    0.064 nats (llama.cpp's Q4_K batch-split floor, 0.077) while its excess stays below 0: the
    preview judges what the scenario's budgets judge (reuse_excess), so that passes; an
    excess that grows past its tolerance still fails."""
    from pytest_kvguard.gate.baseline import compare_with_other_run, tolerances

    counts = {"reused_tokens": 753.0, "reprefill_tokens": 348.0, "memory_bytes": 25242685.0}
    old = _edit_replay_outcome(
        {**counts, "mean_abs_nll_diff": 0.0, "reuse_floor": 0.0, "reuse_excess": 0.0}, "a.gguf"
    )
    correct = _edit_replay_outcome(
        {**counts, "mean_abs_nll_diff": 0.0637, "reuse_floor": 0.0768, "reuse_excess": -0.0131},
        "b.gguf",
    )
    stale = _edit_replay_outcome(
        {**counts, "mean_abs_nll_diff": 0.1437, "reuse_floor": 0.0768, "reuse_excess": 0.0669},
        "b.gguf",
    )
    rules = tolerances({})
    assert compare_with_other_run(correct, old, rules, "3.11").violations == []
    (found,) = compare_with_other_run(stale, old, rules, "3.11").violations
    assert found.startswith("regressed against model smollm2-135m (model preview): reuse_excess ")
    assert "mean_abs_nll_diff" not in found
