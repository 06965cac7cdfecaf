"""Budgets: limits on a scenario's figures, and the violations a result makes of them.

The same ``Budgets`` type is built from a YAML ``budgets:`` mapping and from
``@pytest.mark.kv_budget(...)`` (its keyword-only constructor *is* the marker's signature,
so a misspelt budget fails loudly). This module does not import pytest.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pytest_kvguard.errors import KvguardError


def _limit(
    scenarios: str | tuple[str, ...],
    metric: str,
    bound: str,
    unit: str,
    short: str,
    label: str,
    doc: str,
) -> Any:
    """A budget field. ``bound`` is max, min, or flag (a boolean: the metric must not exceed 0).

    Units " B" and " B/token" accept sizes such as "6 MiB".
    """
    return field(
        default=None,
        metadata={
            "scenarios": (scenarios,) if isinstance(scenarios, str) else scenarios,
            "metric": metric, "bound": bound, "unit": unit, "short": short, "label": label,
            "doc": doc,
        },
    )  # fmt: skip


SIZE_UNITS_OF_BUDGETS = (" B", " B/token")


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Limits a check's result must stay within. Unset (None) limits are not checked."""

    max_ppl_increase_pct: float | None = _limit(
        ("stream", "sweep"),
        "ppl_increase_pct",
        "max",
        "%",
        "ppl+",
        "post-eviction perplexity increase over baseline",
        "Post-eviction perplexity may exceed the baseline policy's on the same tokens by at most "
        "this many percent (sweep: at the largest sink count).",
    )
    max_post_eviction_ppl: float | None = _limit(
        ("stream", "sweep"),
        "post_eviction_ppl",
        "max",
        "",
        "ppl",
        "post-eviction perplexity",
        "Perplexity over the tokens fed after the first eviction may not exceed this.",
    )
    max_kv_entries: float | None = _limit(
        ("stream", "memory", "recall"),
        "kv_entries",
        "max",
        " entries",
        "kv",
        "KV entries held at the end",
        "KV entries held per layer at the end of the run (deterministic).",
    )
    max_kv_bytes: float | str | None = _limit(
        ("stream", "memory"),
        "kv_bytes",
        "max",
        " B",
        "kv bytes",
        "KV bytes held at the end",
        "KV cache bytes at the end of the run (memory: at the longest length); bytes or a size "
        "such as '6 MiB'. llama.cpp: the context's state size; mlx-lm: the caches' buffers.",
    )
    max_peak_memory_bytes: float | str | None = _limit(
        ("stream", "memory"),
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
        ("stream", "memory"),
        "kv_growth_after_cap_bytes",
        "flag",
        " B",
        "bounded",
        "KV bytes grew after the cap was reached",
        "true: KV bytes may not grow once the cap is reached (needs a policy with a cap).",
    )
    max_kv_bytes_per_token: float | str | None = _limit(
        "memory",
        "kv_bytes_per_token",
        "max",
        " B/token",
        "kv/token",
        "KV bytes per token at the longest length",
        "memory: KV bytes / tokens fed at the longest length; bytes or a size such as '24 KiB'.",
    )
    max_kv_deviation_pct: float | None = _limit(
        "memory",
        "kv_deviation_pct",
        "max",
        "%",
        "kv dev",
        "largest deviation of measured from predicted KV bytes",
        "memory: the largest |measured / predicted - 1| over the lengths, in percent.",
    )

    min_sink_gain_pct: float | None = _limit(
        "sweep",
        "sink_gain_pct",
        "min",
        "%",
        "sink gain",
        "perplexity saved by sinks (no sinks vs the best sink count)",
        "sweep: post-eviction perplexity with 0 sinks over the best with sinks, minus 1, in %; "
        "an engine that ignores its sinks shows ~0.",
    )
    max_position_gap_pct: float | None = _limit(
        "sweep",
        "position_gap_pct",
        "max",
        "%",
        "pos gap",
        "largest perplexity gap between re-indexed and absolute positions",
        "sweep with positions [reindexed, absolute]: the largest |ppl ratio - 1| at one sink "
        "count, in %; a large gap pins a failure on position handling, not eviction.",
    )
    must_recall: bool | None = _limit(
        "recall",
        "forgot",
        "flag",
        "",
        "must recall",
        "the fact was not recalled",
        "recall: true = the answer must be the model's top choice at every token.",
    )
    must_forget: bool | None = _limit(
        "recall",
        "recalled",
        "flag",
        "",
        "must forget",
        "the fact was still recalled",
        "recall: true = the answer must not be recalled (the policy must really have evicted "
        "the fact). Set neither to allow both: recorded, not gated.",
    )
    max_mean_abs_nll_diff: float | None = _limit(
        "parity",
        "mean_abs_nll_diff",
        "max",
        " nats",
        "|dNLL|",
        "mean per-token |NLL difference| between engines",
        "parity: mean over tokens of |NLL(engine A) - NLL(engine B)| on the same ids, in nats.",
    )
    max_ppl_diff_pct: float | None = _limit(
        "parity",
        "ppl_diff_pct",
        "max",
        "%",
        "ppl diff",
        "perplexity difference between engines",
        "parity: |ppl(B) / ppl(A) - 1| in percent.",
    )
    max_reprefill_tokens: float | None = _limit(
        "edit_replay",
        "reprefill_tokens",
        "max",
        " tokens",
        "re-prefill",
        "prompt tokens re-prefilled",
        "edit_replay: follow-up prompt tokens decoded again (llama-server's prompt_n).",
    )
    max_reprefill_fraction: float | None = _limit(
        "edit_replay",
        "reprefill_fraction",
        "max",
        "",
        "re-prefill share",
        "share of the follow-up prompt re-prefilled",
        "edit_replay: re-prefilled tokens / follow-up prompt tokens (0 to 1).",
    )
    min_reused_tokens: float | None = _limit(
        "edit_replay",
        "reused_tokens",
        "min",
        " tokens",
        "reused",
        "cached tokens reused",
        "edit_replay: tokens served from the cache (llama-server's cache_n).",
    )
    max_memory_bytes: float | str | None = _limit(
        "edit_replay",
        "memory_bytes",
        "max",
        " B",
        "mem",
        "cache plus checkpoint memory",
        "edit_replay: cache state plus checkpoints after the first prompt; bytes or '24 MiB'.",
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
            if isinstance(value, str) and f.metadata["unit"] in SIZE_UNITS_OF_BUDGETS:
                object.__setattr__(self, f.name, parse_size(value, f.name))
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise KvguardError(
                    f"budget {f.name} must be a number, got {value!r}",
                    fix=f"write e.g. {f.name}: 20",
                )
            if math.isnan(value) or value < 0:
                raise KvguardError(f"budget {f.name} must be >= 0, got {value!r}")

    @classmethod
    def names(cls, scenario: str | None = None) -> list[str]:
        """Budget names, or those that apply to one scenario."""
        return [
            f.name for f in fields(cls) if scenario is None or scenario in f.metadata["scenarios"]
        ]

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
            unit = f.metadata["unit"] if f.metadata["unit"] in ("%", *SIZE_UNITS_OF_BUDGETS) else ""
            parts.append(f"{f.metadata['short']}{op}{_fmt(limit, unit)}")
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
            amount = f" (by {_fmt(self.measured, self.unit)})" if self.unit else ""
            return f"{self.budget}: {self.label}{amount}"
        return (
            f"{self.budget}: {self.label} budget {_fmt(self.limit, self.unit)}, "
            f"measured {_fmt(self.measured, self.unit)}"
        )


def _fmt(value: float, unit: str = "") -> str:
    if unit in SIZE_UNITS_OF_BUDGETS:
        return format_size(value) + unit[2:]
    text = f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
    return text + unit


SIZE_UNITS = {
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def format_size(n_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: ``5.6 MiB``, ``23 KiB``."""
    for unit in ("GiB", "MiB", "KiB"):
        scale = SIZE_UNITS[unit]
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:,.2f} {unit}"
    return f"{n_bytes:,.0f} B"


def parse_size(text: str, name: str) -> float:
    """``"24 MiB"`` -> 25165824.0; binary (KiB, MiB, GiB) and decimal (KB, MB, GB) units."""
    number, _, unit = text.strip().partition(" ")
    try:
        return float(number) * SIZE_UNITS[unit.strip() or "B"]
    except (ValueError, KeyError):
        raise KvguardError(
            f"budget {name} must be a size, got {text!r}",
            fix=f"write e.g. {name}: 24 MiB (units: {', '.join(SIZE_UNITS)})",
        ) from None


def unknown_key_error(kind: str, name: str, known: list[str]) -> KvguardError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return KvguardError(f"unknown {kind} '{name}'", fix=f"{hint}known: {', '.join(known)}")
