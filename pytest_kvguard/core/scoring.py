"""Scoring next-token predictions: negative log-likelihoods, perplexity, and how far one run's
scores are from a reference run's on the same tokens."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

ROWS_AT_ONCE = 8
"""Rows of logits widened to float64 at a time: a few MiB that stay in cache, where a whole
(256, 262144) block is 512 MiB; each row's arithmetic is the same either way."""


def nll_of(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under a row of logits (stable log-softmax)."""
    result = np.empty(len(targets), dtype=np.float64)
    for start in range(0, len(targets), ROWS_AT_ONCE):
        wide = logits[start : start + ROWS_AT_ONCE].astype(np.float64)
        peak = wide.max(axis=1)
        log_norm = peak + np.log(np.exp(wide - peak[:, None]).sum(axis=1))
        chosen = wide[np.arange(len(wide)), targets[start : start + ROWS_AT_ONCE]]
        result[start : start + ROWS_AT_ONCE] = log_norm - chosen
    return result


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(nll.mean()))) if len(nll) else math.nan


def floor_cuts(reused: int, prompt_tokens: int) -> list[int]:
    """Where the floor's fresh prefill is cut: where this reuse cut the follow-up, between the
    tokens it kept and those it prefilled (the split, a restored checkpoint, the engine's own
    rounding), for a correct reuse cut there computes its cache in those two parts; the
    reference it is set against is the fresh prefill in the engine's own batches (cut 0). A
    reuse that kept nothing has no cut: its replay is a fresh prefill itself, and its floor
    is 0."""
    return [reused] if 0 < reused < prompt_tokens else []


def reuse_gap(
    reused: np.ndarray | None,
    fresh: np.ndarray | None,
    cuts: Mapping[int, np.ndarray] | None = None,
) -> dict[str, float]:
    """How far the reused cache's predictions are from a fresh prefill's, per forced reply
    token, judged against the engine's own floor.

    ``mean_abs_nll_diff`` (the reuse gap) is the mean |NLL difference| (reused - fresh, nats
    per token). ``reuse_floor`` is the largest such figure between a fresh prefill cut where a
    correct reuse is cut (``cuts``: the cut's position -> its scores) and the fresh prefill in
    the engine's own batches: how far two correct computations of the same ids are apart on
    this engine (0 where it is exact, or where no cut is given). ``reuse_excess`` is the gap
    minus the floor. ``nll_shift`` is the signed mean difference (the log of the perplexity
    ratio), reported: a stale cache moves predictions both ways, so it can net out. Also the
    largest |difference| and both perplexities. NaN where the engine reports no token
    probabilities."""
    if reused is None or fresh is None or not len(reused):
        nan = math.nan
        return {"scored_tokens": 0.0, "mean_abs_nll_diff": nan, "max_abs_nll_diff": nan,
                "reused_ppl": nan, "fresh_ppl": nan, "ppl_diff_pct": nan, "nll_shift": nan,
                "reuse_floor": nan, "reuse_excess": nan}  # fmt: skip
    diff = reused - fresh
    gap = float(np.abs(diff).mean())
    floor = max((float(np.abs(nll - fresh).mean()) for nll in (cuts or {}).values()), default=0.0)
    reused_ppl, fresh_ppl = perplexity(reused), perplexity(fresh)
    return {
        "scored_tokens": float(len(reused)),
        "mean_abs_nll_diff": gap,
        "max_abs_nll_diff": float(np.abs(diff).max()),
        "reused_ppl": reused_ppl,
        "fresh_ppl": fresh_ppl,
        "ppl_diff_pct": abs(reused_ppl / fresh_ppl - 1.0) * 100.0,
        "nll_shift": float(diff.mean()),
        "reuse_floor": floor,
        "reuse_excess": gap - floor,
    }
