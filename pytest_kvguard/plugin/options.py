"""kvguard's command-line options, each with an ini twin, and how their values are read."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pytest_kvguard.gate.faults import FAULTS

DEFAULT_TIMEOUT = 1800.0
"""Seconds a check may run before its worker is killed: far above the slowest bundled check."""

OPTIONS = [
    ("--kvguard", "kvguard_budgets", "BUDGETS_YAML", "Run the checks declared in this budgets "
     "file (relative to the current directory; the ini value: to rootdir). Without test paths "
     "on the command line, only these checks run; kvguard scenarios lists each scenario's "
     "parameters and budgets. Default: none."),
    ("--kvguard-json", "kvguard_json", "PATH", "Write the JSON report (every figure, engine "
     "versions, model sha256, machine) here. Default: no JSON report."),
    ("--kvguard-baseline", "kvguard_baseline", "REPORT_JSON", "Compare every check with the "
     "same-named check in this earlier JSON report; a figure that regressed past its tolerance "
     "(budgets file 'baseline_tolerances:', over built-in defaults) fails the check. Default: "
     "no comparison."),
    ("--kvguard-inject-fault", "kvguard_inject_fault", "FAULT", "Run the whole session with "
     "this engine fault injected (one of: " + ", ".join(sorted(FAULTS)) + "), to see which "
     "checks catch it. The run is expected to fail. Default: none."),
    ("--kvguard-timeout", "kvguard_timeout", "SECONDS", "Kill a check's engine worker when the "
     "check runs longer than this; the check is an ERROR that says so and the run goes on. A "
     "check's own 'timeout:' (budgets file, or its defaults) wins. 0: no limit. Default: "
     f"{DEFAULT_TIMEOUT:g}."),
]  # fmt: skip
ENVIRONMENT_OPTIONS = [
    ("--kvguard-engine-python", "kvguard_engine_python", "ENGINE=PYTHON", "Run ENGINE's checks "
     "in the virtual environment whose interpreter is PYTHON (it needs that engine version; "
     "kvguard env creates one). May be given once per engine; overrides the budgets file's "
     "'engine_python:'. Default: this environment."),
    ("--kvguard-against", "kvguard_against", "[ENGINE=]PYTHON", "Upgrade preview: run every "
     "check (of ENGINE, or of every engine) a second time in PYTHON's environment and judge "
     "this run against it with the baseline tolerances; the table shows both versions' "
     "figures. Overrides the budgets file's 'against:'. Default: no preview."),
    ("--kvguard-against-model", "kvguard_against_model", "NAME=PATH", "Model preview: every "
     "check on model NAME (a bundled name, or a .gguf file or model folder, matched to the "
     "checks by the file it resolves to) runs a second time on the candidate PATH (a .gguf "
     "file or a model folder) and the candidate's run is judged against NAME's with the "
     "baseline tolerances. Paths are relative to the current directory (the ini value's: to "
     "rootdir). The header lists the cache-relevant facts that differ; the table shows both "
     "runs' figures; a preview that compared nothing fails. May be given once per model; "
     "overrides the budgets file's 'against_models:'. Default: no preview."),
]  # fmt: skip
"""Options given once per engine (or model): repeatable on the command line, one per line in
the ini."""

ENVIRONMENT = {
    "KVGUARD_N_GPU_LAYERS": "layers llama.cpp offloads to a GPU (default 0; -1 for all)",
    "KVGUARD_THREADS": "engine threads (default: all cores)",
    "KVGUARD_LLAMA_LOG": "set to 1 to let llama.cpp log to stderr",
    "KVGUARD_LLAMA_SERVER": "the `llama-server` binary engine `llama_server` starts (default: "
    "the one beside the engine worker's Python, which `kvguard build-llama-server` puts "
    "there, then PATH)",
    "KVGUARD_SERVER_START_TIMEOUT": "seconds a started llama-server gets to answer `/health` "
    "(default 120)",
    "KVGUARD_SERVER_TIMEOUT": "seconds one request to llama-server may take (default 600)",
    "KVGUARD_CACHE": "where `kvguard build-llama-server` caches the built binary (default "
    "`$XDG_CACHE_HOME/kvguard`, else `~/.cache/kvguard`)",
    "KVGUARD_MLX_BLAS": "`bundled` keeps mlx's reference BLAS on Linux (default: preload "
    "OpenBLAS when installed)",
    "KVGUARD_ENV_DIR": "where `kvguard env` caches environments, and `kvguard bisect` finds "
    "and makes one per engine release (default `~/.cache/pytest-kvguard/envs`)",
    "CMAKE_ARGS": "llama.cpp's build flags for `kvguard build-llama-server` and `kvguard env` "
    "(default on x86-64: the instruction-set pins `.ci/install` uses)",
    "XDG_CACHE_HOME": "the cache folder kvguard's caches go under (default `~/.cache`)",
    "GITHUB_STEP_SUMMARY": "set by GitHub Actions: the tables are written there as Markdown",
}
"""Every environment variable kvguard reads and what it does (docs/reference.md's table; a
test matches these names with those the package's code reads)."""
MODEL_ENVIRONMENT = "use this GGUF file for the bundled model `{model}`"
"""What ``models.env_var_for(name)`` does, once per bundled model."""


def add_options(parser: pytest.Parser) -> None:
    """Every option in the kvguard group, each with its ini twin."""
    group = parser.getgroup("kvguard", "kvguard: KV-cache policy regression gate")
    for flag, ini, metavar, doc in OPTIONS:
        choices = sorted(FAULTS) if ini == "kvguard_inject_fault" else None
        group.addoption(flag, metavar=metavar, default=None, choices=choices,
                        help=f"{doc} (ini: {ini})")  # fmt: skip
        parser.addini(ini, f"As {flag}.")
    for flag, ini, metavar, doc in ENVIRONMENT_OPTIONS:
        group.addoption(flag, metavar=metavar, action="append", default=None,
                        help=f"{doc} (ini: {ini}, one per line)")  # fmt: skip
        parser.addini(ini, f"As {flag}, one per line.", type="linelist")
    group.addoption(
        "--kvguard-plot",
        action="store_true",
        default=None,
        help="Also write PNG plots next to the JSON report, one per plot the checks draw: "
        "NAME.kv-bytes.png (KV bytes against tokens fed, measured and predicted, per check), "
        "NAME.sink-sweep.png (post-eviction perplexity against sinks, for sweep checks) and "
        "NAME.sink-heads.png (attention mass on the first tokens per layer and head, for "
        "attention checks and explained red checks). Needs --kvguard-json and matplotlib "
        "(pytest-kvguard[plot]). Default: off (ini: kvguard_plot).",
    )
    parser.addini("kvguard_plot", "As --kvguard-plot.", type="bool", default=False)


def setting(config: pytest.Config, ini: str) -> str | None:
    """An option's value, else its ini twin's (None when neither is set)."""
    flag = next(f for f, i, _, _ in OPTIONS if i == ini)
    value = config.getoption(flag.lstrip("-").replace("-", "_")) or config.getini(ini)
    return str(value) if value else None


def path_setting(config: pytest.Config, ini: str) -> Path | None:
    """A path option as the user wrote it (messages quote it), or the ini value under rootdir."""
    flag = next(f for f, i, _, _ in OPTIONS if i == ini)
    value = config.getoption(flag.lstrip("-").replace("-", "_"))
    if value:
        return Path(value)
    ini_value = config.getini(ini)
    return config.rootpath / ini_value if ini_value else None


def plot_enabled(config: pytest.Config) -> bool:
    flag = config.getoption("kvguard_plot")
    return bool(config.getini("kvguard_plot") if flag is None else flag)


def list_setting(config: pytest.Config, ini: str) -> list[str]:
    """A per-engine option's values, else its ini twin's lines."""
    flag = next(f for f, i, _, _ in ENVIRONMENT_OPTIONS if i == ini)
    values = config.getoption(flag.lstrip("-").replace("-", "_"))
    return list(values) if values else [str(v) for v in config.getini(ini)]


def timeout_setting(config: pytest.Config) -> float | None:
    """The session's per-check time limit in seconds; None for no limit."""
    raw = setting(config, "kvguard_timeout")
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < math.inf:  # nan fails both comparisons
        raise pytest.UsageError(
            f"--kvguard-timeout {raw!r} is not a number of seconds (fix: e.g. 900, or 0 for none)"
        )
    return seconds or None
