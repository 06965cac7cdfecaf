"""A scenario written the way a newcomer would add one: a Scenario subclass, with a budget of its
own, and a registry entry.

Nothing else changes: the budgets file, the marker, the fixture, the table, the JSON report and
its schema all take the new scenario and its budget from the registry (the toy engine stands in
for a real one).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import pytest_kvguard
from pytest_kvguard.core.budgets import Budgets, Limit
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.inputs.texts import load_text
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import (
    CAP,
    TEXT,
    TOKENS,
    Check,
    Context,
    Fields,
    Measured,
    Panel,
    Scenario,
)
from pytest_kvguard.scenarios.limits import MAX_KV_ENTRIES
from pytest_kvguard.scenarios.validate import require_text_room

pytestmark = pytest.mark.usefixtures("fake_engine")


@dataclass(frozen=True)
class FillSpec:
    policy: Policy
    tokens: int
    text: str


@dataclass(frozen=True)
class FillDetail:
    held: int


MAX_UNHELD_TOKENS = Limit(
    "max_unheld_tokens", "unheld_tokens", "max", " tokens", "unheld",
    "tokens fed that the cache no longer holds",
    "fill: tokens fed minus the KV entries held at the end.",
)  # fmt: skip
"""A budget no bundled scenario has: declared by the scenario that judges it, nowhere else."""


class FillScenario(Scenario[FillSpec]):
    """Feed ``tokens`` without scoring; report the KV entries held."""

    name = "fill"
    summary = "feed tokens without scoring and count what the cache holds"
    params = (TOKENS, CAP, TEXT)
    limits = (MAX_KV_ENTRIES, MAX_UNHELD_TOKENS)
    detail_type = FillDetail

    def build(self, fields: Fields) -> FillSpec:
        assert fields.policy is not None
        tokens: int = fields.params["tokens"]
        require_text_room(fields, tokens, "params.tokens")
        return FillSpec(fields.policy_of("policy", fields.policy), tokens, fields.text_name())

    def run(self, ctx: Context, check: Check[FillSpec]) -> Measured:
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        run, new = ctx.stream_run(check.engine, check.model, spec.policy, text, spec.tokens,
                                  score=False)  # fmt: skip
        return Measured(
            policy=spec.policy.describe(), tokens=spec.tokens, text=text,
            metrics={"kv_entries": float(run.kv_entries),
                     "unheld_tokens": float(spec.tokens - run.kv_entries)},
            seconds={"run": run.seconds if new else 0.0},
            tokens_per_second=run.tokens_per_second, detail=FillDetail(run.kv_entries),
        )  # fmt: skip

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        return ["tokens", "held"], [[[str(o.tokens), str(o.detail.held)]] for o in outcomes]

    # Its extras: an explanation of a red check, a report section and a plot panel.
    explanation_schema = {"type": "object", "required": ["summary"]}

    def explain(self, ctx: Context, check: Check[FillSpec]) -> dict[str, Any] | None:
        return {"summary": f"the cache kept {check.spec.policy.cap} of {check.spec.tokens}"}

    def report_sections(self, outcome: Any) -> list[tuple[str, str]]:
        return [("kvguard fill", outcome.explanation["summary"])] if outcome.explanation else []

    def panels(self, outcome: Any) -> list[Panel]:
        def draw(ax: Any) -> int:
            ax.bar([outcome.name], [outcome.detail.held])
            return 1

        return [Panel("fill", "held", draw)]


@pytest.fixture
def fill_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SCENARIOS, "fill", FillScenario())  # the one registry line


def test_a_new_scenario_runs_from_yaml_and_the_fixture(
    gate: pytest.Pytester, fill_registered: None
) -> None:
    from pytest_kvguard.gate.report import report_schema

    gate.makefile(
        ".yaml",
        budgets="version: 1\ndefaults: {engine: fake, model: tiny.gguf}\nchecks:\n"
        "  - name: fill-window\n    scenario: fill\n    policy: window\n"
        "    params: {cap: 64, tokens: 300}\n"
        "    budgets: {max_kv_entries: 64, max_unheld_tokens: 236}\n",
    )
    gate.makepyfile(
        """
import pytest

@pytest.mark.kv_budget(max_kv_entries=300, max_unheld_tokens=0)
def test_fill(kvguard):
    outcome = kvguard.fill(engine="fake", model="tiny.gguf", policy="full", tokens=300)
    assert outcome.detail.held == 300
"""
    )
    test_file = "test_a_new_scenario_runs_from_yaml_and_the_fixture.py"
    result = gate.runpytest("--kvguard", "budgets.yaml", test_file, "--kvguard-json", "r.json")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["check * policy * tokens * held * budget * verdict",
         "fill-window * window/64 * 300 * 64 * kv<=64, unheld<=236 * PASS"]
    )  # fmt: skip
    import jsonschema

    report = json.loads((gate.path / "r.json").read_text())
    jsonschema.validate(report, report_schema())
    assert {c["detail"]["held"] for c in report["checks"]} == {64, 300}
    assert {c["metrics"]["unheld_tokens"] for c in report["checks"]} == {236.0, 0.0}


def test_a_new_scenarios_own_budget_fails_the_check_that_breaks_it(
    gate: pytest.Pytester, fill_registered: None
) -> None:
    gate.makefile(
        ".yaml",
        budgets="version: 1\ndefaults: {engine: fake, model: tiny.gguf}\nchecks:\n"
        "  - name: fill-window\n    scenario: fill\n    policy: window\n"
        "    params: {cap: 64, tokens: 300}\n    budgets: {max_unheld_tokens: 200}\n",
    )
    result = gate.runpytest("--kvguard", "budgets.yaml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*max_unheld_tokens: tokens fed that the cache no longer holds budget 200 tokens, "
         "measured 236 tokens*"]
    )  # fmt: skip


def test_a_budget_only_a_registered_scenario_declares_is_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(KvguardError, match="unknown budget 'max_unheld_tokens'"):
        Budgets(max_unheld_tokens=1)
    monkeypatch.setitem(SCENARIOS, "fill", FillScenario())
    assert Budgets(max_unheld_tokens=1).max_unheld_tokens == 1
    assert "max_unheld_tokens" in Budgets.names()
    assert SCENARIOS["fill"].comparable_metrics == {"kv_entries": False, "unheld_tokens": False}
    from pytest_kvguard.gate.baseline import parse_tolerance

    assert parse_tolerance("unheld_tokens", "0").allows(10, 10)  # a baseline may name it too


def test_a_new_scenario_refuses_bad_input_like_the_others(
    gate: pytest.Pytester, fill_registered: None
) -> None:
    gate.makefile(
        ".yaml",
        budgets="version: 1\nchecks:\n  - name: a\n    scenario: fill\n    engine: fake\n"
        "    model: tiny.gguf\n    policy: window\n    params: {cap: 64, lengths: [1]}\n"
        "    budgets: {max_kv_entries: 64}\n",
    )
    result = gate.runpytest("--kvguard", "budgets.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: budgets.yaml:8: unknown fill parameter 'lengths' (fix: *known: tokens, cap, text)"]
    )


def test_a_new_scenario_brings_its_own_explanation_section_and_plot(
    gate: pytest.Pytester, fill_registered: None
) -> None:
    """A red fill check is explained by the scenario's hook (JSON row, report section) and
    both checks draw into the scenario's own plot, with no module outside the scenario told."""
    from pytest_kvguard.gate.report import report_schema

    gate.makefile(
        ".yaml",
        budgets="version: 1\ndefaults: {engine: fake, model: tiny.gguf}\nchecks:\n"
        "  - name: fill-full\n    scenario: fill\n    policy: full\n"
        "    params: {tokens: 300}\n    budgets: {max_kv_entries: 64}\n"
        "  - name: fill-window\n    scenario: fill\n    policy: window\n"
        "    params: {cap: 64, tokens: 300}\n    budgets: {max_kv_entries: 64}\n",
    )
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json",
                            "--kvguard-plot")  # fmt: skip
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*kvguard fill*", "the cache kept None of 300"])
    report = json.loads((gate.path / "r.json").read_text())
    import jsonschema

    jsonschema.validate(report, report_schema())
    explained = {c["name"]: c["explanation"] for c in report["checks"]}
    assert explained == {"fill-full": {"summary": "the cache kept None of 300"},
                         "fill-window": None}  # fmt: skip
    result.stdout.fnmatch_lines(["kvguard: plot written to r.fill.png"])
    assert (gate.path / "r.fill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _named_scenarios(path: Path) -> list[str]:
    """Where a module names a registered scenario: a string equal to its name (docstrings
    aside) or an import of its module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = path.relative_to(Path(pytest_kvguard.__file__).parent.parent)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and node.value in SCENARIOS
            and id(node) not in docstrings
        ):
            found.append(f"{where}:{node.lineno} '{node.value}'")
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for module in modules:
                if module.removeprefix("pytest_kvguard.scenarios.") in SCENARIOS:
                    found.append(f"{where}:{node.lineno} imports {module}")
    return found


def test_no_module_outside_scenarios_names_a_scenario() -> None:
    """What one scenario does is its own module's business: the runner, the report, the plots
    and the engines reach it through the registry and the ``Scenario`` hooks only."""
    package = Path(pytest_kvguard.__file__).parent
    outside = [p for p in sorted(package.rglob("*.py")) if "scenarios" not in p.parts]
    assert len(outside) > 20
    found = [hit for path in outside for hit in _named_scenarios(path)]
    assert not found, "scenario named outside scenarios/: " + "; ".join(found)
