"""Scenarios: what a check does with an engine. One module per scenario; this is the registry.

A new scenario is one module under ``pytest_kvguard/scenarios/`` with a ``Scenario`` subclass
(see ``base.py``) and one line below. Scenarios call the Engine protocol only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_kvguard.core.budgets import Limit, set_limit_source
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.scenarios import (
    attention,
    attention_parity,
    edit_replay,
    generate,
    memory,
    parity,
    recall,
    speculative,
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
        speculative.SCENARIO,
    )
}


def declared_limits() -> Mapping[str, Limit]:
    """Every budget the registered scenarios declare: what a budgets file and the
    ``kv_budget`` marker accept (a scenario added to ``SCENARIOS`` brings its own). In an
    order that keeps each scenario's own (a budget first seen comes right after the one its
    scenario lists before it), which is the order a check's budgets are shown in."""
    found: dict[str, Limit] = {}
    order: list[str] = []
    for scenario in SCENARIOS.values():
        previous: str | None = None
        for limit in scenario.limits:
            if limit.name not in found:
                at = len(order) if previous is None else order.index(previous) + 1
                order.insert(at, limit.name)
                found[limit.name] = limit
            elif found[limit.name] != limit:
                raise KvguardError(
                    f"scenario {scenario.name} declares budget {limit.name} unlike the "
                    "scenario that declared it first",
                    fix="import the first declaration instead of declaring it again",
                )
            previous = limit.name
    return {name: found[name] for name in order}


set_limit_source(declared_limits)


def all_param_names() -> set[str]:
    """Every parameter any scenario takes (defaults may hold those of other scenarios)."""
    return {p.name for s in SCENARIOS.values() for p in s.params}
