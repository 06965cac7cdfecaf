"""Scenario ``parity``: two engines, full cache, the same token ids; per-token NLL must agree.

A parity break is how a user sees that one engine changed (a kernel, a RoPE layout, a norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pytest_kvguard.scenarios.stream import StreamRun, perplexity


@dataclass(frozen=True)
class ParityResult:
    reference: StreamRun
    other: StreamRun

    @property
    def metrics(self) -> dict[str, float]:
        diff = np.abs(self.reference.nll - self.other.nll)
        ref_ppl, other_ppl = perplexity(self.reference.nll), perplexity(self.other.nll)
        return {
            "mean_abs_nll_diff": float(diff.mean()),
            "max_abs_nll_diff": float(diff.max()),
            "reference_ppl": ref_ppl,
            "other_ppl": other_ppl,
            "ppl_ratio_pct": (other_ppl / ref_ppl - 1.0) * 100.0,
            "ppl_diff_pct": abs(other_ppl / ref_ppl - 1.0) * 100.0,
        }


def compare_parity(reference: StreamRun, other: StreamRun) -> ParityResult:
    if reference.n_tokens != other.n_tokens:
        raise ValueError("parity needs the same token ids on both engines")
    return ParityResult(reference, other)
