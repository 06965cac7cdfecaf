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
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from gate_invariants import SERVED_AGREEMENTS, assert_agreements, assert_row_holds

from pytest_kvguard.gate.budgets_file import load_budgets_file
from pytest_kvguard.plugin.session import KvguardSession, sendable
from pytest_kvguard.scenarios.base import Check

ENGINE_CHECKS = Path(__file__).with_name("engine_checks.yaml")
# Each check names its engines below; and parsing the file needs both in-process engines
# installed (the parser refuses a check whose engine is missing), so every test here needs them.
pytestmark = [pytest.mark.engine, pytest.mark.llama_cpp, pytest.mark.mlx]
ROWS: dict[str, dict[str, Any]] = {}


def written_engines() -> dict[str, set[str]]:
    """Each check's name and engines as the file writes them, read as plain YAML: no engine is
    needed for this, so collection works on a machine that lacks one (its tests are skipped,
    or fail where engines are required, by their markers)."""
    document = yaml.safe_load(ENGINE_CHECKS.read_text(encoding="utf-8"))
    default = document["defaults"]["engine"]
    return {
        entry["name"]: set(entry.get("engines") or [entry.get("engine", default)])
        for entry in document["checks"]
    }


@cache
def engine_checks() -> dict[str, Check[Any]]:
    """The file's checks, parsed in full (inside a test: every engine it names is installed),
    by name in file order; each with the engines its test's markers were made from."""
    checks = {check.name: check for check in load_budgets_file(ENGINE_CHECKS).checks}
    assert {name: set(check.engines) for name, check in checks.items()} == written_engines()
    return checks


def engine_marks(engines: set[str]) -> list[pytest.MarkDecorator]:
    """The per-engine markers (tests/conftest.py) of the engines a test runs."""
    return [getattr(pytest.mark, engine) for engine in sorted(engines)]


CHECK_PARAMS = [
    pytest.param(name, id=name, marks=engine_marks(engines))
    for name, engines in written_engines().items()
]


@pytest.fixture(scope="module")
def planned(pytestconfig: pytest.Config) -> None:
    """The session's engine worker learns every check first, so runs that can decode
    together do, whichever test asks first."""
    session = KvguardSession.of(pytestconfig)
    worker = session.pool.worker(session.environments.python_for(("llama_cpp", "mlx")))
    worker.add_plan([sendable(check) for check in engine_checks().values()])


def row_of(config: pytest.Config, name: str) -> dict[str, Any]:
    """The check's JSON row as --kvguard-json writes it, run once per session."""
    if name not in ROWS:
        outcome = KvguardSession.of(config).run(engine_checks()[name]).outcome
        ROWS[name] = json.loads(json.dumps(outcome.to_json()))
    return ROWS[name]


@pytest.mark.usefixtures("planned")
@pytest.mark.parametrize("name", CHECK_PARAMS)
def test_check_runs_and_its_figures_hold(pytestconfig: pytest.Config, name: str) -> None:
    assert_row_holds(row_of(pytestconfig, name), engine_checks()[name])


@pytest.mark.usefixtures("planned")
@pytest.mark.llama_cpp
@pytest.mark.mlx  # it reads every check's row, and some run on mlx
@pytest.mark.llama_server
def test_llama_server_agrees_with_the_in_process_engine(pytestconfig: pytest.Config) -> None:
    """The same chat: the server's cache_n / prompt_n are the in-process counts; the same
    forced generation past the cap: its context shift scores as the in-process sink policy;
    its sweep's runs are the generate checks' own, kept with the sinks asked for."""
    rows = {name: row_of(pytestconfig, name) for name in engine_checks()}
    assert assert_agreements(rows) == SERVED_AGREEMENTS
