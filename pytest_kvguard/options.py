"""kvguard's command-line options, each with an ini twin, and how their values are read."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvguard.faults import FAULTS

OPTIONS = [
    ("--kvguard", "kvguard_budgets", "BUDGETS_YAML", "Run the checks declared in this budgets "
     "file (relative to the current directory; the ini value: to rootdir). Without test paths "
     "on the command line, only these checks run; kvguard-scenarios lists each scenario's "
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
]  # fmt: skip


def add_options(parser: pytest.Parser) -> None:
    """Every option in the kvguard group, each with its ini twin."""
    group = parser.getgroup("kvguard", "kvguard: KV-cache policy regression gate")
    for flag, ini, metavar, doc in OPTIONS:
        choices = sorted(FAULTS) if ini == "kvguard_inject_fault" else None
        group.addoption(flag, metavar=metavar, default=None, choices=choices,
                        help=f"{doc} (ini: {ini})")  # fmt: skip
        parser.addini(ini, f"As {flag}.")
    group.addoption(
        "--kvguard-plot",
        action="store_true",
        default=None,
        help="Also write PNG plots next to the JSON report: NAME.kv-bytes.png (KV bytes "
        "against tokens fed, measured and predicted, per check) and NAME.sink-sweep.png "
        "(post-eviction perplexity against sinks, for sweep checks). Needs --kvguard-json and "
        "matplotlib (pytest-kvguard[plot]). Default: off (ini: kvguard_plot).",
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
