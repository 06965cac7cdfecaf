"""The tiers: the quick gate mirrors the full one check for check; README's quoted gate output
is compared with a report cell by cell; kvguard-build-llama-server and .ci/run-action work as
their docs say. Fast: no engine runs here (.ci/run runs the quick gate, .ci/nightly the full
one)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from gate_invariants import (
    FULL,
    QUICK,
    ROOT,
    QuotedTable,
    check_names,
    checks_by_name,
    measured_on,
    quoted_blocks,
    readme_drift,
    same_cell,
    split_tables,
)

from pytest_kvguard.cli import llama_server_build
from pytest_kvguard.gate.faults import FAULTS
from pytest_kvguard.gate.report import render_table


# No engine runs here, but the parser refuses a check whose engine is not installed, and both
# gates name both in-process engines: a test that parses them carries both engines' markers.
@pytest.mark.parametrize("name", check_names(QUICK))
@pytest.mark.llama_cpp
@pytest.mark.mlx
def test_each_quick_check_mirrors_the_full_check_of_its_name(name: str) -> None:
    """Same scenario, engines, model, kind of policy and expected verdict: the quick check is
    the full one at a smaller size, so the two verdicts can be compared."""
    quick, full = checks_by_name(QUICK)[name], checks_by_name(FULL).get(name)
    assert full is not None, f"{name} has no check of the same name in {FULL.name}"
    assert (quick.scenario, quick.engines, quick.model.name, quick.expect_violation) == (
        full.scenario, full.engines, full.model.name, full.expect_violation)  # fmt: skip
    policy = getattr(quick.spec, "policy", None)
    if policy is not None:
        assert policy.kind == full.spec.policy.kind


@pytest.mark.llama_cpp
@pytest.mark.mlx
def test_the_quick_gate_has_every_kind_of_check_the_full_gate_has() -> None:
    quick, full = checks_by_name(QUICK).values(), checks_by_name(FULL).values()
    scenarios = {c.scenario for c in quick}
    assert scenarios == {c.scenario for c in full}
    engines = {e for c in quick for e in c.engines}
    assert engines == {e for c in full for e in c.engines}
    # Each negative control kind: a window and an engine default caught on each engine.
    caught = {(c.engine, c.spec.policy.kind) for c in quick
              if c.expect_violation and c.scenario == "stream"}  # fmt: skip
    assert {("llama_cpp", "window"), ("mlx", "window"), ("mlx", "engine_default")} <= caught


def test_every_fault_names_checks_of_both_tiers() -> None:
    # Names only: read as plain YAML, no engine needed (the parse is the tests' above).
    for fault in FAULTS.values():
        assert set(fault.caught_by) <= set(check_names(QUICK)), fault.name
        assert set(fault.caught_by) <= set(check_names(FULL)), fault.name


# README's quoted output against a report.


def _toy_rows(gate: pytest.Pytester) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    gate.makefile(
        ".yaml",
        budgets="version: 1\ndefaults: {engine: fake, model: tiny.gguf}\nchecks:\n"
        "  - name: toy-sink\n    policy: sink\n    params: {cap: 64, tokens: 300, sinks: 1}\n"
        "    budgets: {max_ppl_increase_pct: 20}\n"
        "  - name: toy-edit\n    scenario: edit_replay\n    policy: full\n"
        "    params: {followup: edit, message: -3}\n    budgets: {min_reused_tokens: 1}\n",
    )
    gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    report = json.loads((gate.path / "r.json").read_text())
    return report["checks"], report["machine"]


def _quoted(rows: list[dict[str, object]], where: str = "", file: str = "budgets.yaml") -> str:
    from pytest_kvguard.gate.outcome import row_from_json

    table = render_table([row_from_json(r) for r in rows])
    return (
        f"Some prose.\n\n<!-- kvguard-output: {file}; measured on: {where} -->\n```\n{table}\n```\n"
    )


def test_readme_drift_compares_every_quoted_cell(gate: pytest.Pytester) -> None:
    rows, machine = _toy_rows(gate)
    readme = _quoted(rows, measured_on(machine))
    compared, drift, everything = readme_drift(readme, "budgets.yaml", rows, machine)
    assert drift == [] and everything and compared > 10
    # A figure changed in the README is named, with both values.
    tables = split_tables(quoted_blocks(readme, "budgets.yaml")[0][0])
    ppl = next(t for t in tables if isinstance(t, QuotedTable) and "ppl" in t.headers).rows[0]
    changed = readme.replace(f"  {ppl['ppl']}  ", "  99.99  ", 1)
    assert readme_drift(changed, "budgets.yaml", rows, machine)[1] == [
        f"toy-sink ppl: README '99.99', measured '{ppl['ppl']}'"
    ]


def test_on_another_machine_only_machine_independent_cells_are_compared(
    gate: pytest.Pytester,
) -> None:
    rows, machine = _toy_rows(gate)
    readme = _quoted(rows, "another CPU, x86_64, Python 3.99.0")
    tables = split_tables(quoted_blocks(readme, "budgets.yaml")[0][0])
    edit = next(t for t in tables if isinstance(t, QuotedTable) and "reused" in t.headers)
    ppl = next(t for t in tables if isinstance(t, QuotedTable) and "ppl" in t.headers).rows[0]
    floats = readme.replace(f"  {ppl['ppl']}  ", "  99.99  ", 1)
    compared, drift, everything = readme_drift(floats, "budgets.yaml", rows, machine)
    assert drift == [] and not everything and compared > 5
    reprefilled = edit.rows[0]["re-prefilled"]
    counts = readme.replace(f"  {reprefilled}  ", "  12345  ", 1)
    assert readme_drift(counts, "budgets.yaml", rows, machine)[1] == [
        f"toy-edit re-prefilled: README '12345', measured '{reprefilled}'"
    ]


def test_readme_drift_ignores_wall_clock_and_names_what_is_missing(gate: pytest.Pytester) -> None:
    rows, machine = _toy_rows(gate)
    readme = _quoted(rows, measured_on(machine))
    tables = split_tables(quoted_blocks(readme, "budgets.yaml")[0][0])
    table = next(t for t in tables if isinstance(t, QuotedTable) and "replay s" in t.headers)
    seconds = table.rows[0]["replay s"]
    slower = readme.replace(f"  {seconds}  ", "  999.9  ", 1)
    assert slower != readme and readme_drift(slower, "budgets.yaml", rows, machine)[1] == []
    assert readme_drift(readme, "other.yaml", rows, machine)[1] == [
        "README quotes no output of other.yaml "
        "(<!-- kvguard-output: other.yaml; measured on: ... -->)"
    ]
    edited = [dict(r) for r in rows if r["name"] != "toy-edit"]
    assert readme_drift(readme, "budgets.yaml", edited, machine)[1] == [
        "README quotes checks the report lacks: toy-edit"
    ]
    prose = readme.replace("```\ncheck", "```\nSome words, not a table.\n\ncheck", 1)
    assert readme_drift(prose, "budgets.yaml", rows, machine)[1] == [
        "README block of budgets.yaml has a part that is not a table: 'Some words, not a table.'"
    ]


@pytest.mark.parametrize(
    ("quoted", "rendered", "same"),
    [
        ("12.18", "12.18", True),
        ("12.18", "12.19", True),  # one unit of the last digit: rounding
        ("12.18", "12.20", False),
        ("+13.1%", "+13.2%", True),
        ("+13.1%", "+13.1", False),  # another unit
        ("27.2 MiB", "27.3 MiB", True),
        ("4,159", "4,159", True),
        ("4159", "4160", False),  # whole numbers are counts: exact
        ("26.52 (+94.3%)", "26.53 (+94.4%)", True),  # every number of a cell
        ("26.52 (+94.3%)", "26.52 (+94.5%)", False),
        ("30.9% / 31.2% / 31.6%", "30.9% / 31.3% / 31.6%", True),
        ("yes (6/6, nll 0.26)", "yes (5/6, nll 0.26)", False),
        ("PASS", "CAUGHT", False),
    ],
)
def test_a_quoted_cell_may_differ_by_one_unit_of_its_last_decimal(
    quoted: str, rendered: str, same: bool
) -> None:
    assert same_cell(quoted, rendered) is same


def test_readme_quotes_the_output_of_both_gates_and_where_it_was_measured() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # quotes may sit in docs
    readme = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    for file in ("fixtures/quick.yaml", "fixtures/budgets.yaml"):
        blocks = quoted_blocks(readme, file)
        assert blocks and all(where for _, where in blocks), file


# kvguard-build-llama-server


def test_build_command_installs_the_cached_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A binary already cached for this llama-cpp-python and these flags is copied, not built."""
    monkeypatch.setenv("KVGUARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_NATIVE=OFF")
    monkeypatch.setattr(llama_server_build, "installed_version", lambda engine: "0.3.99")
    cached = llama_server_build.cached_binary("0.3.99", "-DGGML_NATIVE=OFF")
    assert cached.parent.parent == tmp_path / "cache"
    assert cached != llama_server_build.cached_binary("0.3.99", "-DGGML_CUDA=on")
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\necho 'version: 1 (stand-in)'\n")
    cached.chmod(0o755)
    monkeypatch.setattr(llama_server_build, "build", lambda *a: pytest.fail("built again"))
    assert llama_server_build.main(["--dest", str(tmp_path / "bin")]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "bin" / "llama-server")
    assert "cached:" in err and "version: 1 (stand-in)" in err
    assert os.access(tmp_path / "bin" / "llama-server", os.X_OK)


def test_build_command_refuses_a_cached_binary_that_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGUARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llama_server_build, "installed_version", lambda engine: "0.3.99")
    cached = llama_server_build.cached_binary("0.3.99", llama_server_build.build_flags())
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\necho 'illegal instruction' >&2\nexit 132\n")
    cached.chmod(0o755)
    assert llama_server_build.main(["--dest", str(tmp_path / "bin")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "--version exited 132: illegal instruction (fix: rebuild it" in err
    assert not (tmp_path / "bin").exists()  # nothing installed where engine llama_server looks


def test_build_flags_pin_x86_64_where_none_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setattr(llama_server_build.platform, "machine", lambda: "x86_64")
    assert llama_server_build.build_flags() == llama_server_build.X86_64_FLAGS
    monkeypatch.setattr(llama_server_build.platform, "machine", lambda: "arm64")
    assert llama_server_build.build_flags() == ""
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    assert llama_server_build.build_flags() == "-DGGML_CUDA=on"


def test_build_command_without_llama_cpp_python_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(llama_server_build, "installed_version", lambda engine: None)
    assert llama_server_build.main([]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "kvguard-build-llama-server: error: llama-cpp-python is not installed in this "
        f"environment ({sys.executable}): there is no llama.cpp to build llama-server from "
        '(fix: pip install "pytest-kvguard[llama]" first)'
    ]


def test_build_command_only_for_a_file_that_starts_llama_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert llama_server_build.needs_llama_server(FULL)
    assert llama_server_build.needs_llama_server(QUICK)
    mlx_only = tmp_path / "mlx.yaml"
    mlx_only.write_text(
        "version: 1\nchecks:\n  - {name: m, engine: mlx, model: smollm2-135m, policy: full,"
        " scenario: memory, params: {lengths: [64]}, budgets: {max_kv_deviation_pct: 1}}\n"
    )
    monkeypatch.setattr(llama_server_build, "build", lambda *a: pytest.fail("built"))
    assert llama_server_build.main(["--only-for", str(mlx_only)]) == 0
    assert "not needed" in capsys.readouterr().err
    mlx_only.write_text("version: 1\nchecks: [oops\n")
    assert llama_server_build.main(["--only-for", str(mlx_only)]) == 1
    assert f"{mlx_only}" in capsys.readouterr().err


# .ci/run-action


def _run_action_module() -> ModuleType:
    path = ROOT / ".ci" / "run-action"
    loader = importlib.machinery.SourceFileLoader("run_action", str(path))
    spec = importlib.util.spec_from_loader("run_action", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_run_action_fills_every_expression_the_action_uses() -> None:
    """Every ${{ ... }} in the action's run text, env and cache keys has a value off GitHub:
    run-action's own context, and the outputs the action's steps write to $GITHUB_OUTPUT."""
    import re

    run_action = _run_action_module()
    action = run_action.load_action()
    values = run_action.context({name: "x" for name in action["inputs"]})
    for step in action["runs"]["steps"]:
        for output in re.findall(r'echo "([\w-]+)=.*>> "\$GITHUB_OUTPUT"', step.get("run", "")):
            values[f"steps.{step['id']}.outputs.{output}"] = "x"
    for step in action["runs"]["steps"]:
        for text in [step.get("run", ""), *map(str, step.get("env", {}).values()),
                     *map(str, step.get("with", {}).values())]:  # fmt: skip
            assert "${{" not in run_action.fill(text, values), text
    assert "steps.install.outputs.llama-cpp-python" in values


def test_run_action_refuses_an_unknown_input() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "run-action"), "budget=fixtures/quick.yaml"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "'budget=fixtures/quick.yaml' is not NAME=VALUE for an input of the action" in (
        done.stderr
    )
