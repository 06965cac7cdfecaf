"""Scenario ``sweep``: the same cap with 0, 1, 2, 4, 8 sinks, under each position handling.

Post-eviction perplexity against the number of sinks shows how much the first tokens matter
(sink size sweep); the same eviction with re-indexed and with absolute positions side by side
pins a failure on eviction or on position handling (position isolation).

On a served engine (llama_server), which kvguard's own loop cannot feed, each sink count is the
server's own generation past capacity (see the ``generate`` scenario): a short prompt, then the
rest of the tokens generated with the text's own tokens forced, the server shifting its context
with ``n_keep`` = the sinks. Those runs are shared with generate checks of the same settings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytest_kvguard.core.budgets import Limit
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy, make_policy
from pytest_kvguard.engines import check_policy, check_served_chunk
from pytest_kvguard.inputs.texts import Text, load_text
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
    Panel,
    Param,
    Planned,
    RunRequest,
    Scenario,
    TextFeed,
)
from pytest_kvguard.scenarios.extras import (
    SINK_EXPLANATION_SCHEMA,
    explanation_panels,
    explanation_sections,
)
from pytest_kvguard.scenarios.generate import (
    PREFILL_STEP,
    Generation,
    generation,
    post_cap_ppl,
    streams_through,
)
from pytest_kvguard.scenarios.limits import MAX_POST_EVICTION_PPL, MAX_PPL_INCREASE_PCT
from pytest_kvguard.scenarios.sink_explanation import explain_sinks
from pytest_kvguard.scenarios.stream import StreamResult, check_reaches_eviction, compare
from pytest_kvguard.scenarios.validate import check_sinks, require_text_room

MIN_SINK_GAIN_PCT = Limit(
    "min_sink_gain_pct", "sink_gain_pct", "min", "%", "sink gain",
    "perplexity saved by sinks (no sinks vs the best sink count)",
    "sweep: post-eviction perplexity with 0 sinks over the best with sinks, minus 1, in %; an "
    "engine that ignores its sinks shows ~0.",
    span=(-100.0, math.inf),
)  # fmt: skip
MAX_POSITION_GAP_PCT = Limit(
    "max_position_gap_pct", "position_gap_pct", "max", "%", "pos gap",
    "largest perplexity gap between re-indexed and absolute positions",
    "sweep with positions [reindexed, absolute]: the largest |ppl ratio - 1| at one sink count, "
    "in %; a large gap pins a failure on position handling, not eviction.",
)  # fmt: skip

DEFAULT_SINKS = (0, 1, 2, 4, 8)
SERVED_PROMPT = 32
"""A served sweep's default prompt: llama.cpp prefills a batch of 64 tokens or more by another
path than its decode path (README, "prefill batch shape"); 32 keeps the prompt on the same one."""


def sweep_policy(sinks: int, cap: int, positions: str, evict_step: int, chunk: int = 1) -> Policy:
    """0 sinks is a pure window; otherwise a sink policy, all under the same total cap."""
    kind = "window" if sinks == 0 else "sink"
    return make_policy(kind, cap=cap, sinks=sinks or None, positions=positions,
                       evict_step=evict_step, chunk=chunk)  # fmt: skip


@dataclass(frozen=True)
class ServedResult:
    """One sink count through a server's own generation, against its full-context generation:
    the figures a stream result gives, from the server's context shifts."""

    candidate: Generation
    baseline: Generation
    cap: int

    @property
    def metrics(self) -> dict[str, float]:
        if not self.candidate.shifts:
            raise KvguardError(
                f"the server never shifted its context (cap {self.cap}): no token was scored "
                "after an eviction",
                fix="raise tokens well past the cap",
            )
        n_keep, n_left, _ = self.candidate.shifts[0]
        positions = np.arange(len(self.candidate.nll))
        # As in generate: generated tokens fed past the cap (nll[i] scores token i + 1).
        scored = ~np.isnan(self.candidate.nll) & (positions >= self.cap)
        post = post_cap_ppl(self.candidate.nll, scored)
        base = post_cap_ppl(self.baseline.nll, scored)
        return {
            "post_eviction_ppl": post,
            "ppl_increase_pct": (post / base - 1.0) * 100.0,
            "baseline_post_eviction_ppl": base,
            # The server shifts when its context holds n_keep + n_left tokens and one more
            # would not fit: that many are held, and the first shift comes after as many.
            "kv_entries": float(n_keep + n_left),
            "first_eviction": float(n_keep + n_left),
            "context_shifts": float(len(self.candidate.shifts)),
            "sinks_kept": float(n_keep),
        }


@dataclass(frozen=True)
class SweepRow:
    positions: str
    sinks: int
    result: StreamResult | ServedResult

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
            **{key: m[key] for key in ("context_shifts", "sinks_kept") if key in m},
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
    served_prompt: int | None = None
    """On a served engine: the prompt before the one generated reply; None: kvguard's loop."""

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

SWEEP_PROMPT = Param(
    "prompt",
    "int",
    None,
    "served engines (llama_server) only: tokens sent as the prompt before the one reply the "
    f"server generates past the cap; default {SERVED_PROMPT}",
    minimum=1,
)


class SweepScenario(Scenario[SweepSpec]):
    name = "sweep"
    summary = "one cap, 0/1/2/4/8 sinks, re-indexed and absolute positions side by side"
    params = (TOKENS, CAP, SWEEP_SINKS, SWEEP_POSITIONS, EVICT_STEP, CHUNK, SWEEP_PROMPT, TEXT)
    limits = (MAX_PPL_INCREASE_PCT, MAX_POST_EVICTION_PPL, MIN_SINK_GAIN_PCT, MAX_POSITION_GAP_PCT)
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
        served = not streams_through(fields.engine)
        if served and fields.baseline not in (None, "full"):
            raise KvguardError(
                f"a server's sweep is scored against its own full-context generation, not "
                f"'{fields.baseline}'",
                fix="remove baseline (full is the default)",
                key="baseline",
            )
        baseline = (
            Policy("full")  # the server's own generation under a context that never fills
            if served
            else fields.policy_of("baseline", fields.baseline or "full", with_params=False)
        )
        prompt = self._served_prompt(fields, cap) if served else None
        spec = SweepSpec(counts, modes, cap, p["evict_step"], baseline, p["tokens"],
                         fields.text_name(), p["chunk"], prompt)  # fmt: skip
        if not served and p["prompt"] is not None:
            raise KvguardError(
                f"engine {fields.engine} is fed and scored token by token by kvguard's own loop: "
                "a sweep on it has no prompt",
                fix="remove params.prompt: it applies to served engines such as llama_server",
                key="params.prompt",
            )
        try:
            for _, _, policy in spec.policies():
                for engine in fields.engines:
                    path = "generation" if served else "feed"
                    check_policy(engine, policy, path, fields.scenario)
            check_reaches_eviction(spec.policies()[-1][2], spec.tokens)
        except KvguardError as exc:
            raise exc.keyed("params.positions") from None
        require_text_room(fields, spec.tokens, "params.tokens")
        return spec

    @staticmethod
    def _served_prompt(fields: Fields, cap: int) -> int:
        """The prompt a server's sweep sends before its one generated reply."""
        check_served_chunk(fields.params["chunk"], fields.engine)
        prompt: int = fields.params["prompt"] or min(SERVED_PROMPT, cap // 2)
        if prompt >= cap:
            raise KvguardError(
                f"the prompt ({prompt} tokens) fills the cap {cap}: the server would shift "
                "before generating, and that shift would go unscored",
                fix=f"lower params.prompt below the cap (e.g. {min(SERVED_PROMPT, cap // 2)})",
                key="params.prompt",
            )
        if prompt >= fields.params["tokens"]:
            raise KvguardError(
                f"the prompt ({prompt} tokens) leaves nothing of tokens "
                f"{fields.params['tokens']} to generate",
                fix="raise tokens or lower params.prompt",
                key="params.prompt",
            )
        return prompt

    def planned_runs(self, check: Check[SweepSpec]) -> list[Planned]:
        spec = check.spec
        if spec.served_prompt is not None:
            return []  # a server generates; kvguard's loop decodes nothing for it
        text = load_text(spec.text, check.base_dir)
        policies = [spec.baseline, *(policy for _, _, policy in spec.policies())]
        return [
            RunRequest(check.engine, check.model, p, TextFeed(text, spec.tokens)) for p in policies
        ]

    def run(self, ctx: Context, check: Check[SweepSpec]) -> Measured:
        """Every sink count under every position handling, same cap, same token ids."""
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        if spec.served_prompt is not None:
            return self._run_served(ctx, check, spec.served_prompt)
        base_run, base_new = ctx.stream_run(check.engine, check.model, spec.baseline, text,
                                            spec.tokens)  # fmt: skip
        rows, seconds = [], {"baseline": base_run.seconds if base_new else 0.0}
        for mode, count, policy in spec.policies():
            run, new = ctx.stream_run(check.engine, check.model, policy, text, spec.tokens)
            rows.append(SweepRow(mode, count, compare(run, base_run)))
            seconds[policy.describe()] = run.seconds if new else 0.0
        return self._measured(spec, text, rows, seconds, base_run.tokens_per_second)

    def _run_served(self, ctx: Context, check: Check[SweepSpec], prompt: int) -> Measured:
        """Every sink count as the server's own generation past the cap, one request each."""
        spec = check.spec
        text = load_text(spec.text, check.base_dir)

        def generated(policy: Policy) -> tuple[Generation, bool]:
            return generation(ctx, check.engine, check.model, policy, text, spec.tokens, prompt,
                              spec.tokens - prompt, PREFILL_STEP.default)  # fmt: skip

        base, base_new = generated(spec.baseline)
        rows, seconds = [], {"baseline": base.seconds if base_new else 0.0}
        for mode, count, policy in spec.policies():
            try:
                run, new = generated(policy)
            except KvguardError as exc:
                if count != 0:
                    raise
                raise KvguardError(  # a model whose tokenizer adds a BOS: the server keeps it
                    f"{exc.message} (sink count 0 of this sweep)",
                    fix="drop 0 from params.sinks on this model: 1 sink is its BOS",
                    key="params.sinks",
                ) from None
            rows.append(SweepRow(mode, count, ServedResult(run, base, spec.cap)))
            seconds[policy.describe()] = run.seconds if new else 0.0
        return self._measured(spec, text, rows, seconds, spec.tokens / base.seconds)

    def _measured(
        self,
        spec: SweepSpec,
        text: Text,
        rows: list[SweepRow],
        seconds: dict[str, float],
        tokens_per_second: float,
    ) -> Measured:
        result = SweepResult(rows)
        metrics = result.metrics
        return Measured(
            policy=f"sinks {list(spec.sinks)}/{spec.cap} {'+'.join(spec.positions)}"
            + (f" chunk{spec.chunk}" if spec.chunk > 1 else ""),
            tokens=spec.tokens,
            text=text,
            metrics=metrics,
            seconds=seconds,
            tokens_per_second=tokens_per_second,
            detail=SweepDetail(
                baseline=spec.baseline.describe(),
                baseline_ppl=metrics["baseline_post_eviction_ppl"],
                samples=[row.to_json() for row in rows],
            ),
        )

    explanation_schema = SINK_EXPLANATION_SCHEMA

    def explain(self, ctx: Context, check: Check[SweepSpec]) -> dict[str, Any] | None:
        """A sweep that broke a budget: the sink heads its fewest sinks starve."""
        return explain_sinks(ctx, check, int(min(check.spec.sinks)))

    def report_sections(self, outcome: Any) -> list[tuple[str, str]]:
        return explanation_sections(outcome)

    def panels(self, outcome: Any) -> list[Panel]:
        """Post-eviction perplexity against sinks, a line per position handling (all sweeps
        on one axes), the full cache's as a dotted line; and the explanation's heads."""

        def draw(ax: Any) -> int:
            samples = outcome.detail.samples
            lines = 0
            for mode in dict.fromkeys(s["positions"] for s in samples):
                points = sorted((s["sinks"], s["post_eviction_ppl"]) for s in samples
                                if s["positions"] == mode)  # fmt: skip
                label = f"{outcome.model}, {outcome.engine}, {mode}"
                (line,) = ax.plot(*zip(*points, strict=True), marker="o", label=label)
                lines += 1
            ax.axhline(outcome.detail.baseline_ppl, linestyle=":", color=line.get_color(),
                       alpha=0.6)  # fmt: skip
            ax.set_xlabel("sinks (same total cap)")
            ax.set_ylabel("post-eviction perplexity (dotted: full cache)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
            return lines

        return [Panel("sink-sweep", "sweeps", draw, columns=1), *explanation_panels(outcome)]

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
