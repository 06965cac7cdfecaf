"""What one pytest session shares: its runner, budgets file, baseline, and how figures are kept.

The plugin's hooks, the budgets-file items and the ``kvguard`` fixture all reach the session's
state through ``config.stash`` under these keys.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from pytest_kvguard.baseline import Baseline, compare_with_baseline, tolerances
from pytest_kvguard.budgets_file import BudgetsFile
from pytest_kvguard.engines import EngineOptions
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.outcome import CheckError, Outcome
from pytest_kvguard.runner import Runner

BUDGETS_KEY = pytest.StashKey[BudgetsFile]()
RUNNER_KEY = pytest.StashKey[Runner]()
BASELINE_KEY = pytest.StashKey[Baseline]()
FAULT_KEY = pytest.StashKey[contextlib.ExitStack]()
OUTCOMES_KEY = pytest.StashKey[list[Outcome]]()
PROPERTY = "kvguard"
"""user_properties name that carries a check's row (to the xdist controller and JUnit)."""


def session_runner(config: pytest.Config) -> Runner:
    """The session's runner, made on first use: engines load once, runs are reused."""
    if RUNNER_KEY not in config.stash:
        try:
            options = EngineOptions.from_env()
        except KvguardError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.stash[RUNNER_KEY] = Runner(options, _say_function(config))
    return config.stash[RUNNER_KEY]


def _say_function(config: pytest.Config) -> Any:
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def say(line: str, detail: bool = False) -> None:
        if terminal is None or config.get_verbosity() < (1 if detail else 0):
            return
        if capture is None:
            terminal.write_line(f"[kvguard] {line}")
            return
        with capture.global_and_fixture_disabled():
            terminal.write_line(f"[kvguard] {line}")

    return say


def against_baseline(config: pytest.Config, outcome: Outcome) -> Outcome:
    """The outcome compared with --kvguard-baseline, when one was given."""
    baseline = config.stash.get(BASELINE_KEY, None)
    if baseline is None:
        return outcome
    budgets_file = config.stash.get(BUDGETS_KEY, None)
    rules = budgets_file.baseline_tolerances if budgets_file else tolerances({})
    return compare_with_baseline(outcome, baseline, rules)


def record(item: pytest.Item, outcome: Outcome) -> None:
    """Attach the figures to the item: on its reports (table, JSON, JUnit) and as a section.

    JUnit XML gets the verdict and every figure as ``kvguard.*`` properties, besides the
    whole row as JSON in the ``kvguard`` property.
    """
    item.user_properties.append((PROPERTY, json.dumps(outcome.to_json())))
    item.user_properties.append(("kvguard.verdict", outcome.verdict))
    for metric, value in sorted(outcome.metrics.items()):
        item.user_properties.append((f"kvguard.{metric}", f"{value:.6g}"))
    item.stash.setdefault(OUTCOMES_KEY, []).append(outcome)
    figures = "\n".join(f"{k}: {v:.4f}" for k, v in sorted(outcome.metrics.items()))
    item.add_report_section("call", "kvguard", f"{outcome.name} [{outcome.verdict}]\n{figures}")


def record_error(item: pytest.Item, error: CheckError) -> None:
    item.user_properties.append((PROPERTY, json.dumps(error.to_json())))
