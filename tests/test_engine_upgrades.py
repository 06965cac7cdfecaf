"""Engine workers and engine environments on the real engines and the bundled SmolLM2.

A real illegal instruction and a real hang inside llama.cpp each cost one check; a real mlx-lm
release (0.28.0, from the package index, in an environment kvguard-env makes) passes a cap
check that the current release fails, and the upgrade preview names both versions and figures
in one run (the mlx-lm releases between, and both gates on each, are measured in README: Tiers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_kvguard.engines import installed_version
from pytest_kvguard.isolation.environments import default_root

pytestmark = pytest.mark.engine  # each test names its engines below

OLD_MLX_LM = "mlx-lm==0.28.0"
"""The last release where make_prompt_cache(model, max_kv_size) caps a Llama model's cache:
0.28.1 gave Llama its own make_cache(), and the cap is silently dropped from then on."""

LLAMA_CHECKS = """\
version: 1
defaults:
  engine: llama_cpp
  model: smollm2-135m
checks:
  - name: sink-reindexed
    policy: sink
    params: {tokens: 320, cap: 256, sinks: 4, positions: reindexed}
    budgets: {max_ppl_increase_pct: 50, max_kv_entries: 256}
    TIMEOUT
  - name: memory-full
    scenario: memory
    policy: full
    params: {lengths: [128, 256]}
    budgets: {max_kv_deviation_pct: 1}
  - name: sink-absolute
    policy: sink
    params: {tokens: 320, cap: 256, sinks: 4, positions: absolute}
    budgets: {max_ppl_increase_pct: 50, max_kv_entries: 256}
"""


def _run_llama_checks(
    pytester: pytest.Pytester, fault: str, timeout: str = "", checks: str = LLAMA_CHECKS
) -> tuple[pytest.RunResult, dict]:  # type: ignore[type-arg]
    pytester.makefile(".yaml", budgets=checks.replace("TIMEOUT", timeout))
    result = pytester.runpytest(
        "--kvguard", "budgets.yaml", "--kvguard-inject-fault", fault, "--kvguard-json", "r.json"
    )
    return result, json.loads((pytester.path / "r.json").read_text())


@pytest.mark.llama_cpp
def test_a_real_illegal_instruction_in_llama_cpp_costs_one_check(
    pytester: pytest.Pytester,
) -> None:
    """engine_crash: the KV shift after an eviction executes an undefined instruction."""
    result, report = _run_llama_checks(pytester, "engine_crash")
    result.stdout.fnmatch_lines([
        "*budgets.yaml:6: engine worker died: SIGILL (illegal instruction) while running "
        "sink-reindexed on llama_cpp",
    ])  # fmt: skip
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    # The absolute-position sink evicts without shifting: it runs on the restarted worker.
    assert verdicts == {"sink-reindexed": "ERROR", "memory-full": "PASS", "sink-absolute": "PASS"}
    assert report["lost_checks"] == ["sink-reindexed"] and report["missing_checks"] == []


@pytest.mark.llama_cpp
def test_a_real_hang_in_llama_cpp_is_killed_at_the_time_limit(pytester: pytest.Pytester) -> None:
    """engine_hang: evicting never returns; the check's 10 s limit kills the worker. (The
    absolute-position sink evicts too, so it is left out: it would hang the same way.)"""
    no_other_eviction = LLAMA_CHECKS.partition("  - name: sink-absolute")[0]
    result, report = _run_llama_checks(
        pytester, "engine_hang", timeout="timeout: 10", checks=no_other_eviction
    )
    result.stdout.fnmatch_lines([
        "*engine worker timed out after 10 s while running sink-reindexed on llama_cpp; killed*"
    ])  # fmt: skip
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert verdicts == {"sink-reindexed": "ERROR", "memory-full": "PASS"}
    assert report["lost_checks"] == ["sink-reindexed"] and report["missing_checks"] == []


@pytest.mark.llama_cpp
@pytest.mark.mlx
def test_the_pytest_process_never_imports_an_engine(pytester: pytest.Pytester) -> None:
    pytester.makefile(
        ".yaml",
        budgets="version: 1\nchecks:\n"
        "  - {name: llama, scenario: memory, engine: llama_cpp, model: smollm2-135m,"
        " policy: full, params: {lengths: [64]}, budgets: {max_kv_deviation_pct: 1}}\n"
        "  - {name: mlx, scenario: memory, engine: mlx, model: smollm2-135m,"
        " policy: full, params: {lengths: [64]}, budgets: {max_kv_deviation_pct: 1}}\n",
    )
    pytester.makeconftest(
        "import sys\n"
        "def pytest_sessionfinish(session):\n"
        "    loaded = [m for m in ('llama_cpp', 'mlx', 'mlx_lm') if m in sys.modules]\n"
        "    print('engines imported by pytest:', loaded or 'none')\n"
    )
    result = pytester.runpytest_subprocess("--kvguard", "budgets.yaml")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*engines imported by pytest: none*"])


# A real engine upgrade: mlx-lm 0.28.0 -> the installed release.


@pytest.fixture(scope="module")
def old_mlx_python() -> Path:
    """An mlx-lm 0.28.0 environment, made by kvguard-env as a user would (cached across runs
    under ~/.cache/pytest-kvguard/envs, or $KVGUARD_ENV_DIR)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest_kvguard.isolation.environments", OLD_MLX_LM],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    python = Path(done.stdout.strip())
    assert python.parent.parent.parent == default_root() and python.exists()
    return python


@pytest.mark.mlx
def test_kvguard_env_caches_the_environment(old_mlx_python: Path) -> None:
    again = subprocess.run(
        [sys.executable, "-m", "pytest_kvguard.isolation.environments", OLD_MLX_LM],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert Path(again.stdout.strip()) == old_mlx_python and "creating" not in again.stderr
    marker = json.loads((old_mlx_python.parent.parent / "kvguard-env.json").read_text())
    assert "mlx-lm==0.28.0" in marker["packages"]


EVERY_MLX_POLICY = """\
version: 1
defaults:
  engine: mlx
  model: smollm2-135m
checks:
  - name: smollm2-mlx-engine-default-cap256
    scenario: memory
    policy: engine_default
    params: {cap: 256, lengths: [256, 384]}
    budgets: {max_kv_entries: 256}
  - name: sink4
    policy: sink
    params: {tokens: 320, cap: 256, sinks: 4}
    # +40.5% measured on both releases: 64 tokens after the first eviction is a short sample.
    budgets: {max_ppl_increase_pct: 50, max_kv_entries: 256}
  - name: window-memory
    scenario: memory
    policy: window
    params: {cap: 256, lengths: [256, 320]}
    budgets: {bounded: true, max_kv_deviation_pct: 1}
  - name: gemma3-swa-memory
    scenario: memory
    model: gemma3-270m
    policy: swa
    params: {lengths: [520]}
    budgets: {max_kv_deviation_pct: 1}
  - name: parity
    scenario: parity
    engines: [llama_cpp, mlx]
    params: {tokens: 300}
    budgets: {max_mean_abs_nll_diff: 0.1, max_ppl_diff_pct: 2}
"""


@pytest.mark.mlx
def test_the_upgrade_preview_flags_the_dropped_cap_and_nothing_else(
    pytester: pytest.Pytester, old_mlx_python: Path
) -> None:
    """The oldest supported mlx-lm and the installed one, side by side in one run (llama.cpp
    is the same version in both environments): the cap check regresses, named with both
    versions and figures; sinks, windows, Gemma 3's own SWA cache and cross-engine parity give
    the same figures on both."""
    pytester.makefile(".yaml", budgets=EVERY_MLX_POLICY)
    result = pytester.runpytest(
        "--kvguard", "budgets.yaml", f"--kvguard-against={old_mlx_python}",
        "--kvguard-json", "r.json",
    )  # fmt: skip
    result.assert_outcomes(passed=4, failed=1)
    now = installed_version("mlx")
    result.stdout.fnmatch_lines([
        "kvguard upgrade preview: every check also runs against llama_cpp *, mlx 0.28.0, *"
        f"({old_mlx_python})",
        "*cap or window not applied*max_kv_entries*budget 256 entries, measured 384 entries*",
        f"upgrade preview (*mlx 0.28.0 -> {now}):",
        "smollm2-mlx-engine-default-cap256*kv_bytes*",
        "*kv_entries*256*384*",
    ])  # fmt: skip
    rows = {c["name"]: c for c in json.loads((pytester.path / "r.json").read_text())["checks"]}
    cap = rows.pop("smollm2-mlx-engine-default-cap256")
    assert cap["against"]["engine_version"] == "0.28.0" and cap["engine_version"] == now
    assert cap["against"]["metrics"]["kv_entries"] == 256 and cap["metrics"]["kv_entries"] == 384
    regression = next(v for v in cap["violations"] if v.startswith("regressed against"))
    assert regression.startswith("regressed against mlx 0.28.0 (upgrade preview): ")
    assert "kv_entries 256 -> 384" in regression and "kv_bytes" in regression
    assert f"mlx 0.28.0 -> {now}" in regression
    assert {n: r["verdict"] for n, r in rows.items()} == dict.fromkeys(rows, "PASS"), result.stdout
    for name, row in rows.items():
        assert row["baseline_status"] == "within tolerance", (name, row["violations"])
        assert row["against"]["engine_version"].startswith(("0.28.0", "0.3")), name
    for name in ("sink4", "window-memory", "gemma3-swa-memory"):
        then, now_figures = rows[name]["against"]["metrics"], rows[name]["metrics"]
        assert then["kv_entries"] == now_figures["kv_entries"]
        assert then["kv_bytes"] == now_figures["kv_bytes"]
