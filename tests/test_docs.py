"""The README's promises: two set-up commands, .ci/run runs the second, every knob documented."""

from __future__ import annotations

import re
from pathlib import Path

from test_workflows import ACTION, _load

from pytest_kvguard.baseline import COMPARABLE_METRICS
from pytest_kvguard.budgets import Budgets
from pytest_kvguard.budgets_file import TOP_KEYS
from pytest_kvguard.checks import CHECK_KEYS
from pytest_kvguard.docs import scenarios_markdown
from pytest_kvguard.options import OPTIONS
from pytest_kvguard.policies import POLICY_KINDS, POSITION_MODES
from pytest_kvguard.scenarios import SCENARIOS

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def setup_commands() -> tuple[str, str]:
    """README's two set-up commands: the quick gate, then the test suite."""
    commands = re.findall(r"```sh\n(.+?)\n```", README, flags=re.S)
    assert len(commands) == 2
    return commands[0], commands[1]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    gate, tests = setup_commands()
    assert "--kvguard fixtures/quick.yaml" in gate and gate.startswith("bash .ci/install ")
    # As printed, or as printed with `|| exit 1` (set -e spares a failure inside an && list).
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines or f"{tests} || exit 1" in ci_lines


def test_readme_carries_the_scenarios_own_parameter_tables() -> None:
    """The parameter and budget tables in README are the ones the parser reads, verbatim."""
    section = re.search(r"<!-- scenarios -->\n(.*?)<!-- /scenarios -->", README, flags=re.S)
    assert section, "README lacks the <!-- scenarios --> section (kvguard-scenarios prints it)"
    assert section.group(1) == scenarios_markdown()


def test_every_budget_applies_to_some_scenario() -> None:
    assert set(Budgets.names()) == {b for s in SCENARIOS.values() for b in s.budgets}


def test_every_key_budget_policy_and_option_is_documented() -> None:
    names = [*CHECK_KEYS, *SCENARIOS, *Budgets.names(), *POLICY_KINDS, *POSITION_MODES]
    names += [flag for flag, _, _, _ in OPTIONS] + ["--kvguard-plot", "kvguard_plot"]
    names += [ini for _, ini, _, _ in OPTIONS] + TOP_KEYS
    names += [*COMPARABLE_METRICS, *_load(ACTION)["inputs"]]
    missing = [name for name in names if f"`{name}" not in README]
    assert not missing
