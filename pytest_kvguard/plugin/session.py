"""The kvguard session: one object per pytest session, under one stash key on the config.

As pytest-benchmark's ``BenchmarkSession`` and xdist's ``DSession`` do, ``KvguardSession`` owns
what a pytest session shares: the budgets file (parsed), the baseline, the engine environments,
the model preview's swaps, the plan of checks, the engine worker pool (and the in-process runner
of engine adapter tests) and their closing, the rows the reporter prints, and the failures that
belong to no test. The plugin's hooks, the budgets-file items, the ``kvguard`` fixture and the
reporter reach it with ``KvguardSession.of(config)``.

``judge`` is the one place the plugin turns a check's outcome into pass or fail, for a
budgets-file item and a fixture test alike: it compares the outcome with the baseline or the
preview's other run and says why the check fails, if it does. The budgets themselves are judged
in the engine worker (``gate.runner``); ``judge`` reads their violations from the outcome.
A failure of the whole session (``fail``) becomes pytest's exit status in ``finish``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import EngineOptions
from pytest_kvguard.gate.baseline import (
    Baseline,
    Tolerance,
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
from pytest_kvguard.gate.outcome import CheckError, Outcome, Row, row_from_json
from pytest_kvguard.gate.report import machine
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.isolation.workers import WorkerPool, failure_text
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import Check

PROPERTY = "kvguard"
"""user_properties name that carries a check's row (to the xdist controller and JUnit)."""
NO_SCENARIO = (
    "kv_budget marker, but the test ran no kvguard scenario (fix: call kvguard.stream(...))"
)


@dataclass(frozen=True)
class Against:
    """What a check's run is compared with instead of the baseline: the upgrade or model
    preview's other run, or why that run failed, or why the check is not compared at all."""

    python: str = ""
    """The other run's interpreter."""
    other: Outcome | None = None
    """The other run, when it ran."""
    error: str | None = None
    """Why the other run failed (``detail``: with the worker's traceback or last words)."""
    detail: str = ""
    model: str | None = None
    """The model preview's reference model, when its run failed (else the upgrade preview's
    environment failed)."""
    not_compared: str | None = None
    """Why the check is not previewed (its ``baseline_status``)."""


@dataclass(frozen=True)
class Verdict:
    """A check's outcome as judged (compared with its baseline or other run) and, when the
    check fails, why: the text of its failure, the same for a budgets-file item and a fixture
    test (an item adds where the check is declared)."""

    outcome: Outcome
    failure: str | None

    @property
    def passed(self) -> bool:
        return self.failure is None


def sendable(check: Check[Any]) -> Check[Any]:
    """The check with its model file found here: a worker's environment need not have the
    model packages."""
    return replace(check, model=replace(check.model, path=check.model.resolve()))


def failure_of(check: Check[Any], outcome: Outcome) -> str | None:
    """Why a judged outcome fails its check: its violations (a budget broken, a regression, a
    preview's other run that failed), or a negative control not caught; None when it passes."""
    if outcome.verdict == "FAIL":
        return "; ".join(outcome.violations)
    if outcome.verdict == "MISSED":
        return (
            f"negative control not caught: {outcome.policy} stayed within "
            f"{outcome.budget_text} ({check.reason})"
        )
    return None


def _engine_options() -> EngineOptions:
    try:
        return EngineOptions.from_env()
    except KvguardError as exc:
        raise pytest.UsageError(str(exc)) from None


_SESSION_KEY = pytest.StashKey["KvguardSession"]()


class KvguardSession:
    """Everything one pytest session shares, and the one place its checks are judged."""

    def __init__(
        self,
        config: pytest.Config,
        *,
        budgets_file: BudgetsFile | None = None,
        baseline: Baseline | None = None,
        environments: Environments | None = None,
        model_swaps: Sequence[ModelSwap] = (),
        facts_diffs: Sequence[FactsDiff] = (),
        fault: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.config = config
        self.budgets_file = budgets_file
        self.baseline = baseline
        """--kvguard-baseline, loaded."""
        self.environments = environments if environments is not None else Environments()
        self.model_swaps = list(model_swaps)
        """The model preview's swaps (--kvguard-against-model, ``against_models:``)."""
        self.facts_diffs = list(facts_diffs)
        """Each swap's facts diff, read before any run (header and JSON report)."""
        self.fault = fault
        """--kvguard-inject-fault: injected in the engine workers, never in this process."""
        self.timeout = timeout
        """--kvguard-timeout: a check's time limit where the check sets none."""
        self.plan: list[Check[Any]] = []
        """The budgets-file checks this session will run, in order (not under xdist)."""
        self.rows: dict[str, list[Row]] = {}
        """Each test's rows, as its reports carry them (on the xdist controller too)."""
        self.expected: set[str] = set()
        """Node ids of the budgets-file checks collected (here or on the xdist workers)."""
        self.failures: list[str] = []
        """Why the session fails though no test did (``fail``)."""
        self._verdicts: dict[str, list[Verdict]] = {}
        self._runner: Runner | None = None
        self._pool: WorkerPool | None = None

    @classmethod
    def of(cls, config: pytest.Config) -> KvguardSession:
        """The config's session (one without budgets file or baseline before ``attach``)."""
        if _SESSION_KEY not in config.stash:
            cls(config).attach()
        return config.stash[_SESSION_KEY]

    def attach(self) -> None:
        """Make this the config's session."""
        self.config.stash[_SESSION_KEY] = self

    # The engines: workers for the gate, an in-process runner for engine adapter tests.

    @property
    def runner(self) -> Runner:
        """An in-process runner (the ``kvguard_runner`` fixture, for engine adapter tests):
        engines load into the pytest process itself. The gate never uses it."""
        if self._runner is None:
            self._runner = Runner(_engine_options(), self._say)
        return self._runner

    @property
    def pool(self) -> WorkerPool:
        """The session's engine workers, started on first use."""
        if self._pool is None:
            self._pool = WorkerPool(_engine_options(), self._say, self.fault)
        return self._pool

    def close(self) -> None:
        """Stop the runner's engines and the workers."""
        if self._runner is not None:
            self._runner.close()
        if self._pool is not None:
            self._pool.close()

    # Running and judging a check.

    def run(self, check: Check[Any]) -> Verdict:
        """Run a check in its engine worker, with the preview's other run if any, and
        ``judge`` it. ``WorkerLost`` when the worker died or hung running it."""
        outcome, against = self._run(check)
        return self.judge(check, outcome, against)

    def judge(self, check: Check[Any], outcome: Outcome, against: Against | None = None) -> Verdict:
        """The one judgement of a check's outcome, for budgets-file items and fixture tests:
        compared with ``against`` (the preview's other run) or else the baseline, then failed
        for its violations (budgets judged in the worker, regressions found here) or for a
        negative control not caught."""
        if against is None:
            if self.baseline is not None:
                outcome = compare_with_baseline(outcome, self.baseline, self.tolerances)
        elif against.not_compared is not None:
            outcome = replace(outcome, baseline_status=against.not_compared)
        elif against.other is not None:
            outcome = compare_with_other_run(
                outcome, against.other, self.tolerances, against.python
            )
        else:  # the other run's last words stay in its JSON row
            outcome = other_run_failed(
                outcome, against.python, against.error or "", against.detail, against.model
            )
        return Verdict(outcome, failure_of(check, outcome))

    def judge_marked_test(self, item: pytest.Item) -> str | None:
        """Why a test with a kv_budget marker fails, though its body passed: no scenario ran,
        or the verdicts of those that ran; None when it passes."""
        verdicts = self._verdicts.get(item.nodeid, [])
        if not verdicts:
            return NO_SCENARIO
        return "; ".join(v.failure for v in verdicts if v.failure is not None) or None

    @property
    def tolerances(self) -> dict[str, Tolerance]:
        """The baseline tolerances: the budgets file's, else the defaults."""
        if self.budgets_file is not None:
            return self.budgets_file.baseline_tolerances
        return tolerances({})

    def _run(self, check: Check[Any]) -> tuple[Outcome, Against | None]:
        timeout = check.timeout if check.timeout is not None else self.timeout
        sent = sendable(check)
        python = self.environments.python_for(check.engines)
        worker = self.pool.worker(python)
        if worker.plan is None:
            worker.plan = self._plan_for(python)
        swap = swap_for(check, self.model_swaps)
        if swap is not None:
            return self._model_preview(check, swap, python, timeout)
        outcome = self.pool.run(sent, python, timeout)
        other_python, why_not = self.environments.against_for(check.engines)
        if other_python is not None:
            try:
                other = self.pool.run(sent, other_python, timeout, judged=False)
            except KvguardError as exc:
                return outcome, Against(other_python, error=str(exc), detail=failure_text(exc))
            return outcome, Against(other_python, other=other)
        if why_not is not None:
            return outcome, Against(not_compared=why_not)
        return outcome, None

    def _model_preview(
        self, check: Check[Any], swap: ModelSwap, python: str, timeout: float | None
    ) -> tuple[Outcome, Against]:
        """The check on the candidate, to be judged against the same check on the model it
        replaces."""
        reference = self.pool.worker(python, judged=False)  # its own worker only under a fault
        if reference.plan is None:
            reference.plan = self._plan_for(python)
        why_not = not_previewed(check, swap)
        if why_not is not None:
            return self.pool.run(sendable(check), python, timeout), Against(not_compared=why_not)
        try:
            outcome = self.pool.run(sendable(swapped(check, swap)), python, timeout)
        except KvguardError as exc:  # the row says which of the two runs failed
            exc.message = f"on the candidate {swap.candidate.name}: {exc.message}"
            raise
        try:
            other = self.pool.run(sendable(check), python, timeout, judged=False)
        except KvguardError as exc:
            failed = Against(python, error=str(exc), detail=failure_text(exc))
            return outcome, replace(failed, model=check.model.name)
        return outcome, Against(python, other=other)

    def _plan_for(self, python: str) -> list[Check[Any]]:
        """The session's checks that run on this interpreter, for the worker to plan its runs."""
        planned = []
        for check in self.plan:
            try:
                if self.environments.python_for(check.engines) == python:
                    planned.append(sendable(check))
                    # The candidate's runs are planned as the model's are (grouped alike), so
                    # the two differ by the model alone.
                    swap = swap_for(check, self.model_swaps)
                    if swap is not None and not_previewed(check, swap) is None:
                        planned.append(sendable(swapped(check, swap)))
            except KvguardError:
                continue  # the check reports it when it runs
        return planned

    def _say(self, line: str, detail: bool = False) -> None:
        config = self.config
        terminal = config.pluginmanager.get_plugin("terminalreporter")
        if terminal is None or config.get_verbosity() < (1 if detail else 0):
            return
        capture = config.pluginmanager.get_plugin("capturemanager")
        if capture is None:
            terminal.write_line(f"[kvguard] {line}")
            return
        with capture.global_and_fixture_disabled():
            terminal.write_line(f"[kvguard] {line}")

    # What a test ran: on its reports (table, JSON, JUnit), and for its marker.

    def record(self, item: pytest.Item, verdict: Verdict) -> None:
        """Attach a judged check's figures to the item: on its reports (table, JSON, JUnit)
        and as a section; keep its verdict for the item's kv_budget marker.

        JUnit XML gets the verdict and every figure as ``kvguard.*`` properties, besides the
        whole row as JSON in the ``kvguard`` property.
        """
        outcome = verdict.outcome
        item.user_properties.append((PROPERTY, json.dumps(outcome.to_json())))
        item.user_properties.append(("kvguard.verdict", outcome.verdict))
        for metric, value in sorted(outcome.metrics.items()):
            item.user_properties.append((f"kvguard.{metric}", f"{value:.6g}"))
        self._verdicts.setdefault(item.nodeid, []).append(verdict)
        figures = "\n".join(f"{k}: {v:.4f}" for k, v in sorted(outcome.metrics.items()))
        item.add_report_section("call", "kvguard", f"{outcome.name} [{outcome.verdict}]\n{figures}")
        for title, text in SCENARIOS[outcome.scenario].report_sections(outcome):
            item.add_report_section("call", title, text)

    def record_error(self, item: pytest.Item, error: CheckError) -> None:
        """A check that could not run: its ERROR row on the item's reports."""
        item.user_properties.append((PROPERTY, json.dumps(error.to_json())))

    # The rows, as reports arrive (where the reporter runs: the xdist controller, or here).

    def expect(self, node_ids: list[str]) -> None:
        """Budgets-file checks collected: each must bring a row, or the run is incomplete."""
        self.expected.update(node_ids)

    def add_rows(self, report: pytest.TestReport) -> None:
        """The rows a test's report carries (its call, or the phase that failed it)."""
        rows = [row_from_json(json.loads(str(v))) for k, v in report.user_properties
                if k == PROPERTY]  # fmt: skip
        if rows and (report.when == "call" or report.failed):
            self.rows[report.nodeid] = rows

    def all_rows(self) -> list[Row]:
        return [row for rows in self.rows.values() for row in rows]

    def missing(self) -> list[str]:
        """Checks collected that brought no row."""
        return sorted(self.expected - self.rows.keys())

    def baseline_warning(self) -> str | None:
        """Said loudly: a baseline from another kind of machine is compared all the same."""
        differences = self.baseline.differences(machine()) if self.baseline else []
        if not differences:
            return None
        return (
            "kvguard WARNING: the baseline comes from a different machine ("
            + "; ".join(differences)
            + "): figures may move for that reason alone"
        )

    # The session's end.

    def fail(self, reason: str) -> None:
        """Fail the session though every test passed (a model preview that compared nothing):
        ``finish`` makes it pytest's exit status, the terminal summary says ``reason``."""
        self.failures.append(reason)

    def finish(self, session: pytest.Session) -> None:
        """At pytest_sessionfinish, first: a session-level failure is the exit status
        (TESTS_FAILED where it would have been OK or NO_TESTS_COLLECTED), so pytest's exit code
        and what reads ``session.exitstatus`` later (the JSON report) have it (the
        ``exitstatus`` argument other plugins' sessionfinish hooks get is pytest's own); then
        the engines close."""
        no_test_failed = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.failures and session.exitstatus in no_test_failed:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        self.close()
