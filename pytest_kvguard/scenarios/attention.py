"""Scenario ``attention``: where each layer and head puts its attention, read from the engine.

Over a text, under the full cache, the attention probabilities of chosen query positions are
read from the engine itself (llama.cpp: its ``kq_soft_max`` tensors through the graph callback,
flash attention off; mlx-lm: the softmax of the queries and keys its layers pass, checked
against its fused kernel's output). From them: the sink token (the position that draws the
most attention from every query), the mass each head puts on the first k tokens (k = 1..8) and
on the most recent window, and the share of sink heads. A red stream check is explained here:
evict the first tokens and the sink heads lose what they park their attention on.

With a KV precision (mlx-lm's ``kv_bits``, llama.cpp's ``cache_type_k``), the rows are read
again over the engine's quantized cache, and compared head by head with the full-precision
read of the same run: how far quantization moves the mass the sink heads park.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pytest_kvguard.core.budgets import Budgets, Limit
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines import AttentionRows, ReadsAttention
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import Text, load_text
from pytest_kvguard.scenarios.attention_precision import (
    against_unquantized,
    check_diff_budget,
    head_diff_figures,
    precision_of,
)
from pytest_kvguard.scenarios.base import (
    KV_PRECISION,
    TEXT,
    Check,
    Context,
    Fields,
    Measured,
    Panel,
    Param,
    Scenario,
)
from pytest_kvguard.scenarios.extras import sink_heads_panel
from pytest_kvguard.scenarios.limits import MAX_SINK_MASS_DIFF_PCT
from pytest_kvguard.scenarios.validate import ascending_counts, require_text_room

MIN_SINK_HEADS_PCT = Limit(
    "min_sink_heads_pct", "sink_heads_pct", "min", "%", "sink heads",
    "share of heads that park their attention on the first tokens",
    "attention: percent of (layer, head) pairs whose mean mass on the first `sinks` tokens is at "
    "least `sink_threshold` percent.",
    span=(0.0, 100.0),
)  # fmt: skip
MAX_SINK_POSITION = Limit(
    "max_sink_position", "sink_position", "max", "", "sink pos",
    "position of the sink token",
    "attention: the sink (the position every query sees that draws the most mean mass) must be at"
    " or before this index; a template or tokenizer change that moves it fails.",
)  # fmt: skip
MIN_SINK_MASS_PCT = Limit(
    "min_sink_mass_pct", "sink_mass_pct", "min", "%", "sink mass",
    "mean attention mass on the first tokens",
    "attention: mean over layers, heads and queries of the mass on the first `sinks` tokens, in "
    "%.",
    span=(0.0, 100.0),
)  # fmt: skip

FIRST_K = 8
"""Mass on the first k tokens is reported for k = 1 .. FIRST_K."""
ROW_SUM_TOLERANCE = 1e-3
"""A captured row's probabilities must sum to 1 within this (else the capture is wrong)."""

BOS_MODES = ("model", "drop", "add")

ATTENTION_TOKENS = Param(
    "tokens",
    "int",
    512,
    "token ids fed; the queries sit in their second half by default (past a 256 cap, inside "
    "Gemma 3's 512 sliding window)",
    minimum=16,
)
QUERIES = Param(
    "queries",
    "ints",
    None,
    "query positions whose attention is read (default: 8 spread over the second half of tokens)",
    minimum=0,
)
SINK_SPAN = Param(
    "sinks",
    "int",
    4,
    "leading tokens whose attention mass makes a head a sink head (as a sink policy keeps)",
    minimum=1,
)
SINK_THRESHOLD = Param(
    "sink_threshold",
    "int",
    50,
    "percent of a head's attention (mean over the queries) on the first `sinks` tokens that "
    "makes it a sink head",
    minimum=1,
)
RECENT = Param(
    "recent",
    "int",
    64,
    "the most recent tokens (the query's own included) whose attention mass is reported",
    minimum=1,
)
BOS = Param(
    "bos",
    "str",
    "model",
    "model: the tokenizer's ids as they are; drop: remove a leading BOS; add: put BOS in front "
    "(a template that stops or starts emitting it)",
)


@dataclass(frozen=True)
class AttentionSpec:
    tokens: int
    text: str
    queries: tuple[int, ...]
    sinks: int
    sink_threshold: int
    recent: int
    bos: str
    precision: Policy | None = None
    """The full cache at a KV precision (read beside the full-precision cache); None: the
    engine's default precision alone."""


def default_queries(tokens: int) -> tuple[int, ...]:
    """8 positions spread evenly over the second half of the tokens, the last one included."""
    return tuple(int(q) for q in np.unique(np.linspace(tokens // 2, tokens - 1, 8).round()))


@dataclass(frozen=True)
class AttentionDetail:
    sink_token: str
    """The sink token's text, as the engine's vocabulary spells it."""
    first_ids: list[int]
    """The first token ids fed (a BOS shows here)."""
    queries: list[int]
    sink_mass_by_k: list[float]
    """Mean mass (over layers, heads, queries) on the first k tokens, k = 1 .. 8."""
    layer_sink_mass: list[float]
    """Per layer, mean mass on the first ``sinks`` tokens."""
    head_sink_mass: list[list[float]]
    """Per layer and head, mean mass (over the queries) on the first ``sinks`` tokens."""
    head_mass_by_k: list[list[list[float]]]
    """Per layer and head, mean mass on the first k tokens, k = 1 .. 8."""
    head_recent_mass: list[list[float]]
    """Per layer and head, mean mass on the ``recent`` most recent tokens (the query's own
    included)."""
    how: str
    """How the engine's probabilities were read, in one line."""
    unquantized_head_sink_mass: list[list[float]] = field(default_factory=list)
    """A quantized check: per layer and head, the mass on the first ``sinks`` tokens over the
    full-precision cache (``head_sink_mass`` is over the quantized one); empty otherwise."""


def sink_figures(
    probs: np.ndarray, queries: Sequence[int], sinks: int, threshold_pct: int, recent: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """The gated figures and the detail's arrays from probabilities (layer, head, query, key).

    The sink position is the key before every query's recent window that draws the largest
    mean mass: a position every query sees, so a token is not a sink for being recent.
    """
    head_mass = probs[..., :sinks].sum(-1).mean(-1)  # (layer, head)
    seen_by_all = max(1, min(queries) - recent + 1)
    mean_per_key = probs[..., :seen_by_all].mean(axis=(0, 1, 2))
    sink_position = int(mean_per_key.argmax())
    recent_mass = np.stack(
        [probs[:, :, i, max(0, q - recent + 1) : q + 1].sum(-1) for i, q in enumerate(queries)],
        axis=-1,
    )
    row_sums = probs.sum(-1)
    metrics = {
        "sink_position": float(sink_position),
        "sink_position_mass_pct": float(mean_per_key[sink_position]) * 100.0,
        "sink_heads_pct": float((head_mass * 100.0 >= threshold_pct).mean()) * 100.0,
        "sink_mass_pct": float(head_mass.mean()) * 100.0,
        "recent_mass_pct": float(recent_mass.mean()) * 100.0,
        "max_row_sum_error": float(np.abs(row_sums - 1.0).max()),
    }
    by_k = np.stack([probs[..., :k].sum(-1).mean(-1) for k in range(1, FIRST_K + 1)], axis=-1)
    detail = {
        "sink_mass_by_k": [float(v) for v in by_k.mean(axis=(0, 1))],
        "head_mass_by_k": by_k.round(6).tolist(),
        "head_recent_mass": recent_mass.mean(-1).round(6).tolist(),
        "layer_sink_mass": [float(v) for v in head_mass.mean(-1)],
        "head_sink_mass": [[float(v) for v in layer] for layer in head_mass],
    }
    return metrics, detail


def capture_findings(rows: AttentionRows, row_sum_error: float) -> list[str]:
    """What says the captured probabilities are not the engine's: rows that do not sum to 1
    (unless the model has learned sink logits), or an output they do not reproduce."""
    findings = []
    if row_sum_error > ROW_SUM_TOLERANCE and not rows.learned_sinks:
        findings.append(
            f"captured attention rows sum to 1 only within {row_sum_error:.2e} (tolerance "
            f"{ROW_SUM_TOLERANCE:g}): the capture is not the engine's softmax"
        )
    if rows.reconstruction_error is not None and rows.reconstruction_error > 1.0:
        findings.append(
            f"probs @ V differs from the engine's own attention output by "
            f"{rows.reconstruction_error:.1f}x what its dtype allows: the capture is not the "
            "attention the engine ran"
        )
    return findings


def with_bos(ids: list[int], bos_id: int | None, mode: str) -> list[int]:
    """The ids with a leading BOS dropped or added as ``mode`` says."""
    if mode == "model":
        return ids
    if bos_id is None:
        raise KvguardError(f"bos: {mode} needs a model with a BOS token; this one has none")
    starts = bool(ids) and ids[0] == bos_id
    if mode == "drop":
        return ids[1:] if starts else ids
    return ids if starts else [bos_id, *ids]


def capture(
    ctx: Context, engine_name: str, model: ModelRef, text: Text, spec: AttentionSpec,
    precision: Policy | None = None,
) -> tuple[AttentionRows, list[int], bool]:  # fmt: skip
    """The engine's attention rows for the spec's queries, over a cache at ``precision``
    (None: the engine's default), memoised per session: a parity check, an attention check
    and a quantized one's full-precision read of the same text share them; the ids fed, and
    whether they were computed now."""
    engine = ctx.engine(engine_name, model)
    if not isinstance(engine, ReadsAttention):
        raise KvguardError(f"engine '{engine_name}' cannot expose its attention probabilities")
    # One id more where a leading BOS may be dropped.
    raw = ctx.token_ids(engine_name, model, text, spec.tokens + (spec.bos == "drop"))
    ids = with_bos(raw, engine.bos_id, spec.bos)[: spec.tokens]
    label = "" if precision is None else precision.precision()
    key = ("attention", engine_name, str(model.resolve()), text.sha256, tuple(ids), spec.queries,
           label)  # fmt: skip

    def compute() -> AttentionRows:
        ctx.say(f"{engine_name}: reading attention of {len(spec.queries)} queries over "
                f"{len(ids)} tokens{f' (KV {label})' if label else ''}")  # fmt: skip
        rows: AttentionRows = engine.attention(ids, spec.queries, precision)
        return rows

    rows, new = ctx.memo(key, compute)
    return rows, ids, new


def build_spec(fields: Fields) -> AttentionSpec:
    """The spec of an attention or attention_parity check, validated."""
    p = fields.params
    tokens: int = p["tokens"]
    require_text_room(fields, tokens, "params.tokens")
    queries = p["queries"]
    if queries is None:
        queries = default_queries(tokens)
    else:
        queries = tuple(
            ascending_counts(queries, "queries", 0, 1, f"[{tokens // 2}, {tokens - 1}]")
        )
    if queries[-1] >= tokens:
        raise KvguardError(
            f"query position {queries[-1]} is not among the {tokens} tokens fed "
            f"(0 .. {tokens - 1})",
            fix=f"use positions below {tokens}, or raise tokens",
            key="params.queries",
        )
    if p["sinks"] > FIRST_K or p["sinks"] >= queries[0]:
        raise KvguardError(
            f"sinks {p['sinks']} must be at most {FIRST_K} and before the first query "
            f"({queries[0]})",
            fix="use sinks: 4",
            key="params.sinks",
        )
    if queries[0] - p["recent"] + 1 <= p["sinks"]:
        raise KvguardError(
            f"the first query ({queries[0]}) minus recent ({p['recent']}) leaves no position "
            f"past the first {p['sinks']} tokens that every query sees, so the sink could never "
            "be found anywhere else",
            fix="move the queries later, or lower recent",
            key="params.queries" if fields.params["queries"] is not None else "params.recent",
        )
    if p["sink_threshold"] > 100:
        raise KvguardError(
            f"sink_threshold is a percent, got {p['sink_threshold']}",
            fix="use sink_threshold: 50",
            key="params.sink_threshold",
        )
    if p["bos"] not in BOS_MODES:
        raise KvguardError(
            f"bos must be one of {', '.join(BOS_MODES)}, got {p['bos']!r}",
            fix="use bos: model",
            key="params.bos",
        )
    return AttentionSpec(tokens, fields.text_name(), queries, p["sinks"], p["sink_threshold"],
                         p["recent"], p["bos"])  # fmt: skip


PARAMS = (ATTENTION_TOKENS, QUERIES, SINK_SPAN, SINK_THRESHOLD, RECENT, BOS, *KV_PRECISION, TEXT)


class AttentionScenario(Scenario[AttentionSpec]):
    name = "attention"
    summary = (
        "full cache, the engine's own attention probabilities: the sink token, sink heads per "
        "layer, mass on the first k tokens and on the recent window"
    )
    params = PARAMS
    limits = (MIN_SINK_HEADS_PCT, MAX_SINK_POSITION, MIN_SINK_MASS_PCT, MAX_SINK_MASS_DIFF_PCT)
    detail_type = AttentionDetail
    takes_policy = False
    no_policy = ("attention reads the full cache", "remove '{key}'")

    def build(self, fields: Fields) -> AttentionSpec:
        fields.policy_of("engine", "full")
        return replace(build_spec(fields), precision=precision_of(fields))

    def check_budgets(self, spec: AttentionSpec, budgets: Budgets) -> None:
        check_diff_budget(spec.precision, budgets)

    def panels(self, outcome: Any) -> list[Panel]:
        note = f"sink token {outcome.detail.sink_token!r}"
        return [sink_heads_panel(outcome, outcome.detail.head_sink_mass, note)]

    def run(self, ctx: Context, check: Check[AttentionSpec]) -> Measured:
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        rows, ids, new = capture(ctx, check.engine, check.model, text, spec, spec.precision)
        metrics, arrays = sink_figures(rows.probs, spec.queries, spec.sinks,
                                       spec.sink_threshold, spec.recent)  # fmt: skip
        findings: list[str] = []
        findings += capture_findings(rows, metrics["max_row_sum_error"])
        if rows.reconstruction_error is not None:
            metrics["reconstruction_error_ratio"] = rows.reconstruction_error
        seconds = rows.seconds if new else 0.0
        unquantized_heads: list[list[float]] = []
        if spec.precision is not None:
            # The same engine's full-precision read of the same ids is the reference.
            full, _, full_new = capture(ctx, check.engine, check.model, text, spec)
            _, full_arrays = sink_figures(full.probs, spec.queries, spec.sinks,
                                          spec.sink_threshold, spec.recent)  # fmt: skip
            unquantized_heads = full_arrays["head_sink_mass"]
            full_heads = np.array(unquantized_heads)
            metrics.update(head_diff_figures(full_heads, np.array(arrays["head_sink_mass"])))
            metrics["sink_mass_unquantized_pct"] = float(full_heads.mean()) * 100.0
            seconds += full.seconds if full_new else 0.0
        engine = ctx.engine(check.engine, check.model)
        sink = ids[int(metrics["sink_position"])]
        return Measured(
            policy="full" if spec.precision is None else spec.precision.describe(),
            tokens=spec.tokens,
            text=text,
            metrics=metrics,
            seconds={check.engine: seconds},
            tokens_per_second=spec.tokens / rows.seconds if rows.seconds else 0.0,
            detail=AttentionDetail(
                sink_token=engine.token_piece(sink)
                if isinstance(engine, ReadsAttention)
                else str(sink),
                first_ids=list(ids[:FIRST_K]),
                queries=list(spec.queries),
                **arrays,
                how=rows.how,
                unquantized_head_sink_mass=unquantized_heads,
            ),
            findings=findings,
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["tokens", "sink token", "sink heads", "mass on first k (1/4/8)", "recent"]
        # Only a table with a quantized row has the comparison column (older quotes keep
        # their shape).
        quantized = any("sink_mass_unquantized_pct" in o.metrics for o in outcomes)
        if quantized:
            headers.append("vs unquantized")
        lines = []
        for o in outcomes:
            m, d = o.metrics, o.detail
            by_k = d.sink_mass_by_k
            line = [
                str(o.tokens), f"#{m['sink_position']:.0f} {d.sink_token!r} "
                f"({m['sink_position_mass_pct']:.1f}%)", f"{m['sink_heads_pct']:.1f}%",
                f"{by_k[0]:.1%} / {by_k[3]:.1%} / {by_k[7]:.1%}", f"{m['recent_mass_pct']:.1f}%",
            ]  # fmt: skip
            if quantized:
                line.append(against_unquantized(m))
            lines.append([line])
        return headers, lines


SCENARIO = AttentionScenario()
