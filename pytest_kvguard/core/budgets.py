"""Budgets: limits on a scenario's figures, and the violations a result makes of them.

The same ``Budgets`` type is built from a YAML ``budgets:`` mapping and from
``@pytest.mark.kv_budget(...)`` (its keyword-only constructor *is* the marker's signature,
so a misspelt budget fails loudly). Which budgets apply to which scenario is each scenario's
own list (``pytest_kvguard.scenarios``). This module does not import pytest.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.units import SIZE_SUFFIXES, format_value, parse_size


def _limit(
    metric: str,
    bound: str,
    unit: str,
    short: str,
    label: str,
    doc: str,
    span: tuple[float, float] = (0.0, math.inf),
) -> Any:
    """A budget field. ``bound`` is max, min, or flag (a boolean: the metric must not exceed 0).

    Units " B" and " B/token" accept sizes such as "6 MiB". ``span`` is every value the metric
    can take: a max at or above its top, or a min at or below its bottom, could never fail.
    """
    return field(
        default=None,
        metadata={
            "metric": metric, "bound": bound, "unit": unit, "short": short, "label": label,
            "doc": doc, "span": span,
        },
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Limits a check's result must stay within. Unset (None) limits are not checked."""

    max_ppl_increase_pct: float | None = _limit(
        "ppl_increase_pct",
        "max",
        "%",
        "ppl+",
        "post-eviction perplexity increase over baseline",
        "Post-eviction perplexity may exceed the baseline policy's on the same tokens by at most "
        "this many percent (sweep: at the largest sink count).",
    )
    max_post_eviction_ppl: float | None = _limit(
        "post_eviction_ppl",
        "max",
        "",
        "ppl",
        "post-eviction perplexity",
        "Perplexity over the tokens fed after the first eviction may not exceed this.",
    )
    max_kv_entries: float | None = _limit(
        "kv_entries",
        "max",
        " entries",
        "kv",
        "KV entries held at the end",
        "KV entries held per layer at the end of the run (deterministic).",
    )
    max_kv_bytes: float | str | None = _limit(
        "kv_bytes",
        "max",
        " B",
        "kv bytes",
        "KV bytes held at the end",
        "KV cache bytes at the end of the run (memory: at the longest length); bytes or a size "
        "such as '6 MiB'. llama.cpp: the context's state size; mlx-lm: the caches' buffers.",
    )
    max_peak_memory_bytes: float | str | None = _limit(
        "peak_memory_bytes",
        "max",
        " B",
        "peak",
        "peak memory",
        "Peak memory of the run, weights included; bytes or a size such as '1.5 GiB'. mlx-lm: "
        "the weights plus the run's rise of mx.get_peak_memory(); llama.cpp: its own model + KV "
        "+ compute buffers.",
    )
    bounded: bool | None = _limit(
        "kv_growth_after_cap_bytes",
        "flag",
        " B",
        "bounded",
        "KV bytes grew after the cap was reached",
        "true: KV bytes may not grow once the cap is reached (needs a policy with a cap).",
    )
    max_kv_bytes_per_token: float | str | None = _limit(
        "kv_bytes_per_token",
        "max",
        " B/token",
        "kv/token",
        "KV bytes per token at the longest length",
        "memory: KV bytes / tokens fed at the longest length; bytes or a size such as '24 KiB'.",
    )
    max_kv_deviation_pct: float | None = _limit(
        "kv_deviation_pct",
        "max",
        "%",
        "kv dev",
        "largest deviation of measured from predicted KV bytes",
        "memory: the largest |measured / predicted - 1| over the lengths, in percent; stream "
        "(a quantized candidate): the same at the end of the run.",
    )

    min_sink_gain_pct: float | None = _limit(
        "sink_gain_pct",
        "min",
        "%",
        "sink gain",
        "perplexity saved by sinks (no sinks vs the best sink count)",
        "sweep: post-eviction perplexity with 0 sinks over the best with sinks, minus 1, in %; "
        "an engine that ignores its sinks shows ~0.",
        span=(-100.0, math.inf),
    )
    max_position_gap_pct: float | None = _limit(
        "position_gap_pct",
        "max",
        "%",
        "pos gap",
        "largest perplexity gap between re-indexed and absolute positions",
        "sweep with positions [reindexed, absolute]: the largest |ppl ratio - 1| at one sink "
        "count, in %; a large gap pins a failure on position handling, not eviction.",
    )
    max_chunk_gap_pct: float | None = _limit(
        "chunk_gap_pct",
        "max",
        "%",
        "chunk gap",
        "post-eviction perplexity fed in chunks over fed one token at a time",
        "stream with chunk > 1: post-eviction perplexity of the chunked run over the same policy "
        "fed one token at a time on the same ids, minus 1, in %; generate: the same for the "
        "reply tokens of the engine's generate path. An engine whose batched path keeps other "
        "tokens than its decode path shows here.",
        span=(-100.0, math.inf),
    )
    must_recall: bool | None = _limit(
        "forgot",
        "flag",
        "",
        "must recall",
        "the fact was not recalled",
        "recall: true = the answer must be the model's top choice at every token.",
    )
    must_forget: bool | None = _limit(
        "recalled",
        "flag",
        "",
        "must forget",
        "the fact was still recalled",
        "recall: true = the answer must not be recalled (the policy must really have evicted "
        "the fact). Set neither to allow both: recorded, not gated. Not with must_recall.",
    )
    max_mean_abs_nll_diff: float | None = _limit(
        "mean_abs_nll_diff",
        "max",
        " nats",
        "|dNLL|",
        "mean per-token |NLL difference| between engines",
        "parity: mean over tokens of |NLL(engine A) - NLL(engine B)| on the same ids, in nats.",
    )
    max_ppl_diff_pct: float | None = _limit(
        "ppl_diff_pct",
        "max",
        "%",
        "ppl diff",
        "perplexity difference between engines",
        "parity: |ppl(B) / ppl(A) - 1| in percent.",
    )
    max_reuse_excess: float | None = _limit(
        "reuse_excess",
        "max",
        " nats",
        "reuse excess",
        "reuse gap beyond the engine's own floor",
        "edit_replay: the reuse gap minus the floor, in nats per forced reply token. The gap "
        "is the mean |NLL difference| between the reused cache and a fresh prefill of the "
        "follow-up on the same engine and settings; the floor is the same figure between a "
        "fresh prefill cut where the reuse was cut (the tokens it kept, then the rest) and the "
        "fresh prefill in the engine's own batches: this engine's own rounding on these ids "
        "(0 where it is exact, and where nothing was reused).",
        span=(-math.inf, math.inf),
    )
    max_reprefill_tokens: float | None = _limit(
        "reprefill_tokens",
        "max",
        " tokens",
        "re-prefill",
        "prompt tokens re-prefilled",
        "edit_replay: follow-up prompt tokens decoded again (llama-server's prompt_n).",
    )
    max_reprefill_fraction: float | None = _limit(
        "reprefill_fraction",
        "max",
        "",
        "re-prefill share",
        "share of the follow-up prompt re-prefilled",
        "edit_replay: re-prefilled tokens / follow-up prompt tokens (0 to 1).",
        span=(0.0, 1.0),
    )
    min_reused_tokens: float | None = _limit(
        "reused_tokens",
        "min",
        " tokens",
        "reused",
        "cached tokens reused",
        "edit_replay: tokens served from the cache (llama-server's cache_n).",
    )
    max_window_missing_tokens: float | None = _limit(
        "window_missing_tokens",
        "max",
        " tokens",
        "window missing",
        "sliding-window positions missing under the reused prefix",
        "edit_replay, llama_cpp via api: of the positions the first re-prefilled token attends "
        "to in the sliding layers, those the cache no longer held when the engine kept its "
        "prefix (llama_memory_seq_pos_min). Above 0 the reused prefix is wrong whatever the "
        "scores say; the memory path never reuses such a prefix.",
    )
    max_memory_bytes: float | str | None = _limit(
        "memory_bytes",
        "max",
        " B",
        "mem",
        "cache plus checkpoint memory",
        "edit_replay: cache state plus checkpoints after the first prompt; bytes or '24 MiB'.",
    )

    min_sink_heads_pct: float | None = _limit(
        "sink_heads_pct",
        "min",
        "%",
        "sink heads",
        "share of heads that park their attention on the first tokens",
        "attention: percent of (layer, head) pairs whose mean mass on the first `sinks` tokens "
        "is at least `sink_threshold` percent.",
        span=(0.0, 100.0),
    )
    max_sink_position: float | None = _limit(
        "sink_position",
        "max",
        "",
        "sink pos",
        "position of the sink token",
        "attention: the sink (the position every query sees that draws the most mean mass) "
        "must be at or before this index; a template or tokenizer change that moves it fails.",
    )
    min_sink_mass_pct: float | None = _limit(
        "sink_mass_pct",
        "min",
        "%",
        "sink mass",
        "mean attention mass on the first tokens",
        "attention: mean over layers, heads and queries of the mass on the first `sinks` "
        "tokens, in %.",
        span=(0.0, 100.0),
    )
    max_sink_mass_diff_pct: float | None = _limit(
        "sink_mass_diff_pct",
        "max",
        " pt",
        "sink diff",
        "largest per-head difference in mass on the first tokens between engines or precisions",
        "attention_parity: the largest |mass(B) - mass(A)| over layers and heads, mass on the "
        "first `sinks` tokens in percentage points; attention (a quantized cache): the same "
        "between the quantized and the full-precision cache, on one engine.",
        span=(0.0, 100.0),
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.metadata["bound"] == "flag":
                if not isinstance(value, bool):
                    raise KvguardError(
                        f"budget {f.name} must be true or false, got {value!r}",
                        fix=f"write {f.name}: true",
                    )
                continue
            if isinstance(value, str) and f.metadata["unit"] in SIZE_SUFFIXES:
                value = parse_size(value, f.name)
                object.__setattr__(self, f.name, value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise KvguardError(
                    f"budget {f.name} must be a number, got {value!r}",
                    fix=f"write e.g. {f.name}: 20",
                )
            if math.isnan(value) or value < 0:
                raise KvguardError(f"budget {f.name} must be >= 0, got {value!r}")
            if math.isinf(value):
                raise KvguardError(
                    f"budget {f.name} is infinite, so it could never fail",
                    fix=f"give a finite limit, or remove {f.name}",
                )
            low, high = f.metadata["span"]
            if (f.metadata["bound"] == "max" and value >= high) or (
                f.metadata["bound"] == "min" and value <= low
            ):
                reach = f"at most {high:g}" if f.metadata["bound"] == "max" else f"at least {low:g}"
                raise KvguardError(
                    f"budget {f.name}: {value!r} could never fail ({f.metadata['metric']} is "
                    f"always {reach})",
                    fix=f"tighten {f.name}, or remove it",
                )
        if self.must_recall and self.must_forget:
            raise KvguardError(
                "must_recall and must_forget together can never both hold",
                fix="keep one of them (neither: recall is recorded, not gated)",
                key="budgets.must_forget",
            )

    @classmethod
    def names(cls) -> list[str]:
        """Every budget's name, in declaration order."""
        return [f.name for f in fields(cls)]

    @classmethod
    def gated_metrics(cls, names: Iterable[str]) -> dict[str, bool]:
        """The metric each named budget gates on, and whether it is better higher (a ``min``
        bound): the figures a baseline compares and the direction they regress in."""
        by_name = {f.name: f.metadata for f in fields(cls)}
        return {by_name[n]["metric"]: by_name[n]["bound"] == "min" for n in names}

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Budgets:
        """Build from a YAML mapping; unknown names get a suggestion."""
        for name in raw:
            if name not in cls.names():
                raise unknown_key_error("budget", str(name), cls.names())
        return cls(**raw)

    def declared(self) -> dict[str, float]:
        """Limits set, by name (``bounded: false`` is no limit at all)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if not _unset(getattr(self, f.name))
        }

    def check(self, metrics: Mapping[str, float]) -> list[Violation]:
        """Every declared limit the metrics break. A value equal to its limit passes."""
        violations = []
        for f in fields(self):
            limit = getattr(self, f.name)
            if _unset(limit):
                continue
            meta = f.metadata
            if meta["metric"] not in metrics:
                raise KvguardError(
                    f"budget {f.name} does not apply to this check",
                    fix="remove it; this check measures " + ", ".join(sorted(metrics)),
                )
            measured = metrics[meta["metric"]]
            if meta["bound"] == "flag":
                limit = 0.0
            broken = measured < limit if meta["bound"] == "min" else measured > limit
            if broken or math.isnan(measured):
                violations.append(
                    Violation(f.name, meta["label"], meta["unit"], limit, measured, meta["bound"])
                )
        return violations

    def describe(self) -> str:
        """Compact form for tables: ``ppl+<=25%, ppl<=13.5``."""
        parts = []
        for f in fields(self):
            limit = getattr(self, f.name)
            if _unset(limit):
                continue
            if f.metadata["bound"] == "flag":
                parts.append(f.metadata["short"])
                continue
            op = "<=" if f.metadata["bound"] == "max" else ">="
            unit = f.metadata["unit"] if f.metadata["unit"] in ("%", *SIZE_SUFFIXES) else ""
            parts.append(f"{f.metadata['short']}{op}{format_value(limit, unit)}")
        return ", ".join(parts) or "-"


def _unset(limit: object) -> bool:
    """None, or ``bounded: false`` (0 is a real limit, so no ``in (None, False)``)."""
    return limit is None or limit is False


kv_budget = Budgets
"""The marker's signature: ``@pytest.mark.kv_budget(max_ppl_increase_pct=20, ...)``."""


@dataclass(frozen=True)
class Violation:
    """One broken budget, with the figures that broke it."""

    budget: str
    label: str
    unit: str
    limit: float
    measured: float
    bound: str = "max"

    @property
    def message(self) -> str:
        if self.bound == "flag":
            amount = f" (by {format_value(self.measured, self.unit)})" if self.unit else ""
            return f"{self.budget}: {self.label}{amount}"
        return (
            f"{self.budget}: {self.label} budget {format_value(self.limit, self.unit)}, "
            f"measured {format_value(self.measured, self.unit)}"
        )


def unknown_key_error(kind: str, name: str, known: list[str]) -> KvguardError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return KvguardError(f"unknown {kind} '{name}'", fix=f"{hint}known: {', '.join(known)}")
