"""Scenario ``parity``: two engines, full cache, the same token ids; per-token NLL must agree.

A parity break is how a user sees that one engine changed (a kernel, a RoPE layout, a norm).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_kvguard.core.budgets import Limit
from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.core.scoring import perplexity
from pytest_kvguard.inputs.texts import load_text
from pytest_kvguard.scenarios.base import (
    TEXT,
    TOKENS,
    Check,
    Context,
    Fields,
    Measured,
    Scenario,
)
from pytest_kvguard.scenarios.feeding import StreamRun
from pytest_kvguard.scenarios.validate import require_text_room, require_two_engines

MAX_MEAN_ABS_NLL_DIFF = Limit(
    "max_mean_abs_nll_diff", "mean_abs_nll_diff", "max", " nats", "|dNLL|",
    "mean per-token |NLL difference| between engines",
    "parity: mean over tokens of |NLL(engine A) - NLL(engine B)| on the same ids, in nats.",
)  # fmt: skip
MAX_PPL_DIFF_PCT = Limit(
    "max_ppl_diff_pct", "ppl_diff_pct", "max", "%", "ppl diff",
    "perplexity difference between engines",
    "parity: |ppl(B) / ppl(A) - 1| in percent.",
)  # fmt: skip


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


@dataclass(frozen=True)
class ParitySpec:
    tokens: int
    text: str


@dataclass(frozen=True)
class ParityDetail:
    reference: str
    """The reference engine; the other is compared with it."""
    other: str


class ParityScenario(Scenario[ParitySpec]):
    name = "parity"
    summary = "full cache on two engines, same token ids: per-token NLL must agree"
    params = (TOKENS, TEXT)
    limits = (MAX_MEAN_ABS_NLL_DIFF, MAX_PPL_DIFF_PCT)
    detail_type = ParityDetail
    engines = 2
    takes_policy = False
    no_policy = ("parity runs the full cache on both engines", "remove '{key}'")

    def build(self, fields: Fields) -> ParitySpec:
        require_two_engines(fields, "parity", "a run")
        fields.policy_of("engines", "full")
        tokens: int = fields.params["tokens"]
        require_text_room(fields, tokens, "params.tokens")
        return ParitySpec(tokens, fields.text_name())

    def run(self, ctx: Context, check: Check[ParitySpec]) -> Measured:
        """Full-cache runs on both engines over the same token ids."""
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        full = make_policy("full")
        ref_name, other_name = check.engines
        ref_run, ref_new = ctx.stream_run(ref_name, check.model, full, text, spec.tokens)
        other_run, other_new = ctx.stream_run(other_name, check.model, full, text, spec.tokens)
        return Measured(
            policy="full",
            tokens=spec.tokens,
            text=text,
            metrics=compare_parity(ref_run, other_run).metrics,
            seconds={
                ref_name: ref_run.seconds if ref_new else 0.0,
                other_name: other_run.seconds if other_new else 0.0,
            },
            tokens_per_second=other_run.tokens_per_second,
            detail=ParityDetail(ref_name, other_name),
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["tokens", "reference ppl", "other ppl", "delta", "mean |dNLL|", "max |dNLL|"]
        lines = []
        for o in outcomes:
            m = o.metrics
            lines.append([[
                str(o.tokens), f"{m['reference_ppl']:.2f} ({o.detail.reference})",
                f"{m['other_ppl']:.2f} ({o.detail.other})", f"{m['ppl_ratio_pct']:+.1f}%",
                f"{m['mean_abs_nll_diff']:.3f}", f"{m['max_abs_nll_diff']:.2f}",
            ]])  # fmt: skip
        return headers, lines


SCENARIO = ParityScenario()
