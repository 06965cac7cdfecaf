"""Every scenario on every engine that runs it, in short real runs of the bundled models.

The stream, memory, recall, attention and llama.cpp edit-replay scenarios have their own
engine tests (test_llama_cpp, test_mlx, test_batched_runs, test_attention, ...); the rest run
here, from tests/engine_checks.yaml: sweeps on llama.cpp and llama-server, the generate path on
all three engines, parity and attention parity, edit-replay on mlx-lm and llama-server. Sizes
are small (256 tokens on a cap of 128 in process, 320 on llama-server's 255): each row must give
the verdict its check expects with figures consistent with the check (gate_invariants), and
llama-server must count and shift as the in-process engine does. The gates
themselves (fixtures/quick.yaml, fixtures/budgets.yaml) run in .ci/run and .ci/nightly, which
check their reports with tests/check_gate_report.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gate_invariants import SERVED_AGREEMENTS, assert_agreements, assert_row_holds

from pytest_kvguard.gate.budgets_file import load_budgets_file
from pytest_kvguard.gate.engine_pythons import Environments
from pytest_kvguard.plugin.session import ENVIRONMENTS_KEY, run_gated, sendable, session_pool
from pytest_kvguard.scenarios.base import Check

pytestmark = pytest.mark.engine  # each check names its engines below
CHECKS_FILE = load_budgets_file(Path(__file__).with_name("engine_checks.yaml"))
CHECKS = {check.name: check for check in CHECKS_FILE.checks}
ROWS: dict[str, dict[str, Any]] = {}


def engine_marks(engines: set[str]) -> list[pytest.MarkDecorator]:
    """The per-engine markers (tests/conftest.py) of the engines a test runs."""
    return [getattr(pytest.mark, engine) for engine in sorted(engines)]


CHECK_PARAMS = [
    pytest.param(check, id=check.name, marks=engine_marks(set(check.engines)))
    for check in CHECKS_FILE.checks
]


@pytest.fixture(scope="module")
def planned(pytestconfig: pytest.Config) -> None:
    """The session's engine worker learns every check first, so runs that can decode
    together do, whichever test asks first."""
    environments = pytestconfig.stash.get(ENVIRONMENTS_KEY, Environments())
    worker = session_pool(pytestconfig).worker(environments.python_for(("llama_cpp", "mlx")))
    worker.add_plan([sendable(check) for check in CHECKS_FILE.checks])


def row_of(config: pytest.Config, name: str) -> dict[str, Any]:
    """The check's JSON row as --kvguard-json writes it, run once per session."""
    if name not in ROWS:
        ROWS[name] = json.loads(json.dumps(run_gated(config, CHECKS[name]).to_json()))
    return ROWS[name]


@pytest.mark.usefixtures("planned")
@pytest.mark.parametrize("check", CHECK_PARAMS)
def test_check_runs_and_its_figures_hold(pytestconfig: pytest.Config, check: Check[Any]) -> None:
    assert_row_holds(row_of(pytestconfig, check.name), check)


@pytest.mark.usefixtures("planned")
@pytest.mark.llama_cpp
@pytest.mark.mlx  # it reads every check's row, and some run on mlx
@pytest.mark.llama_server
def test_llama_server_agrees_with_the_in_process_engine(pytestconfig: pytest.Config) -> None:
    """The same chat: the server's cache_n / prompt_n are the in-process counts; the same
    forced generation past the cap: its context shift scores as the in-process sink policy;
    its sweep's runs are the generate checks' own, kept with the sinks asked for."""
    rows = {name: row_of(pytestconfig, name) for name in CHECKS}
    assert assert_agreements(rows) == SERVED_AGREEMENTS
