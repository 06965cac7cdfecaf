"""pytest hooks for kvguard: options, marker, fixtures, collection, report hooks. Nothing else.

The logic lives in plain modules (``checks``, ``runner``, ``scenarios``, ``report``); the
items, fixture and reporter in ``items``, ``fixture`` and ``reporter``; what the session shares,
and the judging of every check, in its ``KvguardSession`` (``session``), built here at
pytest_configure and finished at pytest_sessionfinish.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import ENGINES, installed_version
from pytest_kvguard.engines.model_usable import check_model_usable
from pytest_kvguard.engines.registry import prepare_engine
from pytest_kvguard.gate.baseline import Baseline, load_baseline
from pytest_kvguard.gate.budgets_file import BudgetsFile, load_budgets_file
from pytest_kvguard.gate.engine_pythons import (
    EVERY_ENGINE,
    Environments,
    engine_environments,
    parse_assignments,
)
from pytest_kvguard.gate.faults import fault
from pytest_kvguard.gate.model_preview import (
    FactsDiff,
    ModelSwap,
    check_swaps,
    facts_diff,
    model_swaps,
    not_previewed,
    parse_model_swaps,
    uses,
)
from pytest_kvguard.gate.plot import require_matplotlib
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.isolation.environments import version_in
from pytest_kvguard.plugin.fixture import KvguardFixture
from pytest_kvguard.plugin.items import BudgetsCollector, CheckItem
from pytest_kvguard.plugin.options import (
    add_options,
    list_setting,
    path_setting,
    plot_enabled,
    setting,
    timeout_setting,
)
from pytest_kvguard.plugin.reporter import KvguardReporter
from pytest_kvguard.plugin.session import KvguardSession

REPORTER = "kvguard-reporter"


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    signature = ", ".join(f"{name}=None" for name in Budgets.names())
    config.addinivalue_line(
        "markers",
        f"kv_budget(*, {signature}): budgets the test's kvguard scenario results must stay within.",
    )
    try:  # the first read of the engine registry: a broken adapter's entry point is one line
        for engine in ENGINES:
            prepare_engine(engine)  # before any test module can import it; imports no engine
    except KvguardError as exc:
        raise pytest.UsageError(str(exc)) from None
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
        try:
            fault(fault_name)  # injected in the engine workers, never in this process
        except KvguardError as exc:
            raise pytest.UsageError(f"fault '{fault_name}': {exc}") from None
    timeout = timeout_setting(config)
    budgets_file = None
    baseline: Baseline | None = None
    try:
        baseline_path = path_setting(config, "kvguard_baseline")
        if baseline_path is not None:
            baseline = load_baseline(baseline_path)
        budgets_path = path_setting(config, "kvguard_budgets")
        command_line = _command_line_environments(config)
        if budgets_path is not None:
            budgets_file = load_budgets_file(budgets_path, command_line)
            for check in budgets_file.checks:
                try:
                    check.model.resolve()  # a missing model fails now, not mid-run
                except KvguardError as exc:
                    raise KvguardError(f"{check.where}: {exc}") from None
        environments = engine_environments(
            command_line, budgets_file.environments if budgets_file else None
        )
        here = [engine for engine in ENGINES if engine not in environments.python]
        if budgets_file is not None:
            _check_models_usable(budgets_file, here)
        swaps = _model_swaps(config, budgets_file, here)
        facts_diffs = _facts_diffs(swaps)
    except KvguardError as exc:
        raise pytest.UsageError(str(exc)) from None
    judged_against = [name for name, given in [
        ("--kvguard-against", bool(environments.against)),
        ("--kvguard-against-model", bool(swaps)),
        ("--kvguard-baseline", baseline is not None),
    ] if given]  # fmt: skip
    if len(judged_against) > 1:
        raise pytest.UsageError(
            f"{' and '.join(judged_against)} each give the run something to be judged "
            "against (fix: use one of them)"
        )
    KvguardSession(
        config,
        budgets_file=budgets_file,
        baseline=baseline,
        environments=environments,
        model_swaps=swaps,
        facts_diffs=facts_diffs,
        fault=fault_name or None,
        timeout=timeout,
    ).attach()
    if budgets_file is None or budgets_path is None:
        return
    # Without explicit test paths the gate runs only its checks, not the project's testpaths.
    collect = str(budgets_path.resolve())
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = [collect]
    elif collect not in config.args:
        config.args.append(collect)


def _check_models_usable(budgets_file: BudgetsFile, here: list[str]) -> None:
    """Each model a check names is one its engines can load, as far as kvguard can tell
    without loading weights; else one line naming the check's line and the file. ``here``:
    the engines that run in this environment."""
    seen = set()
    for check in budgets_file.checks:
        key = (check.model, tuple(check.engines))
        if key in seen:
            continue
        seen.add(key)
        try:
            check_model_usable(check.model, check.engines, here)
        except KvguardError as exc:
            raise KvguardError(f"{check.where}: model {exc}") from None


def _model_swaps(
    config: pytest.Config, budgets_file: BudgetsFile | None, here: list[str]
) -> list[ModelSwap]:
    """The model preview's swaps, each checked (a candidate the checks' engines cannot load is
    one line now)."""
    given = list_setting(config, "kvguard_against_model")
    # Command-line paths are relative to the current directory, ini lines to rootdir.
    on_command_line = bool(config.getoption("kvguard_against_model"))
    swaps = model_swaps(
        parse_model_swaps(
            given,
            "--kvguard-against-model" if on_command_line else "ini kvguard_against_model =",
            Path.cwd() if on_command_line else config.rootpath,
        ),
        budgets_file.model_swaps if budgets_file else (),
    )
    checks = list(budgets_file.checks) if budgets_file else []
    if checks:
        check_swaps(swaps, checks)
    for swap in swaps:
        for check in checks:
            if uses(check, swap) and not_previewed(check, swap) is None:
                try:
                    check_model_usable(swap.candidate, check.engines, here)
                except KvguardError as exc:
                    raise KvguardError(f"{swap.given}: candidate {exc}") from None
    return swaps


def _facts_diffs(swaps: list[ModelSwap]) -> list[FactsDiff]:
    """Each swap's facts diff, for the header and the JSON report (read now, before any run)."""
    return [facts_diff(swap) for swap in swaps]


def _command_line_environments(config: pytest.Config) -> Environments:
    """--kvguard-engine-python and --kvguard-against (or their ini keys), each checked."""
    return Environments(
        parse_assignments(list_setting(config, "kvguard_engine_python"), "--kvguard-engine-python"),
        parse_assignments(
            list_setting(config, "kvguard_against"), "--kvguard-against", every_engine=True
        ),
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = []
    session = KvguardSession.of(config)
    if session.fault:
        chosen = fault(session.fault)
        lines.append(
            f"kvguard FAULT INJECTED: {chosen.name} ({chosen.engine}: {chosen.what}); "
            "this run is expected to fail"
        )
    environments = session.environments
    for engine, python in sorted(environments.python.items()):
        version = version_in(python, engine) or "not installed there"
        lines.append(f"kvguard engine environment: {engine} {version} runs in {python}")
    for engine, python in sorted(environments.against.items()):
        names = [engine] if engine != EVERY_ENGINE else list(ENGINES)
        found = ", ".join(f"{n} {version_in(python, n) or 'not installed'}" for n in names)
        lines.append(f"kvguard upgrade preview: every check also runs against {found} ({python})")
    for diff in session.facts_diffs:
        lines.extend(diff.lines())
    baseline = session.baseline
    if baseline is not None:
        lines.append(
            f"kvguard baseline: {baseline.path} ({len(baseline.checks)} checks, "
            f"saved {baseline.report.get('created', 'at an unknown time')})"
        )
        warning = session.baseline_warning()
        if warning:
            lines.append(warning)
    budgets_file = session.budgets_file
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
    for engine in engines:
        if installed_version(engine) and (prepared := prepare_engine(engine)) is not None:
            lines.append(f"kvguard {engine} {prepared}")
    return lines


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    budgets_file = KvguardSession.of(parent.config).budgets_file
    if budgets_file is not None and file_path.resolve() == budgets_file.path.resolve():
        collector: BudgetsCollector = BudgetsCollector.from_parent(parent, path=file_path)
        return collector
    return None


@pytest.fixture(scope="session")
def kvguard_runner(pytestconfig: pytest.Config) -> Runner:
    """The session's runner: engines load once per model, runs are reused across tests."""
    return KvguardSession.of(pytestconfig).runner


@pytest.fixture
def kvguard(request: pytest.FixtureRequest) -> KvguardFixture:
    """Run kvguard scenarios on real engines; budgets come from ``@pytest.mark.kv_budget``."""
    return KvguardFixture(request)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _checks_in_file_order(items)
    for item in items:
        for marker in item.iter_markers("kv_budget"):
            try:
                Budgets(*marker.args, **marker.kwargs)
            except (TypeError, KvguardError) as exc:
                raise pytest.UsageError(
                    f"{item.nodeid}: bad @pytest.mark.kv_budget: {exc} "
                    f"(fix: keyword arguments from {', '.join(Budgets.names())})"
                ) from None


def _checks_in_file_order(items: list[pytest.Item]) -> None:
    """Put a budgets file's checks back in the order the file declares them, in the slots they
    hold, after a plugin that shuffles the session (pytest-randomly) ran: which check computes
    a run several checks share, and so each one's seconds and the tables' order, follows it."""
    slots = [i for i, item in enumerate(items) if isinstance(item, CheckItem)]
    declared = sorted((items[i] for i in slots), key=lambda item: item.reportinfo()[:2])
    for slot, item in zip(slots, declared, strict=True):
        items[slot] = item


def pytest_collection_finish(session: pytest.Session) -> None:
    checks = [i for i in session.items if isinstance(i, CheckItem)]
    kvguard = KvguardSession.of(session.config)
    # --collect-only runs nothing: no check is expected to have run.
    if not session.config.option.collectonly:
        kvguard.expect([i.nodeid for i in checks])
    # Under xdist each worker runs a share of the checks it collected: no plan there.
    if not hasattr(session.config, "workerinput"):
        kvguard.plan = [i.check for i in checks]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """On the xdist controller: the checks the workers collected are the ones expected."""
    config = node.config
    kvguard = KvguardSession.of(config)
    budgets_file = kvguard.budgets_file
    if budgets_file is None or config.option.collectonly:
        return
    target = budgets_file.path.resolve()
    kvguard.expect([i for i in ids if (config.rootpath / i.split("::")[0]).resolve() == target])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A marked test fails with one line when a scenario it ran failed the session's judgement
    (``KvguardSession.judge``: the marker's budgets, a regression), or when it ran none."""
    report = yield
    if call.when != "call" or not report.passed or isinstance(item, CheckItem):
        return report
    if item.get_closest_marker("kv_budget") is None:
        return report
    failure = KvguardSession.of(item.config).judge_marked_test(item)
    if failure is not None:
        report.outcome = "failed"
        report.longrepr = failure
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """The kvguard session's end, before the reporter's: its session-level failures become the
    exit status, its engines close."""
    KvguardSession.of(session.config).finish(session)
