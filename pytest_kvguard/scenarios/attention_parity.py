"""Scenario ``attention_parity``: two engines' attention on the same token ids must agree.

Each head's mass on the first ``sinks`` tokens (the figure that makes it a sink head), read
from both engines as the ``attention`` scenario reads it, compared head by head. A kernel or
RoPE change in one engine that moves where heads park their attention shows here before any
perplexity does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.texts import load_text
from pytest_kvguard.scenarios.attention import (
    PARAMS,
    AttentionSpec,
    build_spec,
    capture,
    capture_findings,
)
from pytest_kvguard.scenarios.attention_precision import head_diff_figures
from pytest_kvguard.scenarios.base import (
    Check,
    Context,
    Fields,
    Measured,
    Scenario,
)
from pytest_kvguard.scenarios.limits import MAX_SINK_MASS_DIFF_PCT
from pytest_kvguard.scenarios.validate import require_two_engines


@dataclass(frozen=True)
class AttentionParityDetail:
    reference: str
    other: str
    head_sink_mass_diff: list[list[float]]
    """Per layer and head: other engine's mass on the first ``sinks`` tokens minus the
    reference's (mean over the queries)."""


class AttentionParityScenario(Scenario[AttentionSpec]):
    name = "attention_parity"
    summary = (
        "full cache on two engines, same token ids: each head's attention mass on the first "
        "tokens must agree"
    )
    params = PARAMS
    limits = (MAX_SINK_MASS_DIFF_PCT,)
    detail_type = AttentionParityDetail
    engines = 2
    takes_policy = False
    no_policy = ("attention_parity reads the full cache on both engines", "remove '{key}'")

    def build(self, fields: Fields) -> AttentionSpec:
        require_two_engines(fields, "attention_parity", "an engine's attention")
        fields.policy_of("engines", "full")
        return build_spec(fields)

    def run(self, ctx: Context, check: Check[AttentionSpec]) -> Measured:
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        (ref_name, other_name), seconds, masses = check.engines, {}, []
        findings: list[str] = []
        for name in check.engines:
            rows, _, new = capture(ctx, name, check.model, text, spec)
            seconds[name] = rows.seconds if new else 0.0
            masses.append(rows.probs[..., : spec.sinks].sum(-1).mean(-1))
            row_sum_error = float(np.abs(rows.probs.sum(-1) - 1.0).max())
            findings += [f"{name}: {f}" for f in capture_findings(rows, row_sum_error)]
        if masses[0].shape != masses[1].shape:
            raise KvguardError(
                f"{ref_name} reads {masses[0].shape} layers x heads, {other_name} "
                f"{masses[1].shape}: not the same model"
            )
        diff = masses[1] - masses[0]
        return Measured(
            policy="full",
            tokens=spec.tokens,
            text=text,
            metrics={
                **head_diff_figures(masses[0], masses[1]),
                "reference_sink_mass_pct": float(masses[0].mean()) * 100.0,
                "other_sink_mass_pct": float(masses[1].mean()) * 100.0,
            },
            seconds=seconds,
            tokens_per_second=0.0,
            detail=AttentionParityDetail(
                ref_name, other_name, [[float(v) for v in layer] for layer in diff]
            ),
            findings=findings,
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["tokens", "reference sink mass", "other sink mass", "max |diff|", "mean |diff|"]
        lines = []
        for o in outcomes:
            m = o.metrics
            lines.append([[
                str(o.tokens), f"{m['reference_sink_mass_pct']:.1f}% ({o.detail.reference})",
                f"{m['other_sink_mass_pct']:.1f}% ({o.detail.other})",
                f"{m['sink_mass_diff_pct']:.2f} pt", f"{m['mean_sink_mass_diff_pct']:.2f} pt",
            ]])  # fmt: skip
        return headers, lines


SCENARIO = AttentionParityScenario()
