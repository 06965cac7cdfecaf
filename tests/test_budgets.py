"""Budget checks as plain functions: edges at limit-1, limit, limit+1."""

from __future__ import annotations

import math

import pytest

from pytest_kvguard.core.budgets import Budgets, kv_budget
from pytest_kvguard.core.errors import KvguardError


@pytest.mark.parametrize(("measured", "broken"), [(19.0, False), (20.0, False), (21.0, True)])
def test_max_budget_edges(measured: float, broken: bool) -> None:
    budgets = Budgets(max_ppl_increase_pct=20)
    violations = budgets.check({"ppl_increase_pct": measured})
    assert bool(violations) is broken


@pytest.mark.parametrize(("held", "broken"), [(255, False), (256, False), (257, True)])
def test_kv_entries_edges(held: int, broken: bool) -> None:
    assert bool(Budgets(max_kv_entries=256).check({"kv_entries": held})) is broken


def test_violation_message_names_budget_limit_and_measurement() -> None:
    (violation,) = Budgets(max_post_eviction_ppl=13.5).check({"post_eviction_ppl": 21.508})
    assert violation.message == (
        "max_post_eviction_ppl: post-eviction perplexity budget 13.50, measured 21.51"
    )


def test_nan_measurement_is_a_violation() -> None:
    assert Budgets(max_post_eviction_ppl=10).check({"post_eviction_ppl": math.nan})


def test_unset_budgets_are_not_checked() -> None:
    assert Budgets().check({"ppl_increase_pct": 1e9}) == []


def test_budget_for_another_scenario_is_refused() -> None:
    with pytest.raises(KvguardError, match="does not apply to this check"):
        Budgets(max_kv_entries=1).check({"ppl_increase_pct": 1.0})


def test_from_mapping_suggests_the_close_name() -> None:
    with pytest.raises(KvguardError, match="did you mean 'max_kv_entries'"):
        Budgets.from_mapping({"max_kv_entry": 3})


@pytest.mark.parametrize("bad", ["20%", True, -1, math.nan])
def test_bad_budget_values(bad: object) -> None:
    with pytest.raises(KvguardError, match="max_ppl_increase_pct"):
        Budgets(max_ppl_increase_pct=bad)  # type: ignore[arg-type]


def test_marker_signature_is_keyword_only_and_strict() -> None:
    with pytest.raises(TypeError):
        kv_budget(20)  # type: ignore[misc]
    with pytest.raises(KvguardError, match="unknown budget 'max_ppl_increse_pct'") as caught:
        kv_budget(max_ppl_increse_pct=20)
    assert (caught.value.fix or "").startswith("did you mean 'max_ppl_increase_pct'?")


def test_describe_is_compact() -> None:
    budgets = Budgets(max_ppl_increase_pct=25, max_post_eviction_ppl=13.5, max_kv_entries=256)
    assert budgets.describe() == "ppl+<=25%, ppl<=13.50, kv<=256"


def test_a_min_budget_may_sit_at_zero_where_the_figure_can_be_negative() -> None:
    # Sinks that make things worse give a negative gain: "sinks must not hurt" can fail.
    budgets = Budgets(min_sink_gain_pct=0)
    assert [v.budget for v in budgets.check({"sink_gain_pct": -3.0})] == ["min_sink_gain_pct"]
