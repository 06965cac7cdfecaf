"""Scenario ``generate``: the engine's own generation entry point, past capacity.

A conversation of turns over the text: each turn appends ``prompt`` tokens (a user message, a
tool output) that the engine prefills ``prefill_step`` tokens per call, then ``reply`` tokens
are generated one at a time with the text's next token forced as the sampled one, so every
reply token is scored. mlx-lm runs ``generate_step`` with one prompt cache for the whole
conversation, as its generate and server do; llama.cpp runs its nearest equivalent (see
``LlamaCppEngine.converse``).

Reply tokens fed past the cap are scored against two runs of kvguard's own loop on the same
ids, at the same positions: the full cache (the baseline) and the same policy fed one token at
a time (the chunk gap: what the engine's batched prefill costs over its decode path).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines import ReportsShifts, check_served_chunk, engine_info
from pytest_kvguard.engines.conversation import plan_turns
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import Text, load_text
from pytest_kvguard.scenarios.base import (
    CAP,
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
    Param,
    Planned,
    RunRequest,
    Scenario,
    TextFeed,
)
from pytest_kvguard.scenarios.limits import (
    MAX_CHUNK_GAP_PCT,
    MAX_POST_EVICTION_PPL,
    MAX_PPL_INCREASE_PCT,
)
from pytest_kvguard.scenarios.stream import check_reaches_eviction
from pytest_kvguard.scenarios.validate import require_text_room

PROMPT = Param(
    "prompt",
    "int",
    64,
    "tokens each turn appends as a prompt (a message, a tool output); prefilled, not scored",
    minimum=1,
)
REPLY = Param(
    "reply",
    "int",
    16,
    "tokens generated per turn, the text's own tokens forced as the sampled ones; scored",
    minimum=1,
)
PREFILL_STEP = Param(
    "prefill_step",
    "int",
    2048,
    "prompt tokens per engine call: mlx-lm's prefill_step_size (its default, 2048); llama.cpp "
    "decodes at most min(this, 512, cap - sinks); llama_server prefills in its own 512-token "
    "batches",
    minimum=1,
)


@dataclass(frozen=True)
class GenerateSpec:
    policy: Policy
    tokens: int
    text: str
    prompt: int
    reply: int
    prefill_step: int
    served: bool = False
    """The engine has no decode loop of kvguard's (a server): no chunk gap is measured."""


@dataclass(frozen=True)
class GenerateDetail:
    turns: int
    """Turns the conversation took."""
    prefill_step: int


def streams_through(engine: str) -> bool:
    """Whether kvguard's own decode loop runs on the engine (a server has none)."""
    return "feed" in engine_info(engine).policies


def post_cap_ppl(nll: np.ndarray, scored: np.ndarray) -> float:
    """Perplexity over the positions in ``scored``."""
    return float(math.exp(float(nll[scored].mean()))) if scored.any() else math.nan


@dataclass(frozen=True)
class Generation:
    """One conversation through the engine's own generation entry point."""

    nll: np.ndarray
    """nll[i] scores token i + 1; NaN where nothing was scored (prompts)."""
    seconds: float
    shifts: tuple[tuple[int, int, int], ...] = ()
    """(n_keep, n_left, n_discard) of each context shift, where the engine logs them (a server
    kvguard started)."""


def generation(
    ctx: Context,
    engine_name: str,
    model: ModelRef,
    policy: Policy,
    text: Text,
    tokens: int,
    prompt: int,
    reply: int,
    prefill_step: int,
) -> tuple[Generation, bool]:
    """The conversation over the text's first ``tokens`` ids under ``policy``, run once per
    session (generate and sweep checks on a server share it); True if it ran now."""
    ids = ctx.token_ids(engine_name, model, text, tokens)
    turns = plan_turns(tokens, prompt, reply)
    engine = ctx.engine(engine_name, model)

    def converse() -> Generation:
        started = time.perf_counter()
        nll = engine.converse(policy, ids, turns, prefill_step)
        seconds = time.perf_counter() - started
        ctx.say(f"{engine_name} {model.name} {policy.describe()}: {len(turns)} turns generated "
                f"in {seconds:.1f} s")  # fmt: skip
        return Generation(
            nll, seconds, tuple(engine.last_shifts if isinstance(engine, ReportsShifts) else ())
        )

    key = ("generate", engine_name, model.resolve(), text.sha256, tokens, policy, prompt, reply,
           prefill_step)  # fmt: skip
    return ctx.memo(key, converse)


class GenerateScenario(Scenario[GenerateSpec]):
    name = "generate"
    summary = "the engine's own generate call past capacity: prompts prefilled, replies scored"
    params = (
        TOKENS, CAP, SINKS, POSITIONS, EVICT_STEP, PROMPT, REPLY, PREFILL_STEP, *KV_PRECISION,
        TEXT,
    )  # fmt: skip
    limits = (MAX_PPL_INCREASE_PCT, MAX_POST_EVICTION_PPL, MAX_CHUNK_GAP_PCT)
    engine_path = "generation"
    detail_type = GenerateDetail

    def build(self, fields: Fields) -> GenerateSpec:
        assert fields.policy is not None
        policy = fields.policy_of("policy", fields.policy)
        p = fields.params
        check_reaches_eviction(policy, p["tokens"])
        assert policy.cap is not None  # window, sink and engine_default all take one
        turn = p["prompt"] + p["reply"]
        # One turn over all the tokens (a prompt, then one long reply: llama-server's path past
        # capacity) scores its reply past the cap; otherwise a whole turn must lie past it.
        one_turn = turn >= p["tokens"]
        if one_turn and p["prompt"] >= policy.cap:
            raise KvguardError(
                f"the prompt ({p['prompt']} tokens) fills the cap {policy.cap}: the one reply "
                "would start past it, and the prompt's own eviction would go unscored",
                fix=f"lower params.prompt below the cap (e.g. {policy.cap // 8})",
                key="params.prompt",
            )
        if not one_turn and p["tokens"] < policy.cap + turn:
            raise KvguardError(
                f"tokens {p['tokens']} leave no whole turn ({p['prompt']} + {p['reply']} tokens) "
                f"past the cap {policy.cap}: no reply would be scored after an eviction",
                fix=f"raise tokens well past the cap (e.g. {policy.cap + 16 * turn})",
                key="params.tokens",
            )
        require_text_room(fields, p["tokens"], "params.tokens")
        return GenerateSpec(
            policy, p["tokens"], fields.text_name(), p["prompt"], p["reply"], p["prefill_step"],
            served=not streams_through(fields.engine),
        )  # fmt: skip

    def check_budgets(self, spec: GenerateSpec, budgets: Budgets) -> None:
        if spec.served:
            check_served_chunk(None, gap_budget=budgets.max_chunk_gap_pct is not None)

    def planned_runs(self, check: Check[GenerateSpec]) -> list[Planned]:
        spec = check.spec
        if spec.served:
            return []
        text = load_text(spec.text, check.base_dir)
        return [RunRequest(check.engine, check.model, p, TextFeed(text, spec.tokens))
                for p in (Policy("full"), spec.policy)]  # fmt: skip

    def run(self, ctx: Context, check: Check[GenerateSpec]) -> Measured:
        spec = check.spec
        text = load_text(spec.text, check.base_dir)

        def generated(policy: Policy) -> tuple[Generation, bool]:
            return generation(ctx, check.engine, check.model, policy, text, spec.tokens,
                              spec.prompt, spec.reply, spec.prefill_step)  # fmt: skip

        gen, gen_new = generated(spec.policy)
        nll, gen_seconds = gen.nll, gen.seconds
        full = Policy("full")
        if not spec.served:
            base_run, base_new = ctx.stream_run(check.engine, check.model, full, text,
                                                spec.tokens)  # fmt: skip
            base_nll, base_seconds = base_run.nll, base_run.seconds
            # generate takes no chunk: its policy is the one fed one token at a time by the loop.
            single_run, single_new = ctx.stream_run(check.engine, check.model, spec.policy, text,
                                                    spec.tokens)  # fmt: skip
            single_nll, single_seconds = single_run.nll, single_run.seconds
        else:
            # A server has no decode loop of kvguard's: its baseline is its own generation of
            # the same turns under a context that never fills; no chunk gap is measured.
            base, base_new = generated(full)
            base_nll, base_seconds = base.nll, base.seconds
            single_nll, single_seconds, single_new = None, 0.0, False
        # Reply tokens fed past the cap: nll[i] scores token i+1, fed after token i.
        cap = spec.policy.cap
        assert cap is not None
        positions = np.arange(len(nll))
        scored = ~np.isnan(nll) & (positions >= cap)
        post = post_cap_ppl(nll, scored)
        baseline = post_cap_ppl(base_nll, scored)
        single = math.nan if single_nll is None else post_cap_ppl(single_nll, scored)
        return Measured(
            policy=spec.policy.describe(),
            tokens=spec.tokens,
            text=text,
            metrics={
                "post_eviction_ppl": post,
                "baseline_post_eviction_ppl": baseline,
                "ppl_increase_pct": (post / baseline - 1.0) * 100.0,
                **(
                    {}
                    if spec.served
                    else {
                        "single_token_post_eviction_ppl": single,
                        "chunk_gap_pct": (post / single - 1.0) * 100.0,
                    }
                ),
                "scored_tokens": float(scored.sum()),
                **({"context_shifts": float(len(gen.shifts))} if gen.shifts else {}),
            },
            seconds={
                "generate": gen_seconds if gen_new else 0.0,
                "baseline": base_seconds if base_new else 0.0,
                "single_token": single_seconds if single_new else 0.0,
            },
            tokens_per_second=spec.tokens / gen_seconds if gen_seconds else math.inf,
            detail=GenerateDetail(
                turns=len(plan_turns(spec.tokens, spec.prompt, spec.reply)),
                prefill_step=spec.prefill_step,
            ),
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["turns", "scored", "base ppl", "1-token ppl", "ppl", "delta", "chunk gap"]
        lines = []
        for o in outcomes:
            m = o.metrics
            lines.append([[
                str(o.detail.turns), f"{m['scored_tokens']:.0f}",
                f"{m['baseline_post_eviction_ppl']:.2f}",
                f"{m['single_token_post_eviction_ppl']:.2f}" if "chunk_gap_pct" in m else "-",
                f"{m['post_eviction_ppl']:.2f}", f"{m['ppl_increase_pct']:+.1f}%",
                f"{m['chunk_gap_pct']:+.1f}%" if "chunk_gap_pct" in m else "-",
            ]])  # fmt: skip
        return headers, lines


SCENARIO = GenerateScenario()
