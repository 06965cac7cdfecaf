"""Scoring next-token predictions: negative log-likelihoods and perplexity."""

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
