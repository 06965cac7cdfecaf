"""Scenarios: what a check does with an engine. One module per scenario; this is the registry.

A new scenario is one module under ``pytest_kvguard/scenarios/`` with a ``Scenario`` subclass
(see ``base.py``) and one line below. Scenarios call the Engine protocol only.
"""

from __future__ import annotations

from typing import Any

from pytest_kvguard.scenarios import (
    attention,
    attention_parity,
    edit_replay,
    generate,
    memory,
    parity,
    recall,
    stream,
    sweep,
)
from pytest_kvguard.scenarios.base import Scenario

DEFAULT_SCENARIO = "stream"
"""The scenario of a budgets-file check that names none."""

SCENARIOS: dict[str, Scenario[Any]] = {
    s.name: s
    for s in (
        stream.SCENARIO,
        parity.SCENARIO,
        edit_replay.SCENARIO,
        memory.SCENARIO,
        sweep.SCENARIO,
        recall.SCENARIO,
        generate.SCENARIO,
        attention.SCENARIO,
        attention_parity.SCENARIO,
    )
}


def all_param_names() -> set[str]:
    """Every parameter any scenario takes (defaults may hold those of other scenarios)."""
    return {p.name for s in SCENARIOS.values() for p in s.params}
