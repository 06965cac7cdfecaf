"""The GitHub Actions files: valid against GitHub's schemas, and wired the way the README says."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTION = ROOT / ".github" / "actions" / "kvguard" / "action.yml"


def _check_jsonschema() -> str:
    found = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    assert found, 'check-jsonschema is missing: pip install -e ".[test]"'
    return found


@pytest.mark.parametrize(
    ("schema", "path"),
    [*(("vendor.github-workflows", w) for w in WORKFLOWS), ("vendor.github-actions", ACTION)],
    ids=lambda v: v.name if isinstance(v, Path) else v,
)
def test_schema_valid(schema: str, path: Path) -> None:
    # check-jsonschema vendors GitHub's schemas: no network needed.
    result = subprocess.run(
        [_check_jsonschema(), "--builtin-schema", schema, str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def test_jobs_pick_runners_by_label_and_use_the_action_with_known_inputs() -> None:
    jobs = _load(ROOT / ".github" / "workflows" / "kvguard.yml")["jobs"]
    inputs = _load(ACTION)["inputs"]
    assert jobs["linux-cpu"]["runs-on"] == "ubuntu-latest"
    assert jobs["macos-metal"]["runs-on"] == ["self-hosted", "macOS", "ARM64"]
    assert jobs["gpu-cuda"]["runs-on"] == ["self-hosted", "linux", "gpu"]
    build_flags = {}
    for name in ("linux-cpu", "macos-metal", "gpu-cuda"):
        gate = [s for s in jobs[name]["steps"] if s.get("uses") == "./.github/actions/kvguard"]
        assert len(gate) == 1, f"{name} runs the gate through the composite action"
        assert set(gate[0].get("with", {})) <= set(inputs), f"{name} passes an unknown input"
        build_flags[name] = (
            gate[0].get("with", {}).get("cmake-args", inputs["cmake-args"]["default"])
        )
    assert "-DGGML_METAL=on" in build_flags["macos-metal"]
    assert "-DGGML_CUDA=on" in build_flags["gpu-cuda"]
    assert "-DGGML_NATIVE=OFF" in build_flags["linux-cpu"]  # the flags DOMAIN.md needs on x86-64


def test_pull_requests_run_the_tests_and_the_quick_gate_nights_the_full_gate() -> None:
    """Tiers: the test suite (README command 2) and the quick gate on every push and pull
    request; the full gate on the nightly schedule and on demand; on every runner; each gate
    run's report saved as an artifact named by runner and tier."""
    from test_docs import setup_commands

    workflow = _load(ROOT / ".github" / "workflows" / "kvguard.yml")
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert {"push", "pull_request", "schedule", "workflow_dispatch"} <= set(triggers)
    assert triggers["workflow_dispatch"]["inputs"]["tier"]["options"] == ["full", "quick"]
    tier = workflow["env"]["KVGUARD_TIER"]
    assert "github.event_name == 'schedule'" in tier and "inputs.tier == 'full'" in tier
    jobs = workflow["jobs"]
    _, tests_command = setup_commands()
    commands = [s.get("run", "") for s in jobs["tests"]["steps"]]
    assert tests_command in commands, "the tests job runs README command 2"
    step = next(s for s in jobs["tests"]["steps"] if s.get("run") == tests_command)
    assert step.get("env", {}).get("KVGUARD_REQUIRE_ENGINES") == "1", "a missing engine skips"
    assert "push" in jobs["tests"]["if"] and "pull_request" in jobs["tests"]["if"]
    for name in ("linux-cpu", "macos-metal", "gpu-cuda"):
        gate = next(s for s in jobs[name]["steps"] if s.get("uses") == "./.github/actions/kvguard")
        budgets = gate["with"]["budgets"]
        assert "env.KVGUARD_TIER == 'full'" in budgets, name
        assert "'fixtures/budgets.yaml'" in budgets and "'fixtures/quick.yaml'" in budgets, name
        assert gate["with"]["artifact"].endswith("-${{ env.KVGUARD_TIER }}"), name


def test_the_action_builds_llama_server_with_the_package_command() -> None:
    """pip installs no llama-server: the action builds it with kvguard build-llama-server, as
    .ci/install does, only for a budgets file that starts one (by default)."""
    steps = _load(ACTION)["runs"]["steps"]
    build = next(s for s in steps if s.get("name") == "Build llama-server")
    assert "kvguard build-llama-server --only-for" in build["run"]
    assert build["env"]["CMAKE_ARGS"] == "${{ inputs.cmake-args }}"
    assert "bin/kvguard build-llama-server" in (ROOT / ".ci" / "install").read_text()
    names = [s.get("name") or s.get("uses") for s in steps]
    assert (
        names.index("Install pytest-kvguard")
        < names.index("Build llama-server")
        < names.index("Run the gate")
    )


def test_action_uploads_the_report_and_caches_per_build_flags() -> None:
    steps = _load(ACTION)["runs"]["steps"]
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and "${{ inputs.report }}" in upload["with"]["path"]
    restore = next(s for s in steps if s.get("uses", "").startswith("actions/cache/restore"))
    save = next(s for s in steps if s.get("uses", "").startswith("actions/cache/save"))
    assert "inputs.cmake-args" in restore["with"]["key"]
    # Saved under the installed packages' hash, and only when the restored cache is not that.
    assert save["with"]["key"].endswith("-${{ steps.install.outputs.installed }}")
    assert save["if"].startswith(f"steps.{restore['id']}.outputs.cache-matched-key != format(")
    gate = next(s for s in steps if s.get("name") == "Run the gate")
    assert "--kvguard-json" in gate["run"] and "--junitxml" in gate["run"]


def test_the_install_steps_outputs_survive_an_install_without_llama(tmp_path: Path) -> None:
    """extras without llama (the served workflow's): pip show fails, and the step, under the
    bash -eo pipefail GitHub runs it with, still writes llama-cpp-python=none."""
    install = next(s for s in _load(ACTION)["runs"]["steps"] if s.get("id") == "install")
    lines = [line for line in install["run"].splitlines()
             if line.startswith(("version=", "echo "))]  # fmt: skip
    pip = tmp_path / ".kvguard-venv" / "bin" / "pip"
    pip.parent.mkdir(parents=True)
    # A pip without llama-cpp-python: `show` fails as pip's does, `freeze` lists one package.
    pip.write_text('#!/bin/sh\n[ "$1" = show ] && exit 1\necho pyyaml==6.0\n')
    pip.chmod(0o755)
    output = tmp_path / "github-output"
    done = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", "\n".join(lines)], cwd=tmp_path,
        env={"GITHUB_OUTPUT": str(output), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert written["llama-cpp-python"] == "none" and len(written["installed"]) == 16


def test_the_served_workflow_starts_vllm_and_gates_it_through_engine_openai() -> None:
    """The GPU job starts vLLM with the flags its cached-token report needs, then runs a
    budgets file whose every check talks to that server (untested here: no GPU was lent)."""
    from pytest_kvguard.gate.budgets_file import load_budgets_file

    job = _load(ROOT / ".github" / "workflows" / "served.yml")["jobs"]["vllm"]
    assert job["runs-on"] == ["self-hosted", "linux", "gpu"]
    commands = "\n".join(step.get("run", "") for step in job["steps"])
    for flag in ("vllm serve", "--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in commands
    gate = [s for s in job["steps"] if s.get("uses") == "./.github/actions/kvguard"]
    assert len(gate) == 1
    served = load_budgets_file(ROOT / gate[0]["with"]["budgets"])
    assert {check.engine for check in served.checks} == {"openai"}
    url = f"http://127.0.0.1:{job['env']['VLLM_PORT']}"
    assert {check.model.name for check in served.checks} == {url}
