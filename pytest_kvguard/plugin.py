"""pytest hooks for kvguard: options, marker, fixture, budgets-file items, table and JSON report.

Only wiring lives here; the logic is in plain modules that do not import pytest.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.baseline import Baseline, load_baseline, regressions, tolerances, upgrades
from pytest_kvguard.budgets import Budgets
from pytest_kvguard.budgets_file import (
    BudgetsFile,
    Check,
    RecallSpec,
    ReplaySpec,
    load_budgets_file,
)
from pytest_kvguard.engines import (
    ENGINES,
    EngineOptions,
    engine_info,
    installed_version,
)
from pytest_kvguard.engines.blas import preload_openblas
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.faults import FAULTS, fault, inject
from pytest_kvguard.models import ModelRef, parse_model
from pytest_kvguard.plot import plot_path, require_matplotlib, write_kv_plot, write_sweep_plot
from pytest_kvguard.policies import DEFAULT_CHECKPOINT_STEP, make_policy
from pytest_kvguard.report import (
    build_report,
    error_row,
    machine,
    render_table,
    step_summary,
    write_json,
)
from pytest_kvguard.runner import CheckOutcome, Judging, Runner, run_check
from pytest_kvguard.scenarios.edit_replay import DEFAULT_CHAT
from pytest_kvguard.scenarios.memory import DEFAULT_LENGTHS, check_lengths
from pytest_kvguard.scenarios.recall import (
    DEFAULT_ANSWER,
    DEFAULT_FACT,
    DEFAULT_FILLER_TOKENS,
    DEFAULT_QUESTION,
)
from pytest_kvguard.scenarios.sweep import DEFAULT_SINKS as DEFAULT_SWEEP
from pytest_kvguard.scenarios.sweep import check_sinks
from pytest_kvguard.texts import DEFAULT_TEXT

BUDGETS_KEY = pytest.StashKey[BudgetsFile]()
RUNNER_KEY = pytest.StashKey[Runner]()
BASELINE_KEY = pytest.StashKey[Baseline]()
FAULT_KEY = pytest.StashKey[contextlib.ExitStack]()
EXPECTED_KEY = pytest.StashKey[set[str]]()
OUTCOMES_KEY = pytest.StashKey[list[CheckOutcome]]()
PROPERTY = "kvguard"
"""user_properties name that carries a check's figures (to the xdist controller and JUnit)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvguard", "kvguard: KV-cache policy regression gate")
    group.addoption(
        "--kvguard",
        metavar="BUDGETS_YAML",
        default=None,
        help="Run the checks declared in this budgets file (relative to the current directory). "
        "Without test paths on the command line, only these checks run. Default: none "
        "(ini: kvguard_budgets, relative to rootdir).",
    )
    group.addoption(
        "--kvguard-json",
        metavar="PATH",
        default=None,
        help="Write the JSON report (every figure, engine versions, model sha256, machine) "
        "here. Default: no JSON report (ini: kvguard_json).",
    )
    group.addoption(
        "--kvguard-plot",
        action="store_true",
        default=False,
        help="Also write PNG plots next to the JSON report: NAME.kv-bytes.png (KV bytes "
        "against tokens fed, measured and predicted, per check) and NAME.sink-sweep.png "
        "(post-eviction perplexity against sinks, for sweep checks). Needs --kvguard-json and "
        "matplotlib (pytest-kvguard[plot]). Default: off.",
    )
    group.addoption(
        "--kvguard-baseline",
        metavar="REPORT_JSON",
        default=None,
        help="Compare every check with the same-named check in this earlier JSON report; a "
        "figure that regressed past its tolerance (budgets file 'baseline_tolerances:', over "
        "built-in defaults) fails the check. Default: no comparison (ini: kvguard_baseline).",
    )
    group.addoption(
        "--kvguard-inject-fault",
        metavar="FAULT",
        default=None,
        choices=sorted(FAULTS),
        help="Run the whole session with this engine fault injected (one of: "
        + ", ".join(sorted(FAULTS))
        + "), to see which checks catch it. The run is expected to fail. Default: none.",
    )
    parser.addini("kvguard_baseline", "Baseline JSON report, as --kvguard-baseline.")
    parser.addini("kvguard_budgets", "Budgets file to run, as --kvguard (relative to rootdir).")
    parser.addini("kvguard_json", "JSON report path, as --kvguard-json (relative to rootdir).")


def _option_path(config: pytest.Config, option: str, ini: str) -> Path | None:
    """The path as the user wrote it (messages quote it), or the ini value under rootdir."""
    value = config.getoption(option)
    if value:
        return Path(value)
    ini_value = config.getini(ini)
    return config.rootpath / ini_value if ini_value else None


def pytest_configure(config: pytest.Config) -> None:
    signature = ", ".join(f"{name}=None" for name in Budgets.names())
    config.addinivalue_line(
        "markers",
        f"kv_budget(*, {signature}): budgets the test's kvguard scenario results must stay within.",
    )
    config.pluginmanager.register(KvguardReporter(config), "kvguard-reporter")
    if importlib.util.find_spec("mlx") is not None:
        preload_openblas()  # before any test module can import mlx; cheap, imports no engine
    if config.getoption("kvguard_plot"):
        if _option_path(config, "kvguard_json", "kvguard_json") is None:
            raise pytest.UsageError(
                "--kvguard-plot writes next to the JSON report (fix: add --kvguard-json PATH)"
            )
        try:
            require_matplotlib()
        except KvguardError as exc:
            raise pytest.UsageError(str(exc)) from None
    fault_name = config.getoption("kvguard_inject_fault")
    if fault_name:
        faults = contextlib.ExitStack()
        try:
            faults.enter_context(inject(fault_name))
        except ImportError as exc:
            raise pytest.UsageError(
                f"fault '{fault_name}' needs engine '{fault(fault_name).engine}': {exc}"
            ) from None
        config.stash[FAULT_KEY] = faults
    baseline_path = _option_path(config, "kvguard_baseline", "kvguard_baseline")
    if baseline_path is not None:
        try:
            config.stash[BASELINE_KEY] = load_baseline(baseline_path)
        except KvguardError as exc:
            raise pytest.UsageError(str(exc)) from None
    budgets_path = _option_path(config, "kvguard", "kvguard_budgets")
    if budgets_path is None:
        return
    try:
        budgets_file = load_budgets_file(budgets_path)
        for check in budgets_file.checks:
            try:
                check.model.resolve()  # a missing model fails now, not mid-run
            except KvguardError as exc:
                raise exc.located(check.path, check.line) from None
    except KvguardError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[BUDGETS_KEY] = budgets_file
    # Without explicit test paths the gate runs only its checks, not the project's testpaths.
    collect = str(budgets_path.resolve())
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = [collect]
    elif collect not in config.args:
        config.args.append(collect)


def _runner(config: pytest.Config) -> Runner:
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


def _baseline_warning(config: pytest.Config) -> str | None:
    """Said loudly: a baseline from another kind of machine is compared all the same."""
    baseline = config.stash.get(BASELINE_KEY, None)
    differences = baseline.differences(machine()) if baseline else []
    if not differences:
        return None
    return (
        "kvguard WARNING: the baseline comes from a different machine ("
        + "; ".join(differences)
        + "): figures may move for that reason alone"
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    faults = config.stash.get(FAULT_KEY, None)
    if faults is not None:
        faults.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = []
    if FAULT_KEY in config.stash:
        chosen = fault(config.getoption("kvguard_inject_fault"))
        lines.append(
            f"kvguard FAULT INJECTED: {chosen.name} ({chosen.engine}: {chosen.what}); "
            "this run is expected to fail"
        )
    baseline = config.stash.get(BASELINE_KEY, None)
    if baseline is not None:
        lines.append(
            f"kvguard baseline: {baseline.path} ({len(baseline.checks)} checks, "
            f"saved {baseline.report.get('created', 'at an unknown time')})"
        )
        warning = _baseline_warning(config)
        if warning:
            lines.append(warning)
    budgets_file = config.stash.get(BUDGETS_KEY, None)
    if budgets_file is not None:
        lines.append(
            f"kvguard: budgets {budgets_file.path} ({len(budgets_file.checks)} checks, "
            f"sha256 {budgets_file.sha256[:12]})"
        )
        engines = sorted({e for c in budgets_file.checks for e in (c.engine, c.other_engine) if e})
        models = {c.model.name: c.model.resolve() for c in budgets_file.checks}
        lines.append(
            "kvguard engines: "
            + ", ".join(f"{e} {installed_version(e) or 'not installed'}" for e in engines)
        )
        lines.extend(f"kvguard model: {name} = {path}" for name, path in models.items())
        if "mlx" in engines:
            lines.append(f"kvguard mlx BLAS: {preload_openblas()}")
    else:
        versions = [f"{e} {installed_version(e)}" for e in ENGINES if installed_version(e)]
        lines.append("kvguard engines: " + (", ".join(versions) or "none installed"))
        if installed_version("mlx"):
            lines.append(f"kvguard mlx BLAS: {preload_openblas()}")
    return lines


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    budgets_file = parent.config.stash.get(BUDGETS_KEY, None)
    if budgets_file is not None and file_path.resolve() == budgets_file.path.resolve():
        collector: BudgetsCollector = BudgetsCollector.from_parent(parent, path=file_path)
        return collector
    return None


class BudgetsCollector(pytest.File):
    """The budgets file as a pytest file: one item per declared check."""

    def collect(self) -> Iterator[CheckItem]:
        for check in self.config.stash[BUDGETS_KEY].checks:
            yield CheckItem.from_parent(self, name=check.name, check=check)


class CheckFailed(Exception):
    """A budget broken (or a negative control not caught); its text is the whole report."""


class CheckItem(pytest.Item):
    """One check from the budgets file."""

    def __init__(self, *, check: Check, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        if check.expect_violation:
            self.user_properties.append(("kvguard_expect", "violation"))

    def runtest(self) -> None:
        check = self.check
        try:
            outcome = run_check(_runner(self.config), check)
        except KvguardError as exc:
            self.user_properties.append((PROPERTY, json.dumps(error_row(check.name, str(exc)))))
            raise KvguardError(str(exc.located(check.path, check.line))) from None
        outcome = _against_baseline(self.config, outcome)
        _record(self, outcome)
        if outcome.verdict == "FAIL":
            raise CheckFailed(f"{'; '.join(outcome.violations)} [{check.location}]")
        if outcome.verdict == "MISSED":
            raise CheckFailed(
                f"negative control not caught: {check.policy.describe()} stayed within "
                f"{outcome.budget_text} ({check.reason}) [{check.location}]"
            )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, (CheckFailed, KvguardError)):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, self.check.line - 1, f"kvguard check {self.check.name}"


def _against_baseline(config: pytest.Config, outcome: CheckOutcome) -> CheckOutcome:
    """The outcome with any regression against the baseline's same-named check added."""
    baseline = config.stash.get(BASELINE_KEY, None)
    if baseline is None:
        return outcome
    then = baseline.checks.get(outcome.name)
    if then is None:
        return replace(outcome, baseline_status="not in baseline")
    outcome = replace(outcome, baseline_changes=upgrades(then, outcome.to_json()))
    if outcome.expect_violation:
        return replace(outcome, baseline_status="not compared (negative control)")
    budgets_file = config.stash.get(BUDGETS_KEY, None)
    rules = budgets_file.baseline_tolerances if budgets_file else tolerances({})
    found = regressions(then, outcome.to_json(), rules)
    return replace(
        outcome,
        violations=[*outcome.violations, *found],
        baseline_status="regressed" if found else "within tolerance",
    )


def _record(item: pytest.Item, outcome: CheckOutcome) -> None:
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


class KvguardFixture:
    """Runs scenarios from a hand-written test; the test's kv_budget marker judges them."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        marker = request.node.get_closest_marker("kv_budget")
        self.budgets = Budgets(**marker.kwargs) if marker else Budgets()

    def stream(
        self,
        *,
        policy: str = "sink",
        cap: int | None = 256,
        sinks: int | None = None,
        positions: str | None = None,
        evict_step: int = 1,
        baseline: str = "full",
        tokens: int = 1500,
        text: str = DEFAULT_TEXT,
        engine: str = "llama_cpp",
        model: str = "smollm2-135m",
    ) -> CheckOutcome:
        """Run the ``stream`` scenario; returns the figures (``.metrics``) and verdict.

        ``positions`` defaults to the engine's own handling (llama_cpp reindexed, mlx absolute).
        """

        def run(runner: Runner, judging: Judging) -> CheckOutcome:
            handling = positions or engine_info(engine).native_positions
            return runner.stream_check(
                judging,
                engine=engine,
                model=self._model(model),
                policy=make_policy(
                    policy, cap=cap, sinks=sinks, positions=handling, evict_step=evict_step
                ),
                baseline=make_policy(baseline, cap=cap, positions=handling, evict_step=evict_step),
                tokens=tokens,
                text=text,
            )[0]

        return self._run(run)

    def parity(
        self,
        *,
        engines: tuple[str, str] = ("llama_cpp", "mlx"),
        tokens: int = 512,
        text: str = DEFAULT_TEXT,
        model: str = "smollm2-135m",
    ) -> CheckOutcome:
        """Run the ``parity`` scenario: full cache on two engines, the same token ids."""
        return self._run(
            lambda runner, judging: runner.parity_check(
                judging, engines=engines, model=self._model(model), tokens=tokens, text=text
            )[0]
        )

    def edit_replay(
        self,
        *,
        policy: str = "swa",
        followup: str = "edit",
        message: int | None = None,
        chat: str = DEFAULT_CHAT,
        checkpoints: int = 0,
        checkpoint_step: int = DEFAULT_CHECKPOINT_STEP,
        engine: str = "llama_cpp",
        model: str = "gemma3-270m",
    ) -> CheckOutcome:
        """Run the ``edit_replay`` scenario: cache the chat, send the follow-up, count tokens."""
        return self._run(
            lambda runner, judging: runner.replay_check(
                judging,
                engine=engine,
                model=self._model(model),
                policy=make_policy(
                    policy, checkpoints=checkpoints, checkpoint_step=checkpoint_step
                ),
                replay=ReplaySpec(chat, followup, message),
            )[0]
        )

    def sweep(
        self,
        *,
        sinks: Sequence[int] = DEFAULT_SWEEP,
        positions: Sequence[str] | None = None,
        cap: int = 256,
        evict_step: int = 1,
        baseline: str = "full",
        tokens: int = 1500,
        text: str = DEFAULT_TEXT,
        engine: str = "llama_cpp",
        model: str = "smollm2-135m",
    ) -> CheckOutcome:
        """Run the ``sweep`` scenario: each sink count (0 = window) under each position handling."""
        modes = tuple(positions or (engine_info(engine).native_positions,))
        return self._run(
            lambda runner, judging: runner.sweep_check(
                judging,
                engine=engine,
                model=self._model(model),
                sinks=check_sinks(list(sinks), cap),
                positions=modes,
                cap=cap,
                evict_step=evict_step,
                baseline=make_policy(baseline),
                tokens=tokens,
                text=text,
            )[0]
        )

    def recall(
        self,
        *,
        policy: str = "sink",
        cap: int | None = 256,
        sinks: int | None = None,
        positions: str | None = None,
        filler_tokens: int = DEFAULT_FILLER_TOKENS,
        fact: str = DEFAULT_FACT,
        question: str = DEFAULT_QUESTION,
        answer: str = DEFAULT_ANSWER,
        text: str = DEFAULT_TEXT,
        engine: str = "llama_cpp",
        model: str = "smollm2-135m",
    ) -> CheckOutcome:
        """Run the ``recall`` scenario: is a fact placed before the window still answered?"""

        def run(runner: Runner, judging: Judging) -> CheckOutcome:
            handling = positions or engine_info(engine).native_positions
            return runner.recall_check(
                judging,
                engine=engine,
                model=self._model(model),
                policy=make_policy(policy, cap=cap, sinks=sinks, positions=handling),
                recall=RecallSpec(fact, question, answer, filler_tokens),
                text=text,
            )[0]

        return self._run(run)

    def memory(
        self,
        *,
        policy: str = "sink",
        cap: int | None = 256,
        sinks: int | None = None,
        positions: str | None = None,
        lengths: Sequence[int] = DEFAULT_LENGTHS,
        text: str = DEFAULT_TEXT,
        engine: str = "llama_cpp",
        model: str = "smollm2-135m",
    ) -> CheckOutcome:
        """Run the ``memory`` scenario: KV bytes at each length, measured against predicted."""

        def run(runner: Runner, judging: Judging) -> CheckOutcome:
            handling = positions or engine_info(engine).native_positions
            return runner.memory_check(
                judging,
                engine=engine,
                model=self._model(model),
                policy=make_policy(policy, cap=cap, sinks=sinks, positions=handling),
                lengths=tuple(check_lengths(list(lengths))),
                text=text,
            )[0]

        return self._run(run)

    def _model(self, name: str) -> ModelRef:
        """A model named in a test; relative paths start at the test's folder."""
        return parse_model(name, self._request.node.path.parent)

    def _run(self, run: Callable[[Runner, Judging], CheckOutcome]) -> CheckOutcome:
        """Run a scenario for this test under its kv_budget marker, and record the figures."""
        node = self._request.node
        judging = Judging(node.name, self.budgets, base_dir=node.path.parent)
        try:
            outcome = run(_runner(node.config), judging)
        except KvguardError as exc:
            pytest.fail(str(exc), pytrace=False)
        outcome = _against_baseline(node.config, outcome)
        _record(node, outcome)
        return outcome


@pytest.fixture(scope="session")
def kvguard_runner(pytestconfig: pytest.Config) -> Runner:
    """The session's runner: engines load once per model, runs are reused across tests."""
    return _runner(pytestconfig)


@pytest.fixture
def kvguard(request: pytest.FixtureRequest) -> KvguardFixture:
    """Run kvguard scenarios on real engines; budgets come from ``@pytest.mark.kv_budget``."""
    return KvguardFixture(request)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker in item.iter_markers("kv_budget"):
            try:
                Budgets(*marker.args, **marker.kwargs)
            except (TypeError, KvguardError) as exc:
                raise pytest.UsageError(
                    f"{item.nodeid}: bad @pytest.mark.kv_budget: {exc} "
                    f"(fix: keyword arguments from {', '.join(Budgets.names())})"
                ) from None


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[EXPECTED_KEY] = {
        i.nodeid for i in session.items if isinstance(i, CheckItem)
    }


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when != "call" or not report.passed or isinstance(item, CheckItem):
        return report
    if item.get_closest_marker("kv_budget") is None:
        return report
    outcomes = item.stash.get(OUTCOMES_KEY, [])
    if not outcomes:
        report.outcome = "failed"
        report.longrepr = (
            "kv_budget marker, but the test ran no kvguard scenario (fix: call kvguard.stream(...))"
        )
    broken = [v for o in outcomes for v in o.violations]
    if broken:
        report.outcome = "failed"
        report.longrepr = "; ".join(broken)
    return report


class KvguardReporter:
    """Collects every check's row as reports arrive, then prints the table and writes the JSON.

    Registered per session; rows arrive on reports, so this works on the xdist controller too.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.json_path = _option_path(config, "kvguard_json", "kvguard_json")
        self.json_error: str | None = None
        self.plot_paths: list[Path] = []
        """Where the plots went, once written."""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rows = [json.loads(str(v)) for name, v in report.user_properties if name == PROPERTY]
        if rows and (report.when == "call" or report.failed):
            self.rows[report.nodeid] = rows

    def all_rows(self) -> list[dict[str, Any]]:
        return [row for rows in self.rows.values() for row in rows]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        runner = self.config.stash.get(RUNNER_KEY, None)
        if runner is not None:
            runner.close()
        self._write_step_summary(int(exitstatus))
        if self.json_path is None:
            return
        budgets_file = self.config.stash.get(BUDGETS_KEY, None)
        missing = self.config.stash.get(EXPECTED_KEY, set()) - self.rows.keys()
        baseline = self.config.stash.get(BASELINE_KEY, None)
        report = build_report(
            self.all_rows(),
            budgets_file=str(budgets_file.path) if budgets_file else None,
            budgets_sha256=budgets_file.sha256 if budgets_file else None,
            missing_checks=sorted(missing),
            exitstatus=int(exitstatus),
            baseline=None
            if baseline is None
            else {"path": str(baseline.path), "differences": baseline.differences(machine())},
        )
        try:
            write_json(self.json_path, report)
            if self.config.getoption("kvguard_plot"):
                for kind, write in (("kv-bytes", write_kv_plot), ("sink-sweep", write_sweep_plot)):
                    target = plot_path(self.json_path, kind)
                    if write(report["checks"], target):
                        self.plot_paths.append(target)
        except OSError as exc:
            self.json_error = f"cannot write {exc.filename or self.json_path}: {exc.strerror}"
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR

    def _write_step_summary(self, exitstatus: int) -> None:
        """On GitHub Actions ($GITHUB_STEP_SUMMARY set): the tables as Markdown, appended."""
        target = os.environ.get("GITHUB_STEP_SUMMARY")
        rows = self.all_rows()
        if not target or not rows:
            return
        missing = self.config.stash.get(EXPECTED_KEY, set()) - self.rows.keys()
        text = step_summary(
            rows,
            exitstatus=exitstatus,
            missing=sorted(missing),
            warning=_baseline_warning(self.config),
        )
        try:
            with open(target, "a", encoding="utf-8") as summary:
                summary.write(text)
        except OSError as exc:
            self.json_error = f"cannot append to $GITHUB_STEP_SUMMARY {target}: {exc.strerror}"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        rows = self.all_rows()
        warning = _baseline_warning(self.config)
        if warning:
            terminalreporter.write_line(warning, yellow=True, bold=True)
        changes: dict[str, int] = {}
        for row in rows:
            for change in row.get("baseline_changes") or []:
                changes[change] = changes.get(change, 0) + 1
        if changes:
            terminalreporter.write_line(
                "kvguard: changed since the baseline: "
                + "; ".join(
                    f"{change} ({n} check{'s' * (n != 1)})" for change, n in changes.items()
                ),
                yellow=True,
            )
        if rows:
            terminalreporter.write_sep("=", "kvguard")
            terminalreporter.write_line(render_table(rows))
            if any(row.get("scenario") == "stream" for row in rows):
                terminalreporter.write_line(
                    "ppl = perplexity over the tokens fed after the first eviction; "
                    "delta = candidate vs baseline on the same token ids."
                )
        if self.json_error:
            terminalreporter.write_line(f"kvguard: ERROR {self.json_error}", red=True)
        elif self.json_path is not None:
            terminalreporter.write_line(f"kvguard: JSON report written to {self.json_path}")
            for target in self.plot_paths:
                terminalreporter.write_line(f"kvguard: plot written to {target}")
            if self.config.getoption("kvguard_plot") and not self.plot_paths:
                terminalreporter.write_line("kvguard: no plot (no memory, stream or sweep figures)")
