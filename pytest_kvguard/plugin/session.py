"""What one pytest session shares: its runner, budgets file, baseline, and how figures are kept.

The plugin's hooks, the budgets-file items and the ``kvguard`` fixture all reach the session's
state through ``config.stash`` under these keys.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import EngineOptions
from pytest_kvguard.gate.baseline import (
    Baseline,
    compare_with_baseline,
    compare_with_other_run,
    other_run_failed,
    tolerances,
)
from pytest_kvguard.gate.budgets_file import BudgetsFile
from pytest_kvguard.gate.engine_pythons import Environments
from pytest_kvguard.gate.model_preview import (
    FactsDiff,
    ModelSwap,
    not_previewed,
    swap_for,
    swapped,
)
from pytest_kvguard.gate.outcome import CheckError, Outcome
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.isolation.workers import WorkerPool, failure_text
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import Check

BUDGETS_KEY = pytest.StashKey[BudgetsFile]()
RUNNER_KEY = pytest.StashKey[Runner]()
BASELINE_KEY = pytest.StashKey[Baseline]()
FAULT_KEY = pytest.StashKey[str]()
POOL_KEY = pytest.StashKey[WorkerPool]()
ENVIRONMENTS_KEY = pytest.StashKey[Environments]()
TIMEOUT_KEY = pytest.StashKey[float | None]()
OUTCOMES_KEY = pytest.StashKey[list[Outcome]]()
MODEL_SWAPS_KEY = pytest.StashKey[list[ModelSwap]]()
"""The model preview's swaps (--kvguard-against-model, ``against_models:``)."""
FACTS_DIFFS_KEY = pytest.StashKey[list[FactsDiff]]()
"""Each swap's facts diff, read before any run (header and JSON report)."""
PLAN_KEY = pytest.StashKey[list[Check[Any]]]()
"""The budgets-file checks this session will run, in order (not under xdist)."""
PROPERTY = "kvguard"
"""user_properties name that carries a check's row (to the xdist controller and JUnit)."""


def _engine_options() -> EngineOptions:
    try:
        return EngineOptions.from_env()
    except KvguardError as exc:
        raise pytest.UsageError(str(exc)) from None


def session_runner(config: pytest.Config) -> Runner:
    """An in-process runner (the ``kvguard_runner`` fixture, for engine adapter tests): engines
    load into the pytest process itself. The gate never uses it."""
    if RUNNER_KEY not in config.stash:
        config.stash[RUNNER_KEY] = Runner(_engine_options(), _say_function(config))
    return config.stash[RUNNER_KEY]


def session_pool(config: pytest.Config) -> WorkerPool:
    """The session's engine workers, started on first use."""
    if POOL_KEY not in config.stash:
        fault = config.stash.get(FAULT_KEY, None)
        config.stash[POOL_KEY] = WorkerPool(_engine_options(), _say_function(config), fault)
    return config.stash[POOL_KEY]


def run_gated(config: pytest.Config, check: Check[Any]) -> Outcome:
    """Run a check in its engine worker and judge it: budgets, then the upgrade preview's
    other run or the baseline. ``WorkerLost`` when the worker died or hung running it."""
    environments = config.stash.get(ENVIRONMENTS_KEY, Environments())
    timeout = check.timeout if check.timeout is not None else config.stash.get(TIMEOUT_KEY, None)
    sent = sendable(check)
    pool = session_pool(config)
    python = environments.python_for(check.engines)
    worker = pool.worker(python)
    if worker.plan is None:
        worker.plan = _plan_for(config, environments, python)
    swaps: list[ModelSwap] = config.stash.get(MODEL_SWAPS_KEY, [])
    swap = swap_for(check, swaps)
    if swap is not None:
        return _model_preview(config, check, swap, python, timeout)
    outcome = pool.run(sent, python, timeout)
    other_python, why_not = environments.against_for(check.engines)
    if other_python is not None:
        try:
            other = pool.run(sent, other_python, timeout, judged=False)
        except KvguardError as exc:  # the other run's last words stay in its JSON row
            return other_run_failed(outcome, other_python, str(exc), failure_text(exc))
        return compare_with_other_run(outcome, other, _tolerances(config), other_python)
    if why_not is not None:
        return replace(outcome, baseline_status=why_not)
    return against_baseline(config, outcome)


def _model_preview(
    config: pytest.Config, check: Check[Any], swap: ModelSwap, python: str, timeout: float | None
) -> Outcome:
    """The check on the candidate, judged against the same check on the model it replaces."""
    pool = session_pool(config)
    reference = pool.worker(python, judged=False)  # its own worker only under a fault
    if reference.plan is None:
        environments = config.stash.get(ENVIRONMENTS_KEY, Environments())
        reference.plan = _plan_for(config, environments, python)
    why_not = not_previewed(check, swap)
    if why_not is not None:
        return replace(pool.run(sendable(check), python, timeout), baseline_status=why_not)
    try:
        outcome = pool.run(sendable(swapped(check, swap)), python, timeout)
    except KvguardError as exc:  # the row says which of the two runs failed
        exc.message = f"on the candidate {swap.candidate.name}: {exc.message}"
        raise
    try:
        other = pool.run(sendable(check), python, timeout, judged=False)
    except KvguardError as exc:  # the other run's last words stay in its JSON row
        return other_run_failed(outcome, python, str(exc), failure_text(exc), check.model.name)
    return compare_with_other_run(outcome, other, _tolerances(config), python)


def sendable(check: Check[Any]) -> Check[Any]:
    """The check with its model file found here: a worker's environment need not have the
    model packages."""
    return replace(check, model=replace(check.model, path=check.model.resolve()))


def _plan_for(config: pytest.Config, environments: Environments, python: str) -> list[Check[Any]]:
    """The session's checks that run on this interpreter, for the worker to plan its runs."""
    planned = []
    swaps: list[ModelSwap] = config.stash.get(MODEL_SWAPS_KEY, [])
    for check in config.stash.get(PLAN_KEY, []):
        try:
            if environments.python_for(check.engines) == python:
                planned.append(sendable(check))
                # The candidate's runs are planned as the model's are (grouped alike), so the
                # two differ by the model alone.
                swap = swap_for(check, swaps)
                if swap is not None and not_previewed(check, swap) is None:
                    planned.append(sendable(swapped(check, swap)))
        except KvguardError:
            continue  # the check reports it when it runs
    return planned


def _tolerances(config: pytest.Config) -> Any:
    budgets_file = config.stash.get(BUDGETS_KEY, None)
    return budgets_file.baseline_tolerances if budgets_file else tolerances({})


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
    return compare_with_baseline(outcome, baseline, _tolerances(config))


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
    for title, text in SCENARIOS[outcome.scenario].report_sections(outcome):
        item.add_report_section("call", title, text)


def record_error(item: pytest.Item, error: CheckError) -> None:
    item.user_properties.append((PROPERTY, json.dumps(error.to_json())))
