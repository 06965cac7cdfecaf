"""The ``attention`` scenario over a quantized cache: which precisions can be read, and the
comparison with the same engine's full-precision read of the same ids."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import UNQUANTIZED_CACHE_TYPES, Policy, make_policy
from pytest_kvguard.engines.support import check_kv_precision
from pytest_kvguard.scenarios.base import KV_PRECISION, Fields


def precision_of(fields: Fields) -> Policy | None:
    """The full cache at the check's KV precision, or None where it sets none; refused where
    the engine does not take it, or (llama.cpp) where it quantizes V: llama.cpp quantizes V only
    under flash attention, which computes no probabilities kvguard can read."""
    p = fields.params
    given = {q.name: p[q.name] for q in KV_PRECISION if q.name in p}
    policy = make_policy("full", **given)
    if not policy.precision_set:
        return None
    check_kv_precision(fields.engine, policy, "reads_attention", "attention")
    if policy.cache_type_v not in UNQUANTIZED_CACHE_TYPES:
        raise KvguardError(
            f"attention reads llama.cpp's probabilities with flash attention off, and a "
            f"{policy.cache_type_v} V cache needs it on",
            fix="quantize K only (cache_type_v: f16): K is what the scores, and so the sink "
            "mass, are computed from",
            key="params.cache_type_v",
        )
    return policy


def head_diff_figures(reference: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """Per-head mass on the first tokens (both (layer, head)) of two reads of the same ids
    (two engines, or one engine at two precisions): the largest and mean |difference|, in
    percentage points."""
    diff = np.abs(other - reference)
    return {
        "sink_mass_diff_pct": float(diff.max()) * 100.0,
        "mean_sink_mass_diff_pct": float(diff.mean()) * 100.0,
    }


def check_diff_budget(precision: Policy | None, budgets: Budgets) -> None:
    """``max_sink_mass_diff_pct`` on an attention check compares two precisions: refuse it
    where the check sets none."""
    if budgets.max_sink_mass_diff_pct is not None and precision is None:
        raise KvguardError(
            "max_sink_mass_diff_pct compares the quantized cache's sink mass with the "
            "full-precision cache's, and this check quantizes nothing",
            fix="set kv_bits (mlx) or cache_type_k (llama_cpp), or remove the budget",
            key="budgets.max_sink_mass_diff_pct",
        )


def against_unquantized(metrics: Mapping[str, float]) -> str:
    """The table's ``vs unquantized`` cell: mean sink mass full -> quantized, the largest and
    mean per-head move; '-' for a row read at the default precision."""
    if "sink_mass_unquantized_pct" not in metrics:
        return "-"
    return (
        f"sink mass {metrics['sink_mass_unquantized_pct']:.1f}% -> "
        f"{metrics['sink_mass_pct']:.1f}%, head diff max {metrics['sink_mass_diff_pct']:.2f} / "
        f"mean {metrics['mean_sink_mass_diff_pct']:.2f} pt"
    )
