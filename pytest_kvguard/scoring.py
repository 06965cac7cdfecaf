"""Scoring next-token predictions: negative log-likelihoods, perplexity, and how far one run's
scores are from a reference run's on the same tokens."""

from __future__ import annotations

import math

import numpy as np


def nll_of(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under a row of logits (stable log-softmax)."""
    wide = logits.astype(np.float64)
    peak = wide.max(axis=1)
    log_norm = peak + np.log(np.exp(wide - peak[:, None]).sum(axis=1))
    result: np.ndarray = log_norm - wide[np.arange(len(targets)), targets]
    return result


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(nll.mean()))) if len(nll) else math.nan


def reuse_gap(reused: np.ndarray | None, fresh: np.ndarray | None) -> dict[str, float]:
    """How far the reused cache's predictions are from a fresh prefill's, per reply token:
    parity's figures (mean and largest |NLL difference| in nats, perplexity difference in %),
    NaN where the engine reports no token probabilities."""
    if reused is None or fresh is None or not len(reused):
        nan = math.nan
        return {"scored_tokens": 0.0, "mean_abs_nll_diff": nan, "max_abs_nll_diff": nan,
                "reused_ppl": nan, "fresh_ppl": nan, "ppl_diff_pct": nan}  # fmt: skip
    diff = np.abs(reused - fresh)
    reused_ppl, fresh_ppl = perplexity(reused), perplexity(fresh)
    return {
        "scored_tokens": float(len(reused)),
        "mean_abs_nll_diff": float(diff.mean()),
        "max_abs_nll_diff": float(diff.max()),
        "reused_ppl": reused_ppl,
        "fresh_ppl": fresh_ppl,
        "ppl_diff_pct": abs(reused_ppl / fresh_ppl - 1.0) * 100.0,
    }
