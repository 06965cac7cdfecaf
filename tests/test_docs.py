"""The README's promises: two set-up commands, .ci/run runs the second, every knob documented."""

from __future__ import annotations

import re
from pathlib import Path

from test_workflows import ACTION, _load

from pytest_kvguard.baseline import COMPARABLE_METRICS
from pytest_kvguard.budgets import Budgets
from pytest_kvguard.budgets_file import CHECK_KEYS, SCENARIO_PARAMS, SCENARIOS, TOP_KEYS
from pytest_kvguard.policies import POLICY_KINDS, POSITION_MODES

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    commands = re.findall(r"```sh\n(.+?)\n```", README, flags=re.S)
    assert len(commands) == 2
    gate, tests = commands
    assert "--kvguard fixtures/budgets.yaml" in gate and gate.startswith("bash .ci/install ")
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_every_key_budget_param_policy_and_option_is_documented() -> None:
    params = [name for names in SCENARIO_PARAMS.values() for name in names]
    names = [*CHECK_KEYS, *params, *SCENARIOS, *Budgets.names(), *POLICY_KINDS, *POSITION_MODES]
    names += ["--kvguard", "--kvguard-json", "--kvguard-plot", "--kvguard-baseline"]
    names += ["kvguard_budgets", "kvguard_json", "kvguard_baseline", *TOP_KEYS]
    names += [*COMPARABLE_METRICS, *_load(ACTION)["inputs"]]
    missing = [name for name in names if f"`{name}" not in README]
    assert not missing
