"""Scenario ``speculative``: the engine's own speculative decoding, greedy, must emit the
tokens its plain greedy decoding emits under the same cache policy, past the cap too.

A draft proposes tokens, the target verifies them in one batch, and rejected drafts are
trimmed from the cache: a cache that cannot trim (a full ``RotatingKVCache`` in mlx-lm) keeps
them, silently. Both paths run through the engine's public call on the same prompt (the
text's first ``prompt`` ids) for ``new_tokens`` tokens; kvguard compares the emitted tokens
and the log probabilities they were emitted with, and judges what differs against the
engine's own verification noise: the plain tokens verified in draft-sized batches on a full
cache (``Speculates.verification_noise``), where a batched pass may move a near tie.

No hollow pass: a row whose engine made no draft, or rejected none after the cap (nothing
was trimmed where trimming matters), is an error, not a pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_kvguard.core.budgets import Budgets, Limit
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines import Decoded, Speculates, engine_info
from pytest_kvguard.inputs.architecture import load_arch
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import load_text
from pytest_kvguard.scenarios.base import (
    CAP,
    SINKS,
    TEXT,
    Check,
    Context,
    Fields,
    Measured,
    Param,
    Scenario,
)
from pytest_kvguard.scenarios.limits import MAX_KV_ENTRIES
from pytest_kvguard.scenarios.validate import require_text_room

DRAFTS = {
    "gguf_q3_k": "mlx-lm, llama-server: the target's GGUF re-quantized to Q3_K_M by llama.cpp's "
    "quantizer, loaded as the target is (llama-server: --model-draft)",
    "gguf_q4_0": "mlx-lm, llama-server: the same at Q4_0 (fewer rejected drafts)",
    "mlx_q4": "mlx-lm: the target's weights quantized to 4 bits by mlx (nn.quantize, groups "
    "of 64); slow on CPU",
    "mlx_q3": "mlx-lm: the same at 3 bits",
    "prompt_lookup": "llama-cpp-python: LlamaPromptLookupDecoding (n-grams of the context "
    "propose the next tokens)",
}
"""The drafts a check may name; each engine takes those its adapter lists
(``EngineInfo.speculative_drafts``), its first by default."""

NOISE_TOLERANCE = 2.0
"""How many times the engine's measured verification noise a difference may reach and still
count as noise. The noise is the largest change over the plain tokens verified at every
phase of (num_draft + 1)-token batches; a draft path's batches fall in other arrangements
(a rejection ends one early), where a near tie may move a little more. Measured (llama.cpp
0.3.36, Gemma 3 270M Q4_K, 480-token prompt, 200 tokens, prompt lookup): noise 0.21 nats of
top-2 margin, prompt lookup flips a 0.29-nat tie at token 47 on swa and swa_full alike (a full
cache: not the trim). A stale cache moves them by far more (mlx-lm past its cap: 0.64 nats of
log probability against a noise of 1e-5)."""

PROMPT = Param("prompt", "int", 160, "prompt ids (the text's first) the calls start from",
               minimum=2)  # fmt: skip
NEW_TOKENS = Param("new_tokens", "int", 200, "greedy tokens each path generates", minimum=2)
DRAFT = Param(
    "draft", "str", None,
    "the draft: " + "; ".join(f"{k} ({v})" for k, v in DRAFTS.items()) + "; default: the "
    "engine's first",
)  # fmt: skip
NUM_DRAFT = Param(
    "num_draft", "int", 3,
    "tokens drafted per verification round (mlx-lm's num_draft_tokens, prompt lookup's "
    "num_pred_tokens)",
    minimum=1,
)  # fmt: skip
PREFILLED = Param(
    "prefilled", "int", 0,
    "prompt ids already in the cache when the call starts (a chat's earlier turns; engines "
    "whose speculative call takes a prompt cache): past the cap, the cache is full before "
    "the first draft",
    minimum=0,
)  # fmt: skip

MAX_DIVERGENT_TOKENS = Limit(
    "max_divergent_tokens", "divergent_tokens_past_noise", "max", " tokens", "diverged",
    "tokens the draft path emitted unlike plain greedy decoding",
    "speculative: tokens the draft path emits unlike the plain path from the first divergence "
    "on; not counted where the draft path emitted the plain path's runner-up and the plain "
    "path's top-2 margin there is within NOISE_TOLERANCE (2) times the engine's measured "
    "verification noise (a near tie a batched pass flips: reported).",
)  # fmt: skip
MAX_LOGPROB_GAP_EXCESS = Limit(
    "max_logprob_gap_excess", "logprob_gap_excess", "max", " nats", "lp gap",
    "log-probability gap of the emitted tokens beyond the engine's noise",
    "speculative: the largest |log p| difference of the tokens both paths emitted before any "
    "divergence, minus NOISE_TOLERANCE (2) times the engine's measured verification noise; "
    "0 asks for nothing beyond the noise.",
    span=(-math.inf, math.inf),
)  # fmt: skip


@dataclass(frozen=True)
class SpeculativeSpec:
    policy: Policy
    text: str
    prompt: int
    new_tokens: int
    draft: str
    num_draft: int
    prefilled: int


@dataclass(frozen=True)
class SpeculativeDetail:
    cap: int | None
    """The context length where the policy's cache is full (its cap, or the model's sliding
    window); None where it never fills."""
    draft: str
    num_draft: int
    first_divergence: int | None
    """Context length (prompt + tokens emitted) at the first token the paths disagree on."""
    refused: str | None
    """The engine refused the speculative call (its error)."""
    plain_tokens_per_second: float
    spec_tokens_per_second: float


def cache_fills_at(policy: Policy, model: ModelRef) -> int | None:
    """Context length at which the policy's cache is full: its cap, or for a sliding-window
    policy the model's window; None for a cache that keeps everything."""
    if policy.cap is not None:
        return policy.cap
    if policy.kind == "swa":
        return load_arch(model.resolve()).sliding_window
    return None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the two token lists differ (a missing token differs)."""
    n = min(len(a), len(b))
    at = next((i for i in range(n) if a[i] != b[i]), n)
    return None if at == n and len(a) == len(b) else at


class SpeculativeScenario(Scenario[SpeculativeSpec]):
    name = "speculative"
    summary = "the engine's speculative decoding against its plain greedy decoding, past the cap"
    params = (PROMPT, NEW_TOKENS, CAP, SINKS, DRAFT, NUM_DRAFT, PREFILLED, TEXT)
    limits = (MAX_DIVERGENT_TOKENS, MAX_LOGPROB_GAP_EXCESS, MAX_KV_ENTRIES)
    engine_path = "draft_decoding"
    detail_type = SpeculativeDetail
    footnote = (
        "speculative: 1st diverge is the context length where the draft path first emitted "
        "another token than plain greedy decoding; margin/noise: the plain path's top-2 margin "
        "there against the engine's verification noise (nats); refused: the engine raised "
        "rather than decode from a cache it cannot trim."
    )

    def build(self, fields: Fields) -> SpeculativeSpec:
        assert fields.policy is not None
        policy = fields.policy_of("policy", fields.policy)
        p = fields.params
        info = engine_info(fields.engine)
        drafts = info.speculative_drafts
        draft = p["draft"] or drafts[0]
        if draft not in drafts:
            raise KvguardError(
                f"engine '{fields.engine}' has no draft '{draft}'",
                fix="use draft: " + " or ".join(drafts), key="params.draft",
            )  # fmt: skip
        if p["prefilled"] and not info.speculative_prefilled:
            raise KvguardError(
                f"engine '{fields.engine}''s speculative call starts from its own prompt, not "
                "from a cache that holds one", fix="leave params.prefilled out",
                key="params.prefilled",
            )  # fmt: skip
        if p["prefilled"] >= p["prompt"]:
            raise KvguardError(
                f"prefilled {p['prefilled']} leaves no prompt for the call",
                fix=f"keep it below params.prompt ({p['prompt']})", key="params.prefilled",
            )  # fmt: skip
        if policy.cap is not None and p["prompt"] + p["new_tokens"] <= policy.cap:
            raise KvguardError(
                f"prompt {p['prompt']} + new_tokens {p['new_tokens']} never fill the cap "
                f"{policy.cap}: nothing past capacity would be judged",
                fix=f"raise new_tokens to at least {policy.cap - p['prompt'] + 64}",
                key="params.new_tokens",
            )  # fmt: skip
        require_text_room(fields, p["prompt"], "params.prompt")
        return SpeculativeSpec(
            policy, fields.text_name(), p["prompt"], p["new_tokens"], draft, p["num_draft"],
            p["prefilled"],
        )  # fmt: skip

    def check_budgets(self, spec: SpeculativeSpec, budgets: Budgets) -> None:
        if budgets.max_kv_entries is not None and spec.policy.kind == "full":
            raise KvguardError(
                "max_kv_entries on the full policy bounds nothing a draft path changes",
                fix="judge max_kv_entries on a capped policy", key="budgets.max_kv_entries",
            )  # fmt: skip

    def run(self, ctx: Context, check: Check[SpeculativeSpec]) -> Measured:
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        engine = ctx.engine(check.engine, check.model)
        if not isinstance(engine, Speculates):
            raise KvguardError(f"engine '{check.engine}' has no speculative path")
        prompt = ctx.token_ids(check.engine, check.model, text, spec.prompt)
        base = (check.engine, check.model.resolve(), text.sha256, spec.prompt, spec.new_tokens,
                spec.prefilled)  # fmt: skip

        def decoded(draft: str | None) -> Decoded:
            def call() -> Decoded:
                assert isinstance(engine, Speculates)
                result = engine.speculate(spec.policy, prompt, spec.new_tokens, draft,
                                          spec.num_draft, spec.prefilled)  # fmt: skip
                what = "plain greedy" if draft is None else f"speculative ({draft})"
                ctx.say(f"{check.engine} {check.model.name} {spec.policy.describe()}: {what}, "
                        f"{len(result.tokens)} tokens in {result.seconds:.1f} s")  # fmt: skip
                return result

            key = ("speculative", *base, spec.policy, draft, spec.num_draft if draft else 0)
            return ctx.memo(key, call)[0]

        fills = cache_fills_at(spec.policy, check.model)
        if fills is not None and spec.prompt + spec.new_tokens <= fills:
            raise KvguardError(
                f"prompt {spec.prompt} + new_tokens {spec.new_tokens} never fill the model's "
                f"sliding window ({fills} tokens): nothing past it would be judged",
                fix=f"raise new_tokens to at least {fills - spec.prompt + 64}",
            )
        plain = decoded(None)
        spec_run = decoded(spec.draft)
        if spec_run.refused is not None:
            if not spec.prefilled or plain.refused is not None:
                raise KvguardError(f"{check.engine} refused the speculative call: "
                                   f"{spec_run.refused}")  # fmt: skip
            return self._refused(spec, text, fills, plain, spec_run)
        self._require_drafts(check.engine, spec, fills, spec_run)

        def noise() -> tuple[float, float]:
            assert isinstance(engine, Speculates)
            started = time.perf_counter()
            measured = engine.verification_noise(prompt, decoded_full(), spec.num_draft)
            ctx.say(f"{check.engine} {check.model.name}: verification noise {measured[0]:.2g} "
                    f"nats (log p), {measured[1]:.2g} (margin), measured in "
                    f"{time.perf_counter() - started:.1f} s")  # fmt: skip
            return measured

        def decoded_full() -> Decoded:
            return ctx.memo(("speculative", *base[:-1], 0, Policy("full"), None, 0),
                            lambda: engine.speculate(Policy("full"), prompt, spec.new_tokens,
                                                     None, spec.num_draft))[0]  # fmt: skip

        lp_noise, margin_noise = ctx.memo(("speculative-noise", *base[:-1], spec.num_draft),
                                          noise)[0]  # fmt: skip
        return self._measured(spec, text, fills, plain, spec_run, lp_noise, margin_noise)

    def _require_drafts(
        self, engine: str, spec: SpeculativeSpec, fills: int | None, run: Decoded
    ) -> None:
        """No hollow pass: drafts made, and one rejected after the cache filled."""
        drafted = sum(r[1] for r in run.rounds)
        if drafted == 0:
            raise KvguardError(
                f"{engine} made no draft in {len(run.tokens)} tokens: speculation was off, so "
                "nothing was judged",
                fix="use another draft or prompt, or check the engine's log for why it "
                "turned speculation off",
            )
        past = 0 if fills is None else fills - spec.prompt
        rejected = [r for r in run.rounds if r[0] >= past and r[2] < r[1]]
        if not rejected:
            where = "after the cache filled" if fills is not None else "at all"
            raise KvguardError(
                f"{engine} rejected no draft {where} ({drafted} drafted): no trim was "
                "exercised where it matters, so nothing was judged",
                fix="raise new_tokens or num_draft, or use a draft that disagrees more "
                "(gguf_q3_k, mlx_q3)",
            )

    def _refused(
        self, spec: SpeculativeSpec, text: Any, fills: int | None, plain: Decoded,
        run: Decoded,
    ) -> Measured:  # fmt: skip
        """The engine refused a cache it cannot trim, loudly: nothing diverged."""
        return Measured(
            policy=spec.policy.describe(), tokens=spec.prompt + spec.new_tokens, text=text,
            metrics={"divergent_tokens_past_noise": 0.0, "judged_tokens": 0.0, "refused": 1.0},
            seconds={"plain": plain.seconds, "speculative": run.seconds},
            tokens_per_second=len(plain.tokens) / plain.seconds if plain.seconds else math.inf,
            detail=SpeculativeDetail(fills, spec.draft, spec.num_draft, None, run.refused,
                                     _rate(plain), 0.0),
        )  # fmt: skip

    def _measured(
        self, spec: SpeculativeSpec, text: Any, fills: int | None, plain: Decoded,
        run: Decoded, lp_noise: float, margin_noise: float,
    ) -> Measured:  # fmt: skip
        at = first_difference(plain.tokens, run.tokens)
        same = len(run.tokens) if at is None else at
        gaps = np.abs(plain.logprobs[:same] - run.logprobs[:same])
        # An engine that reports no log p for some emitted tokens (llama-server's verified
        # drafts) has no gap to judge: the figure is left out, and a budget on it is refused.
        gap = None if np.isnan(gaps).any() else float(gaps.max(initial=0.0))
        divergent = 0 if at is None else sum(
            1 for i in range(at, max(len(plain.tokens), len(run.tokens)))
            if i >= min(len(plain.tokens), len(run.tokens)) or plain.tokens[i] != run.tokens[i]
        )  # fmt: skip
        margin = math.nan if at is None or at >= len(plain.margins) else float(plain.margins[at])
        # A divergence counts unless it is a near tie flipped: the draft path emitted the plain
        # path's runner-up, and the two were closer than the engine's own noise moves them.
        flipped = (
            at is not None
            and at < len(run.tokens)
            and (plain.runners_up is None or plain.runners_up[at] == run.tokens[at])
        )
        near_tie = flipped and margin <= NOISE_TOLERANCE * margin_noise
        counted = divergent if at is not None and not near_tie else 0
        # Past an uncounted divergence the paths decode different texts: nothing is compared.
        judged = at if at is not None and near_tie else len(run.tokens)
        drafted = sum(r[1] for r in run.rounds)
        accepted = sum(r[2] for r in run.rounds)
        past = 0 if fills is None else fills - spec.prompt
        rejections = sum(1 for r in run.rounds if past <= r[0] < judged and r[2] < r[1])
        if rejections == 0:
            raise KvguardError(
                f"the paths parted at a near tie at {spec.prompt + judged} (margin {margin:.3g} "
                f"nats, noise {margin_noise:.2g}) before any draft was rejected after the cache "
                "filled: nothing past the cap was judged",
                fix="use another prompt or num_draft, or a draft that disagrees more (gguf_q3_k)",
            )
        metrics = {
            "divergent_tokens_past_noise": float(counted),
            "divergent_tokens": float(divergent),
            "first_divergence_past_cap": math.nan if at is None or fills is None
            else float(spec.prompt + at - fills),
            "divergence_margin": margin,
            **({} if gap is None else {"logprob_gap": gap,
                                       "logprob_gap_excess": gap - NOISE_TOLERANCE * lp_noise}),
            "noise_logprob": lp_noise,
            "noise_margin": margin_noise,
            "drafted": float(drafted),
            "accepted": float(accepted),
            "acceptance_pct": 100.0 * accepted / drafted if drafted else math.nan,
            "rejections_past_cap": float(rejections),
            "judged_tokens": float(judged),
            "refused": 0.0,
        }  # fmt: skip
        if run.held is not None:
            metrics["kv_entries"] = float(run.held)
        return Measured(
            policy=spec.policy.describe(), tokens=spec.prompt + spec.new_tokens, text=text,
            metrics=metrics,
            seconds={"plain": plain.seconds, "speculative": run.seconds},
            tokens_per_second=_rate(run),
            detail=SpeculativeDetail(
                fills, spec.draft, spec.num_draft, None if at is None else spec.prompt + at,
                None, _rate(plain), _rate(run),
            ),
        )  # fmt: skip

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["draft", "fills at", "drafted/accepted", "rej. past cap", "1st diverge",
                   "margin/noise", "lp gap/noise", "tok/s plain/spec"]  # fmt: skip
        lines = []
        for o in outcomes:
            m, d = o.metrics, o.detail
            fills = "-" if d.cap is None else str(d.cap)
            if d.refused is not None:
                lines.append([[f"{d.draft} x{d.num_draft}", fills, "refused", "-", "-", "-",
                               "-", f"{d.plain_tokens_per_second:.1f}/-"]])  # fmt: skip
                continue
            lines.append([[
                f"{d.draft} x{d.num_draft}", fills,
                f"{m['drafted']:.0f}/{m['accepted']:.0f} ({m['acceptance_pct']:.0f}%)",
                f"{m['rejections_past_cap']:.0f}",
                "none" if d.first_divergence is None
                else f"{d.first_divergence} ({m['divergent_tokens']:.0f} tok)",
                "-" if d.first_divergence is None
                else f"{m['divergence_margin']:.3g}/{m['noise_margin']:.2g}",
                f"{m['logprob_gap']:.2g}/{m['noise_logprob']:.2g}" if "logprob_gap" in m
                else f"n/a/{m['noise_logprob']:.2g}",
                f"{d.plain_tokens_per_second:.1f}/{d.spec_tokens_per_second:.1f}",
            ]])  # fmt: skip
        return headers, lines


def _rate(run: Decoded) -> float:
    return len(run.tokens) / run.seconds if run.seconds else 0.0


SCENARIO = SpeculativeScenario()
