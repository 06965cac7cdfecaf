"""Scenario ``memory``: KV bytes at several context lengths, measured against the prediction.

One stream run under the policy, fed exactly as the ``stream`` scenario feeds it, records the
engine's own figures at each length; ``capacity.predict_engine_kv_bytes`` says what the policy
should hold there. A measured figure far above the prediction means the engine kept more than
the policy allows: the cap or the window was not applied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pytest_kvguard.budgets import format_size
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.scenarios import ascending_counts
from pytest_kvguard.scenarios.stream import StreamRun, growth_metric

DEFAULT_LENGTHS = (512, 1024, 2048, 4096)
NOT_APPLIED_RATIO = 1.5
"""Measured above this many times the prediction: flagged "cap or window not applied"."""


@dataclass(frozen=True)
class MemoryRow:
    """Predicted and measured KV bytes after ``tokens`` tokens."""

    tokens: int
    held: int
    kv_bytes: float
    predicted_bytes: float
    peak_memory_bytes: float

    @property
    def deviation_pct(self) -> float:
        return (self.kv_bytes / self.predicted_bytes - 1.0) * 100.0

    @property
    def not_applied(self) -> bool:
        return self.kv_bytes > self.predicted_bytes * NOT_APPLIED_RATIO

    def to_json(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "held": self.held,
            "kv_bytes": self.kv_bytes,
            "predicted_bytes": self.predicted_bytes,
            "deviation_pct": self.deviation_pct,
            "peak_memory_bytes": self.peak_memory_bytes,
            "not_applied": float(self.not_applied),
        }


@dataclass(frozen=True)
class MemoryResult:
    run: StreamRun
    rows: list[MemoryRow]

    @property
    def metrics(self) -> dict[str, float]:
        """Figures budgets gate on: the longest length's, and the worst deviation."""
        last = self.rows[-1]
        return {
            "kv_bytes": last.kv_bytes,
            "kv_bytes_predicted": last.predicted_bytes,
            "kv_bytes_per_token": last.kv_bytes / last.tokens,
            "kv_deviation_pct": max(abs(row.deviation_pct) for row in self.rows),
            "kv_over_prediction": max(row.kv_bytes / row.predicted_bytes for row in self.rows),
            "kv_entries": float(self.run.kv_entries),
            "peak_memory_bytes": max(row.peak_memory_bytes for row in self.rows),
            **growth_metric(self.run),
        }

    def findings(self) -> list[str]:
        """A violation when, at any length, the engine held far more than the policy allows."""
        over = [row for row in self.rows if row.not_applied]
        if not over:
            return []
        worst = max(over, key=lambda row: row.kv_bytes / row.predicted_bytes)
        at = ", ".join(str(row.tokens) for row in over)
        return [
            f"cap or window not applied: at {at} tokens the cache holds more than "
            f"{NOT_APPLIED_RATIO}x the prediction for {self.run.policy.describe()} "
            f"(worst: {format_size(worst.kv_bytes)} vs {format_size(worst.predicted_bytes)} "
            f"at {worst.tokens} tokens)"
        ]


def check_lengths(lengths: object) -> list[int]:
    """Distinct positive lengths in ascending order, or a clear error."""
    return ascending_counts(lengths, "lengths", 1, 1, "[512, 1024, 2048]")


def memory_result(
    run: StreamRun, lengths: Sequence[int], predict: Callable[[int], float]
) -> MemoryResult:
    """Rows for ``lengths`` from a run that sampled them; ``predict(n)`` gives predicted bytes."""
    rows = []
    for n in lengths:
        sample = run.sample(n)
        if "kv_bytes" not in sample.figures:
            raise KvguardError("this engine reports no kv_bytes figure; memory cannot be judged")
        rows.append(
            MemoryRow(
                tokens=n,
                held=sample.held,
                kv_bytes=sample.figures["kv_bytes"],
                predicted_bytes=predict(n),
                peak_memory_bytes=sample.figures.get("peak_memory_bytes", 0.0),
            )
        )
    return MemoryResult(run, rows)
