"""Scenario ``stream``: feed a long text far past the cache's capacity and score every next token.

The score of token i+1 comes from the logits of feeding token i. Tokens fed after the first
eviction are "post-eviction"; the same split is applied to the baseline run on the same token
ids, so the delta compares like with like.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.core.errors import EngineRefusal, KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.core.scoring import perplexity
from pytest_kvguard.core.units import format_size
from pytest_kvguard.engines import check_chunk_gap_budget
from pytest_kvguard.inputs.architecture import load_arch
from pytest_kvguard.inputs.texts import Text, load_text
from pytest_kvguard.scenarios.base import (
    CAP,
    CHUNK,
    EVICT_STEP,
    KV_PRECISION,
    POSITIONS,
    SINKS,
    TEXT,
    TOKENS,
    Check,
    Context,
    Fields,
    Measured,
    Panel,
    Planned,
    RunRequest,
    Scenario,
    TextFeed,
)
from pytest_kvguard.scenarios.extras import (
    SINK_EXPLANATION_SCHEMA,
    explanation_panels,
    explanation_sections,
    kv_bytes_panels,
)
from pytest_kvguard.scenarios.feeding import StreamRun, growth_metric
from pytest_kvguard.scenarios.limits import (
    BOUNDED,
    MAX_CHUNK_GAP_PCT,
    MAX_KV_BYTES,
    MAX_KV_DEVIATION_PCT,
    MAX_KV_ENTRIES,
    MAX_PEAK_MEMORY_BYTES,
    MAX_POST_EVICTION_PPL,
    MAX_PPL_INCREASE_PCT,
)
from pytest_kvguard.scenarios.memory import NOT_APPLIED_RATIO, kv_bytes_predictor
from pytest_kvguard.scenarios.sink_explanation import explain_sinks
from pytest_kvguard.scenarios.validate import check_bounded_run, require_text_room

UNQUANTIZED = "unquantized"
"""The baseline that is the candidate's own policy at the engine's default KV precision: the
delta is then the cost of quantization alone."""


def quantization_findings(policy: Policy, metrics: dict[str, float]) -> list[str]:
    """Violations whatever the budgets: layers the engine left unquantized past
    ``quantized_kv_start`` (mlx-lm), or a cache far larger than its quantized prediction."""
    findings = []
    left = int(metrics.get("kv_layers_unquantized", 0))
    if left:
        findings.append(
            f"silently not quantized: the engine left {left} layer(s) at full precision "
            f"under {policy.describe()}"
        )
    predicted = metrics.get("kv_bytes_predicted")
    if predicted and metrics["kv_bytes"] > predicted * NOT_APPLIED_RATIO:
        findings.append(
            f"not quantized as asked: KV {format_size(metrics['kv_bytes'])} measured, "
            f"{format_size(predicted)} predicted for {policy.describe()}"
        )
    return findings


def check_reaches_eviction(policy: Policy, n_tokens: int) -> None:
    """Refuse a run that would never evict nor quantize: it would prove nothing."""
    if not policy.bounded:
        if policy.quantized:
            return  # a quantized full cache: what is judged is the precision, from token 0 on
        raise KvguardError(
            f"policy '{policy.kind}' never evicts, so the stream scenario has nothing to judge",
            fix="use a bounded policy (window, sink) as the candidate and full as the baseline, "
            "or quantize it (kv_bits on mlx, cache_type_k / cache_type_v on llama.cpp)",
            key="policy",
        )
    if policy.cap is None:
        return  # swa: the model's window decides; a run that never evicts is refused later
    if n_tokens <= policy.cap:
        raise KvguardError(
            f"tokens {n_tokens} <= cap {policy.cap}: eviction would never start",
            fix=f"raise tokens well past the cap (e.g. {policy.cap * 6}) or lower the cap",
            key="params.tokens",
        )


@dataclass(frozen=True)
class StreamResult:
    """A bounded candidate against its baseline on the same token ids, split at first eviction."""

    candidate: StreamRun
    baseline: StreamRun
    single_token: StreamRun | None = None
    """Where the candidate was fed in chunks: the same policy fed one token at a time."""

    @property
    def split(self) -> int:
        """First token fed after an eviction; where none happened, where the cap says it
        should. A quantized cache that never evicts splits where the first token scored from
        quantized keys and values is (never before token 1, so both sides hold a score)."""
        cand = self.candidate
        split = cand.first_eviction or cand.policy.cap
        if split is None and cand.quantized_from is not None:
            split = max(cand.quantized_from, 1)
        assert split is not None
        return split

    @property
    def metrics(self) -> dict[str, float]:
        """Every figure budgets can gate on, by metric name."""
        s = self.split
        cand, base = self.candidate.nll, self.baseline.nll
        post, base_post = perplexity(cand[s:]), perplexity(base[s:])
        return {
            "pre_eviction_ppl": perplexity(cand[:s]),
            "post_eviction_ppl": post,
            "baseline_pre_eviction_ppl": perplexity(base[:s]),
            "baseline_post_eviction_ppl": base_post,
            "ppl_increase_pct": (post / base_post - 1.0) * 100.0,
            "kv_entries": float(self.candidate.kv_entries),
            "evicted": float(self.candidate.evicted),
            "first_eviction": float(s),
            "post_eviction_tokens": float(len(cand) - s),
            **self.candidate.engine_figures,
            **growth_metric(self.candidate),
            **self.chunk_gap(),
        }

    def chunk_gap(self) -> dict[str, float]:
        """The chunked run's post-eviction perplexity against one token at a time, same split."""
        if self.single_token is None:
            return {}
        post = perplexity(self.candidate.nll[self.split :])
        single = perplexity(self.single_token.nll[self.split :])
        return {
            "single_token_post_eviction_ppl": single,
            "chunk_gap_pct": (post / single - 1.0) * 100.0,
        }


def single_token(policy: Policy) -> Policy | None:
    """The same policy fed one token at a time; None when ``policy`` already is."""
    return replace(policy, chunk=1) if policy.chunk > 1 else None


def compare(
    candidate: StreamRun, baseline: StreamRun, single: StreamRun | None = None
) -> StreamResult:
    # A capped policy that never evicted is a finding (the cap was not applied), not an error.
    if (
        candidate.first_eviction is None
        and candidate.policy.cap is None
        and candidate.quantized_from is None
    ):
        raise KvguardError(
            f"policy {candidate.policy.describe()} never evicted over {candidate.n_tokens} tokens",
            fix="raise tokens past the cap",
        )
    if candidate.n_tokens != baseline.n_tokens:
        raise ValueError("candidate and baseline must score the same token ids")
    return StreamResult(candidate, baseline, single)


@dataclass(frozen=True)
class StreamSpec:
    policy: Policy
    baseline: Policy
    """The policy the delta is measured against (default full)."""
    tokens: int
    text: str


@dataclass(frozen=True)
class StreamDetail:
    baseline: str
    """The baseline policy, as the table shows it."""
    layer_sizes: list[list[int]] = field(default_factory=list)
    """(tokens seen, entries held) per layer for the candidate, where the engine exposes it."""
    samples: list[dict[str, float]] = field(default_factory=list)
    """KV figures at the cap and at the end: tokens, held, kv_bytes, ..."""


class StreamScenario(Scenario[StreamSpec]):
    name = "stream"
    summary = "feed a long text far past the cache's capacity, score every next token"
    params = (TOKENS, CAP, SINKS, POSITIONS, EVICT_STEP, CHUNK, *KV_PRECISION, TEXT)
    limits = (
        MAX_PPL_INCREASE_PCT,
        MAX_POST_EVICTION_PPL,
        MAX_KV_ENTRIES,
        MAX_KV_BYTES,
        MAX_PEAK_MEMORY_BYTES,
        BOUNDED,
        MAX_KV_DEVIATION_PCT,
        MAX_CHUNK_GAP_PCT,
    )
    detail_type = StreamDetail
    takes_baseline = True
    footnote = (
        "ppl = perplexity over the tokens fed after the first eviction (a quantized full "
        "cache: after it was quantized); "
        "delta = candidate vs baseline on the same token ids."
    )

    def build(self, fields: Fields) -> StreamSpec:
        assert fields.policy is not None
        policy = fields.policy_of("policy", fields.policy)
        if fields.baseline == UNQUANTIZED:
            if not policy.quantized:
                raise KvguardError(
                    "baseline 'unquantized' is the candidate's policy at full precision, and "
                    "this check asks for no quantized cache",
                    fix="set kv_bits (mlx) or cache_type_k / cache_type_v (llama.cpp), or use "
                    "baseline: full",
                    key="baseline",
                )
            baseline = policy.unquantized()
        else:
            baseline = fields.policy_of("baseline", fields.baseline or "full")
        tokens: int = fields.params["tokens"]
        check_reaches_eviction(policy, tokens)
        if baseline == policy:
            raise KvguardError(
                f"baseline {baseline.describe()} is the candidate policy itself: the delta "
                "would be 0 whatever the engine does",
                fix="compare with baseline: full (the default)",
                key="baseline",
            )
        require_text_room(fields, tokens, "params.tokens")
        return StreamSpec(policy, baseline, tokens, fields.text_name())

    def check_budgets(self, spec: StreamSpec, budgets: Budgets) -> None:
        check_bounded_run(spec.policy, spec.tokens, budgets)
        if budgets.max_chunk_gap_pct is not None:
            check_chunk_gap_budget(spec.policy.chunk)

    explanation_schema = SINK_EXPLANATION_SCHEMA

    def explain(self, ctx: Context, check: Check[StreamSpec]) -> dict[str, Any] | None:
        """A window or sink policy that broke a budget: the sink heads it starves."""
        policy = check.spec.policy
        if policy.kind not in ("window", "sink"):
            return None
        return explain_sinks(ctx, check, int(policy.sinks))

    def report_sections(self, outcome: Any) -> list[tuple[str, str]]:
        return explanation_sections(outcome)

    def panels(self, outcome: Any) -> list[Panel]:
        return [*kv_bytes_panels(outcome), *explanation_panels(outcome)]

    def planned_runs(self, check: Check[StreamSpec]) -> list[Planned]:
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        policies = [spec.baseline, spec.policy, single_token(spec.policy)]
        return [
            RunRequest(check.engine, check.model, p, TextFeed(text, spec.tokens))
            for p in policies
            if p
        ]

    def run(self, ctx: Context, check: Check[StreamSpec]) -> Measured:
        """Run candidate and baseline on the same token ids."""
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        base_run, base_new = ctx.stream_run(check.engine, check.model, spec.baseline, text,
                                            spec.tokens)  # fmt: skip
        try:
            cand_run, cand_new = ctx.stream_run(check.engine, check.model, spec.policy, text,
                                                spec.tokens)  # fmt: skip
        except EngineRefusal as exc:
            ctx.say(f"{check.name}: {exc.message}")
            return self._refused(spec, text, base_run, exc.message)
        seconds = {
            "candidate": cand_run.seconds if cand_new else 0.0,
            "baseline": base_run.seconds if base_new else 0.0,
        }
        single_run = None
        one_at_a_time = single_token(spec.policy)
        if one_at_a_time is not None:
            single_run, single_new = ctx.stream_run(check.engine, check.model, one_at_a_time,
                                                    text, spec.tokens)  # fmt: skip
            seconds["single_token"] = single_run.seconds if single_new else 0.0
        result = compare(cand_run, base_run, single_run)
        metrics, findings = result.metrics, []
        if spec.policy.precision_set:
            # What a quantized cache saves is only believed against the prediction.
            predicted = self._predicted_kv_bytes(ctx, check, cand_run)
            if predicted is not None and "kv_bytes" in metrics:
                metrics["kv_bytes_predicted"] = predicted
                metrics["kv_deviation_pct"] = abs(metrics["kv_bytes"] / predicted - 1.0) * 100.0
            findings = quantization_findings(spec.policy, metrics)
        return Measured(
            policy=spec.policy.describe(),
            tokens=spec.tokens,
            text=text,
            findings=findings,
            metrics=metrics,
            seconds=seconds,
            tokens_per_second=cand_run.tokens_per_second,
            detail=StreamDetail(
                baseline=spec.baseline.describe(),
                layer_sizes=[list(sizes) for sizes in cand_run.layer_sizes],
                samples=[
                    {"tokens": s.tokens, "held": s.held, **s.figures} for s in cand_run.samples
                ],
            ),  # fmt: skip
        )

    def _predicted_kv_bytes(
        self, ctx: Context, check: Check[StreamSpec], run: StreamRun
    ) -> float | None:
        """The engine's KV-size prediction for the candidate at the end of its run (the memory
        scenario's); None where kvguard cannot read the model's architecture or the engine has
        no prediction."""
        try:
            predict = kv_bytes_predictor(
                check.engine, load_arch(check.model.resolve()), run.policy, run.n_tokens,
                [run.n_tokens], ctx.engine(check.engine, check.model).kv_element_bytes,
            )  # fmt: skip
            return predict(run.n_tokens)
        except KvguardError:
            return None

    def _refused(self, spec: StreamSpec, text: Text, base_run: StreamRun, refusal: str) -> Measured:
        """The engine refused the candidate's settings: the refusal is the check's finding,
        every figure it would have measured is NaN (a budget on one is broken, never met)."""
        gated = Budgets.gated_metrics(self.budgets)
        metrics = {name: math.nan for name in gated}
        metrics.update(
            engine_refused=1.0,
            baseline_post_eviction_ppl=perplexity(base_run.nll[spec.policy.cap or 1 :]),
            post_eviction_ppl=math.nan,
            ppl_increase_pct=math.nan,
        )
        return Measured(
            policy=spec.policy.describe(),
            tokens=spec.tokens,
            text=text,
            metrics=metrics,
            seconds={"baseline": 0.0},
            tokens_per_second=math.nan,
            detail=StreamDetail(baseline=spec.baseline.describe()),
            findings=[f"engine refused: {refusal}"],
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["tokens", "baseline", "base ppl", "ppl", "delta"]
        chunked = any("single_token_post_eviction_ppl" in o.metrics for o in outcomes)
        predicted = any("kv_bytes_predicted" in o.metrics for o in outcomes)
        if predicted:
            headers += ["KV", "predicted"]
        if chunked:
            headers += ["1-token ppl", "chunk gap"]
        lines = []
        for o in outcomes:
            m = o.metrics
            refused = bool(m.get("engine_refused"))
            row = [
                str(o.tokens), o.detail.baseline, f"{m['baseline_post_eviction_ppl']:.2f}",
                "refused" if refused else f"{m['post_eviction_ppl']:.2f}",
                "" if refused else f"{m['ppl_increase_pct']:+.1f}%",
            ]  # fmt: skip
            if predicted:
                has = "kv_bytes_predicted" in m
                row += [format_size(m["kv_bytes"]) if has else "",
                        format_size(m["kv_bytes_predicted"]) if has else ""]  # fmt: skip
            if chunked:
                gap = "single_token_post_eviction_ppl" in m
                row += [f"{m['single_token_post_eviction_ppl']:.2f}" if gap else "",
                        f"{m['chunk_gap_pct']:+.1f}%" if gap else ""]  # fmt: skip
            lines.append([row])
        return headers, lines


SCENARIO = StreamScenario()
