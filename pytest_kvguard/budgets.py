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
    scenario: str, metric: str, bound: str, unit: str, short: str, label: str, doc: str
) -> Any:
    return field(
        default=None,
        metadata={
            "scenario": scenario, "metric": metric, "bound": bound, "unit": unit, "short": short,
            "label": label, "doc": doc,
        },
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Limits a check's result must stay within. Unset (None) limits are not checked."""

    max_ppl_increase_pct: float | None = _limit(
        "stream",
        "ppl_increase_pct",
        "max",
        "%",
        "ppl+",
        "post-eviction perplexity increase over baseline",
        "Post-eviction perplexity may exceed the baseline policy's on the same tokens by at most "
        "this many percent.",
    )
    max_post_eviction_ppl: float | None = _limit(
        "stream",
        "post_eviction_ppl",
        "max",
        "",
        "ppl",
        "post-eviction perplexity",
        "Perplexity over the tokens fed after the first eviction may not exceed this.",
    )
    max_kv_entries: float | None = _limit(
        "stream",
        "kv_entries",
        "max",
        " entries",
        "kv",
        "KV entries held at the end",
        "KV entries held per layer at the end of the run (deterministic).",
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
            if isinstance(value, str) and f.metadata["unit"] == " B":
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
        return [f.name for f in fields(cls) if scenario in (None, f.metadata["scenario"])]

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Budgets:
        """Build from a YAML mapping; unknown names get a suggestion."""
        for name in raw:
            if name not in cls.names():
                raise unknown_key_error("budget", str(name), cls.names())
        return cls(**raw)

    def declared(self) -> dict[str, float]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def check(self, metrics: Mapping[str, float]) -> list[Violation]:
        """Every declared limit the metrics break. A value equal to its limit passes."""
        violations = []
        for f in fields(self):
            limit = getattr(self, f.name)
            if limit is None:
                continue
            meta = f.metadata
            if meta["metric"] not in metrics:
                raise KvguardError(
                    f"budget {f.name} does not apply to this scenario",
                    fix="remove it; this scenario measures " + ", ".join(sorted(metrics)),
                )
            measured = metrics[meta["metric"]]
            broken = measured > limit if meta["bound"] == "max" else measured < limit
            if broken or math.isnan(measured):
                violations.append(Violation(f.name, meta["label"], meta["unit"], limit, measured))
        return violations

    def describe(self) -> str:
        """Compact form for tables: ``ppl+<=25%, ppl<=13.5``."""
        parts = []
        for f in fields(self):
            limit = getattr(self, f.name)
            if limit is not None:
                op = "<=" if f.metadata["bound"] == "max" else ">="
                unit = f.metadata["unit"] if f.metadata["unit"] in ("%", " B") else ""
                parts.append(f"{f.metadata['short']}{op}{_fmt(limit, unit)}")
        return ", ".join(parts) or "-"


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

    @property
    def message(self) -> str:
        return (
            f"{self.budget}: {self.label} budget {_fmt(self.limit, self.unit)}, "
            f"measured {_fmt(self.measured, self.unit)}"
        )


def _fmt(value: float, unit: str = "") -> str:
    if unit == " B":
        return f"{value / 2**20:,.1f} MiB"
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
