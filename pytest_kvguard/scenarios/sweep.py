"""Scenario ``sweep``: the same cap with 0, 1, 2, 4, 8 sinks, under each position handling.

Post-eviction perplexity against the number of sinks shows how much the first tokens matter
(sink size sweep); the same eviction with re-indexed and with absolute positions side by side
pins a failure on eviction or on position handling (position isolation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_kvguard.engines import check_policy
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.policies import Policy, make_policy
from pytest_kvguard.scenarios.base import (
    CAP,
    CHUNK,
    EVICT_STEP,
    TEXT,
    TOKENS,
    Check,
    Context,
    Fields,
    Measured,
    Param,
    Planned,
    RunRequest,
    Scenario,
    TextFeed,
    ascending_counts,
    require_text_room,
)
from pytest_kvguard.scenarios.stream import StreamResult, check_reaches_eviction, compare
from pytest_kvguard.texts import load_text

DEFAULT_SINKS = (0, 1, 2, 4, 8)


def sweep_policy(sinks: int, cap: int, positions: str, evict_step: int, chunk: int = 1) -> Policy:
    """0 sinks is a pure window; otherwise a sink policy, all under the same total cap."""
    kind = "window" if sinks == 0 else "sink"
    return make_policy(kind, cap=cap, sinks=sinks or None, positions=positions,
                       evict_step=evict_step, chunk=chunk)  # fmt: skip


def check_sinks(values: object, cap: int | None) -> tuple[int, ...]:
    """At least two distinct sink counts, ascending, each leaving room under the cap."""
    counts = ascending_counts(values, "sinks", 0, 2, "[0, 1, 2, 4, 8]")
    if cap is not None and counts[-1] >= cap - 1:
        raise KvguardError(
            f"{counts[-1]} sinks leave no room under cap {cap}",
            fix="raise cap or drop that count",
            key="params.sinks",
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
    """Every (positions, sinks) run."""

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


@dataclass(frozen=True)
class SweepSpec:
    sinks: tuple[int, ...]
    positions: tuple[str, ...]
    cap: int
    evict_step: int
    baseline: Policy
    tokens: int
    text: str
    chunk: int = 1

    def policies(self) -> list[tuple[str, int, Policy]]:
        return [(mode, count, sweep_policy(count, self.cap, mode, self.evict_step, self.chunk))
                for mode in self.positions for count in self.sinks]  # fmt: skip


@dataclass(frozen=True)
class SweepDetail:
    baseline: str
    baseline_ppl: float
    """The baseline's post-eviction perplexity (the split is the cap for every run)."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """One row per (positions, sinks) run: post_eviction_ppl, ppl_increase_pct, ..."""


SWEEP_SINKS = Param(
    "sinks",
    "ints",
    list(DEFAULT_SINKS),
    "the sink counts run under the same cap, ascending; 0 is a pure window",
    minimum=0,
)
SWEEP_POSITIONS = Param(
    "positions",
    "strs",
    None,
    "position handlings run side by side, e.g. [reindexed, absolute]; default: the engine's own",
)


class SweepScenario(Scenario[SweepSpec]):
    name = "sweep"
    summary = "one cap, 0/1/2/4/8 sinks, re-indexed and absolute positions side by side"
    params = (TOKENS, CAP, SWEEP_SINKS, SWEEP_POSITIONS, EVICT_STEP, CHUNK, TEXT)
    budgets = ("max_ppl_increase_pct", "max_post_eviction_ppl", "min_sink_gain_pct",
               "max_position_gap_pct")  # fmt: skip
    detail_type = SweepDetail
    takes_policy = False
    no_policy = (
        "a sweep chooses its policies (0 sinks: window; more: sink)",
        "remove 'policy'; list the sink counts in params.sinks",
    )
    takes_baseline = True

    def build(self, fields: Fields) -> SweepSpec:
        p = fields.params
        cap: int | None = p["cap"]
        if cap is None:
            raise KvguardError("a sweep needs a cap", fix="set params.cap, e.g. cap: 256",
                               key="params.cap")  # fmt: skip
        counts = check_sinks(p["sinks"], cap)
        modes = tuple(p["positions"] or [fields.positions()])
        if len(set(modes)) != len(modes):
            raise KvguardError(
                f"positions {list(modes)} names one handling twice: it would be compared "
                "with itself",
                fix=f"write positions: {list(dict.fromkeys(modes))}",
                key="params.positions",
            )
        spec = SweepSpec(counts, modes, cap, p["evict_step"],
                         fields.policy_of("baseline", fields.baseline or "full", with_params=False),
                         p["tokens"], fields.text_name(), p["chunk"])  # fmt: skip
        try:
            for _, _, policy in spec.policies():
                for engine in fields.engines:
                    check_policy(engine, policy, "stream")
            check_reaches_eviction(spec.policies()[-1][2], spec.tokens)
        except KvguardError as exc:
            raise exc.keyed("params.positions") from None
        require_text_room(fields, spec.tokens, "params.tokens")
        return spec

    def planned_runs(self, check: Check[SweepSpec]) -> list[Planned]:
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        policies = [spec.baseline, *(policy for _, _, policy in spec.policies())]
        return [
            RunRequest(check.engine, check.model, p, TextFeed(text, spec.tokens)) for p in policies
        ]

    def run(self, ctx: Context, check: Check[SweepSpec]) -> Measured:
        """Every sink count under every position handling, same cap, same token ids."""
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        base_run, base_new = ctx.stream_run(check.engine, check.model, spec.baseline, text,
                                            spec.tokens)  # fmt: skip
        rows, seconds = [], {"baseline": base_run.seconds if base_new else 0.0}
        for mode, count, policy in spec.policies():
            run, new = ctx.stream_run(check.engine, check.model, policy, text, spec.tokens)
            rows.append(SweepRow(mode, count, compare(run, base_run)))
            seconds[policy.describe()] = run.seconds if new else 0.0
        result = SweepResult(rows)
        metrics = result.metrics
        return Measured(
            policy=f"sinks {list(spec.sinks)}/{spec.cap} {'+'.join(spec.positions)}"
            + (f" chunk{spec.chunk}" if spec.chunk > 1 else ""),
            tokens=spec.tokens,
            text=text,
            metrics=metrics,
            seconds=seconds,
            tokens_per_second=base_run.tokens_per_second,
            detail=SweepDetail(
                baseline=spec.baseline.describe(),
                baseline_ppl=metrics["baseline_post_eviction_ppl"],
                samples=[row.to_json() for row in rows],
            ),
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        """One line per position handling: post-eviction ppl (delta) per sink count."""
        counts = sorted({s["sinks"] for o in outcomes for s in o.detail.samples})
        headers = ["positions", "full", *(f"S={c}" for c in counts)]
        lines = []
        for o in outcomes:
            rows = []
            for i, mode in enumerate(dict.fromkeys(s["positions"] for s in o.detail.samples)):
                by_count = {s["sinks"]: s for s in o.detail.samples if s["positions"] == mode}
                cells = [
                    f"{by_count[c]['post_eviction_ppl']:.2f} "
                    f"({by_count[c]['ppl_increase_pct']:+.1f}%)" if c in by_count else ""
                    for c in counts
                ]  # fmt: skip
                rows.append([mode, f"{o.detail.baseline_ppl:.2f}" if i == 0 else "", *cells])
            lines.append(rows)
        return headers, lines


SCENARIO = SweepScenario()
