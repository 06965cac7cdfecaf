"""pytest hooks for kvguard: options, marker, fixtures, collection, report hooks. Nothing else.

The logic lives in plain modules (``checks``, ``runner``, ``scenarios``, ``report``); the
items, fixture and reporter in ``items``, ``fixture`` and ``reporter``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.baseline import load_baseline
from pytest_kvguard.budgets import Budgets
from pytest_kvguard.budgets_file import load_budgets_file
from pytest_kvguard.engines import ENGINES, installed_version
from pytest_kvguard.engines.blas import preload_openblas
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.faults import fault, inject
from pytest_kvguard.fixture import KvguardFixture
from pytest_kvguard.items import BudgetsCollector, CheckItem
from pytest_kvguard.options import add_options, path_setting, plot_enabled, setting
from pytest_kvguard.plot import require_matplotlib
from pytest_kvguard.reporter import KvguardReporter, baseline_warning
from pytest_kvguard.runner import Runner
from pytest_kvguard.session import (
    BASELINE_KEY,
    BUDGETS_KEY,
    FAULT_KEY,
    OUTCOMES_KEY,
    RUNNER_KEY,
    session_runner,
)

REPORTER = "kvguard-reporter"


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    signature = ", ".join(f"{name}=None" for name in Budgets.names())
    config.addinivalue_line(
        "markers",
        f"kv_budget(*, {signature}): budgets the test's kvguard scenario results must stay within.",
    )
    if importlib.util.find_spec("mlx") is not None:
        preload_openblas()  # before any test module can import mlx; cheap, imports no engine
    json_path = path_setting(config, "kvguard_json")
    if plot_enabled(config):
        if json_path is None:
            raise pytest.UsageError(
                "--kvguard-plot writes next to the JSON report (fix: add --kvguard-json PATH)"
            )
        try:
            require_matplotlib()
        except KvguardError as exc:
            raise pytest.UsageError(str(exc)) from None
    if not hasattr(config, "workerinput"):  # the xdist controller, or a session without xdist
        config.pluginmanager.register(
            KvguardReporter(config, json_path, plot_enabled(config)), REPORTER
        )
    fault_name = setting(config, "kvguard_inject_fault")
    if fault_name:
        faults = contextlib.ExitStack()
        try:
            faults.enter_context(inject(fault_name))
        except (ImportError, KvguardError) as exc:
            raise pytest.UsageError(f"fault '{fault_name}': {exc}") from None
        config.stash[FAULT_KEY] = faults
    try:
        baseline_path = path_setting(config, "kvguard_baseline")
        if baseline_path is not None:
            config.stash[BASELINE_KEY] = load_baseline(baseline_path)
        budgets_path = path_setting(config, "kvguard_budgets")
        if budgets_path is None:
            return
        budgets_file = load_budgets_file(budgets_path)
        for check in budgets_file.checks:
            try:
                check.model.resolve()  # a missing model fails now, not mid-run
            except KvguardError as exc:
                raise KvguardError(f"{check.where}: {exc}") from None
    except KvguardError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[BUDGETS_KEY] = budgets_file
    # Without explicit test paths the gate runs only its checks, not the project's testpaths.
    collect = str(budgets_path.resolve())
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = [collect]
    elif collect not in config.args:
        config.args.append(collect)


def pytest_unconfigure(config: pytest.Config) -> None:
    faults = config.stash.get(FAULT_KEY, None)
    if faults is not None:
        faults.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = []
    if FAULT_KEY in config.stash:
        chosen = fault(str(setting(config, "kvguard_inject_fault")))
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
        warning = baseline_warning(config)
        if warning:
            lines.append(warning)
    budgets_file = config.stash.get(BUDGETS_KEY, None)
    if budgets_file is not None:
        lines.append(
            f"kvguard: budgets {budgets_file.path} ({len(budgets_file.checks)} checks, "
            f"sha256 {budgets_file.sha256[:12]})"
        )
        engines = sorted({e for c in budgets_file.checks for e in c.engines})
        models = {c.model.name: c.model.resolve() for c in budgets_file.checks}
    else:
        engines = [e for e in ENGINES if installed_version(e)]
        models = {}
    lines.append(
        "kvguard engines: "
        + (", ".join(f"{e} {installed_version(e) or 'not installed'}" for e in engines)
           or "none installed")
    )  # fmt: skip
    lines.extend(f"kvguard model: {name} = {path}" for name, path in models.items())
    if "mlx" in engines and installed_version("mlx"):
        lines.append(f"kvguard mlx BLAS: {preload_openblas()}")
    return lines


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    budgets_file = parent.config.stash.get(BUDGETS_KEY, None)
    if budgets_file is not None and file_path.resolve() == budgets_file.path.resolve():
        collector: BudgetsCollector = BudgetsCollector.from_parent(parent, path=file_path)
        return collector
    return None


@pytest.fixture(scope="session")
def kvguard_runner(pytestconfig: pytest.Config) -> Runner:
    """The session's runner: engines load once per model, runs are reused across tests."""
    return session_runner(pytestconfig)


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
    reporter = session.config.pluginmanager.get_plugin(REPORTER)
    if reporter is not None:
        reporter.expect([i.nodeid for i in session.items if isinstance(i, CheckItem)])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """On the xdist controller: the checks the workers collected are the ones expected."""
    config = node.config
    budgets_file = config.stash.get(BUDGETS_KEY, None)
    reporter = config.pluginmanager.get_plugin(REPORTER)
    if budgets_file is None or reporter is None:
        return
    target = budgets_file.path.resolve()
    reporter.expect([i for i in ids if (config.rootpath / i.split("::")[0]).resolve() == target])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A marked test fails with one line when a scenario it ran broke the marker's budgets."""
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


def pytest_sessionfinish(session: pytest.Session) -> None:
    runner = session.config.stash.get(RUNNER_KEY, None)
    if runner is not None:
        runner.close()
