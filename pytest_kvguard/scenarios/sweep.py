"""Scenario ``sweep``: the same cap with 0, 1, 2, 4, 8 sinks, under each position handling.

Post-eviction perplexity against the number of sinks shows how much the first tokens matter
(sink size sweep); the same eviction with re-indexed and with absolute positions side by side
pins a failure on eviction or on position handling (position isolation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytest_kvguard.errors import KvguardError
from pytest_kvguard.policies import Policy, make_policy
from pytest_kvguard.scenarios import ascending_counts
from pytest_kvguard.scenarios.stream import StreamResult

DEFAULT_SINKS = (0, 1, 2, 4, 8)


def sweep_policy(sinks: int, cap: int, positions: str, evict_step: int) -> Policy:
    """0 sinks is a pure window; otherwise a sink policy, all under the same total cap."""
    if sinks == 0:
        return make_policy("window", cap=cap, positions=positions, evict_step=evict_step)
    return make_policy("sink", cap=cap, sinks=sinks, positions=positions, evict_step=evict_step)


def check_sinks(values: object, cap: int | None) -> tuple[int, ...]:
    """At least two distinct sink counts, ascending, each leaving room under the cap."""
    counts = ascending_counts(values, "sinks", 0, 2, "[0, 1, 2, 4, 8]")
    if cap is not None and counts[-1] >= cap - 1:
        raise KvguardError(
            f"{counts[-1]} sinks leave no room under cap {cap}", fix="raise cap or drop that count"
        )
    return tuple(counts)


@dataclass(frozen=True)
class SweepRow:
    positions: str
    sinks: int
    result: StreamResult

    def to_json(self) -> dict[str, float | str]:
        m = self.result.metrics
        return {
            "positions": self.positions,
            "sinks": self.sinks,
            "post_eviction_ppl": m["post_eviction_ppl"],
            "ppl_increase_pct": m["ppl_increase_pct"],
            "baseline_post_eviction_ppl": m["baseline_post_eviction_ppl"],
            "kv_entries": m["kv_entries"],
            "first_eviction": m["first_eviction"],
        }


@dataclass(frozen=True)
class SweepResult:
    rows: list[SweepRow]
    """Every (positions, sinks) run; positions in the order asked, sinks ascending."""

    def ppl(self, positions: str, sinks: int) -> float:
        return next(
            r.result.metrics["post_eviction_ppl"]
            for r in self.rows
            if (r.positions, r.sinks) == (positions, sinks)
        )

    @property
    def metrics(self) -> dict[str, float]:
        """The largest sink count under the first position handling is the sweep's headline;
        sink_gain_pct compares no sinks with the best sink count; position_gap_pct the two
        position handlings at the same sink count (worst case)."""
        modes = list(dict.fromkeys(r.positions for r in self.rows))
        counts = sorted({r.sinks for r in self.rows})
        first = modes[0]
        headline = next(r for r in self.rows if (r.positions, r.sinks) == (first, counts[-1]))
        m = headline.result.metrics
        metrics = {
            "post_eviction_ppl": m["post_eviction_ppl"],
            "ppl_increase_pct": m["ppl_increase_pct"],
            "baseline_post_eviction_ppl": m["baseline_post_eviction_ppl"],
        }
        if counts[0] == 0:
            best = min(self.ppl(first, s) for s in counts[1:])
            metrics["sink_gain_pct"] = (self.ppl(first, 0) / best - 1.0) * 100.0
        if len(modes) > 1:
            metrics["position_gap_pct"] = max(
                abs(self.ppl(modes[1], s) / self.ppl(modes[0], s) - 1.0) * 100.0 for s in counts
            )
        return metrics


def sweep_rows(
    results: Sequence[tuple[str, int, StreamResult]],
) -> SweepResult:
    return SweepResult([SweepRow(p, s, r) for p, s, r in results])
