"""Why a stream or sweep check broke: the heads that park their attention on the first tokens,
read as the ``attention`` scenario reads them (its explanation's schema: ``extras``)."""

from __future__ import annotations

from typing import Any

from pytest_kvguard.engines import ReadsAttention
from pytest_kvguard.inputs.texts import load_text
from pytest_kvguard.scenarios.attention import (
    ATTENTION_TOKENS,
    RECENT,
    SINK_SPAN,
    SINK_THRESHOLD,
    AttentionSpec,
    capture,
    default_queries,
    sink_figures,
)
from pytest_kvguard.scenarios.base import Check, Context


def explain_sinks(ctx: Context, check: Check[Any], sinks_kept: int) -> dict[str, Any] | None:
    """For a stream or sweep check that broke a budget (a FAIL, or a negative control CAUGHT):
    the heads of its engine and model that park their attention on the first tokens (read as
    the ``attention`` scenario's defaults read them, on the check's text), and how many of
    those tokens the policy kept. None where the engine cannot expose its attention or the run
    is too short to tell."""
    engine = ctx.engine(check.engine, check.model)
    if not isinstance(engine, ReadsAttention):
        return None
    text = load_text(check.spec.text, check.base_dir)
    tokens = min(ATTENTION_TOKENS.default, check.spec.tokens)
    spec = AttentionSpec(tokens, check.spec.text, default_queries(tokens), SINK_SPAN.default,
                         SINK_THRESHOLD.default, RECENT.default, "model")  # fmt: skip
    if spec.queries[0] - spec.recent + 1 <= spec.sinks:
        return None  # too short a run to tell a sink from the recent tokens
    rows, ids, _ = capture(ctx, check.engine, check.model, text, spec)
    metrics, arrays = sink_figures(rows.probs, spec.queries, spec.sinks, spec.sink_threshold,
                                   spec.recent)  # fmt: skip
    heads = arrays["head_sink_mass"]
    sink_heads = [
        [layer, head, round(mass, 4)]
        for layer, masses in enumerate(heads)
        for head, mass in enumerate(masses)
        if mass * 100 >= spec.sink_threshold
    ]
    if sinks_kept >= spec.sinks:
        lost = "asks to keep them: if they are lost, the engine dropped them"
    else:
        lost = (
            f"keeps {sinks_kept} of the first {spec.sinks} tokens, so these heads lose "
            f"{'their sink' if sinks_kept == 0 else 'part of it'}"
        )
    position = int(metrics["sink_position"])
    return {
        "summary": (
            f"{len(sink_heads)} of {len(heads) * len(heads[0])} heads put >= "
            f"{spec.sink_threshold}% of their attention on the first {spec.sinks} tokens "
            f"(sink: #{position} {engine.token_piece(ids[position])!r}, "
            f"{metrics['sink_position_mass_pct']:.1f}% of all attention); the policy {lost}"
        ),
        "sinks_kept": sinks_kept,
        "sink_heads": sink_heads,
        "head_sink_mass": heads,
    }
