"""llama-cpp-python's speculative decoding, as apps call it: ``Llama(draft_model=
LlamaPromptLookupDecoding(...))`` and ``create_completion`` at temperature 0, against the same
``Llama`` settings without the draft.

llama-cpp-python has no draft-model path: its draft is prompt lookup (n-grams of the context
propose the next tokens). ``Llama.generate`` evaluates the sampled token and the drafts in one
batch, samples each position, and on the first mismatch removes the rest from the cache
(``kv_cache_seq_rm``) and goes on from the target's token. kvguard reads each sampled
position's logits through a ``logits_processor`` (which changes nothing) and what was drafted
through a ``LlamaPromptLookupDecoding`` subclass that only records its proposals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from pytest_kvguard.core.errors import EngineError, KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.llama_cpp.api_cache import context_size, swa_full_setting
from pytest_kvguard.engines.llama_cpp.context import UBATCH
from pytest_kvguard.engines.protocols import Decoded

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine

MAX_NGRAM = 2
"""LlamaPromptLookupDecoding's default n-gram size."""


class RecordedLookup(LlamaPromptLookupDecoding):
    """llama-cpp-python's prompt lookup, unchanged, keeping each proposal: (tokens in the
    context it was asked with, the tokens it proposed)."""

    def __init__(self, num_pred_tokens: int) -> None:
        super().__init__(max_ngram_size=MAX_NGRAM, num_pred_tokens=num_pred_tokens)
        self.proposals: list[tuple[int, list[int]]] = []

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        drafted = super().__call__(input_ids, **kwargs)
        self.proposals.append((len(input_ids), [int(t) for t in drafted]))
        return drafted


def recorder(
    tokens: list[int], logprobs: list[float], margins: list[float], runners_up: list[int]
) -> Callable[[Any, np.ndarray], np.ndarray]:
    """A ``logits_processor`` that records the greedy token of the logits it is given, its log
    probability, its margin over the second best and that second best, and returns the logits
    unchanged."""

    def record(input_ids: Any, scores: np.ndarray) -> np.ndarray:
        wide = scores.astype(np.float64)
        peak = wide.max()
        lp = wide - (peak + np.log(np.exp(wide - peak).sum()))
        second, best = (int(i) for i in np.argpartition(lp, -2)[-2:])
        if lp[second] > lp[best] or (lp[second] == lp[best] and second < best):
            best, second = second, best  # argmax's choice on a tie: the lower id
        tokens.append(best)
        logprobs.append(float(lp[best]))
        margins.append(float(lp[best] - lp[second]))
        runners_up.append(second)
        return scores

    return record


def rounds_of(
    proposals: Sequence[tuple[int, Sequence[int]]], prompt: int, emitted: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(first token index, drafted, accepted) of each proposal that was verified: a draft is
    accepted while it matches what the target sampled at its position."""
    rounds = []
    for context, drafted in proposals:
        start = context - prompt
        # Drafts past the last emitted token were never verified (the call had its tokens).
        verified = min(len(drafted), len(emitted) - start)
        if verified <= 0:
            continue
        accepted = 0
        while accepted < verified and drafted[accepted] == emitted[start + accepted]:
            accepted += 1
        rounds.append((start, verified, accepted))
    return rounds


class OracleDraft(LlamaDraftModel):
    """A draft that proposes what the plain path generated next: every draft is right, so
    what verification changes is the engine's own batch noise (``verification_noise``),
    measured at each phase of the batches against the tokens."""

    def __init__(
        self, prompt: int, tokens: Sequence[int], num_pred_tokens: int, phase: int = 0
    ) -> None:
        self.prompt = prompt
        self.tokens = list(tokens)
        self.num_pred_tokens = num_pred_tokens
        self.phase = phase
        """The first proposal is this many tokens short, so the batches fall elsewhere."""

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        start = len(input_ids) - self.prompt
        count = self.num_pred_tokens - (self.phase if start <= 1 else 0)
        return np.array(self.tokens[start : start + max(count, 0)], dtype=np.intc)


def _complete(
    engine: LlamaCppEngine, policy: Policy, prompt: Sequence[int], new_tokens: int,
    draft_model: LlamaDraftModel | None,
) -> tuple[list[int], list[float], list[float], float, list[int]]:  # fmt: skip
    """One ``create_completion`` at temperature 0 on a fresh ``Llama``: the sampled tokens,
    their log probabilities and top-2 margins, and the call's seconds."""
    from llama_cpp import Llama, LogitsProcessorList

    settings: dict[str, Any] = {
        "model_path": str(engine.model_path), "n_ctx": context_size(len(prompt) + new_tokens),
        "n_batch": UBATCH, "n_ubatch": UBATCH, "n_threads": engine.options.n_threads,
        "n_threads_batch": engine.options.n_threads, "n_gpu_layers": engine.options.n_gpu_layers,
        "verbose": False, "draft_model": draft_model,
        # llama-cpp-python 0.3.36 sizes its scores buffer by this argument (n_batch rows
        # without it) while a draft model makes it write every row: without it, a context
        # past n_batch tokens raises ValueError ("could not broadcast input array").
        "logits_all": draft_model is not None,
    }  # fmt: skip
    if swa_full_setting(policy) is not None:
        settings["swa_full"] = swa_full_setting(policy)
    try:
        llm = Llama(**settings)
    except (ValueError, RuntimeError) as exc:
        raise EngineError(f"llama_cpp.Llama could not load the model: {exc}") from None
    tokens: list[int] = []
    logprobs: list[float] = []
    margins: list[float] = []
    runners_up: list[int] = []
    started = time.perf_counter()
    try:
        record = recorder(tokens, logprobs, margins, runners_up)
        llm.create_completion(
            prompt=list(prompt), max_tokens=new_tokens, temperature=0.0,
            logits_processor=LogitsProcessorList([record]),
        )  # fmt: skip
        seconds = time.perf_counter() - started
        # The Llama holds what it evaluated: the prompt, then the tokens it sampled (the last
        # one may not be evaluated). They must be the ones recorded as sampled.
        held = [int(t) for t in llm.input_ids[len(prompt) : llm.n_tokens]]
    except ValueError as exc:
        raise EngineError(f"llama_cpp.Llama.create_completion failed: {exc}") from None
    finally:
        llm.close()
    # The last batch's drafts stay held past the last sampled token, and at it where the
    # target rejected one (the call ends before the Llama removes it).
    seen = min(len(held), len(tokens) - 1)
    if held[:seen] != tokens[:seen] or len(held) < len(tokens) - 1:
        unlike = next((i for i in range(seen) if held[i] != tokens[i]), seen)
        raise EngineError(
            f"the Llama holds {len(held)} tokens after its prompt where {len(tokens)} were "
            f"sampled, first unlike at {unlike}"
        )
    return tokens, logprobs, margins, seconds, runners_up


def speculate(
    engine: LlamaCppEngine,
    policy: Policy,
    prompt: Sequence[int],
    new_tokens: int,
    draft: str | None,
    num_draft: int,
    prefilled: int = 0,
) -> Decoded:
    """See ``protocols.Speculates.speculate``: one ``Llama`` per call, its cache as the
    policy says (``swa_full`` for Gemma 3's sliding layers), prompt and reply within
    ``n_ctx``."""
    if prefilled:
        raise KvguardError("llama-cpp-python's speculative path starts from its own prompt")
    if draft not in (None, "prompt_lookup"):
        raise KvguardError(f"llama-cpp-python has no draft '{draft}'", fix="use prompt_lookup")
    lookup = None if draft is None else RecordedLookup(num_draft)
    tokens, logprobs, margins, seconds, runners_up = _complete(
        engine, policy, prompt, new_tokens, lookup
    )
    return Decoded(
        tuple(tokens), np.array(logprobs), np.array(margins), runners_up=tuple(runners_up),
        rounds=() if lookup is None else tuple(rounds_of(lookup.proposals, len(prompt), tokens)),
        seconds=seconds,
    )  # fmt: skip


def verification_noise(
    engine: LlamaCppEngine, prompt: Sequence[int], plain: Decoded, num_draft: int
) -> tuple[float, float]:
    """See ``protocols.Speculates.verification_noise``: the same ``create_completion`` with
    a draft that proposes the plain tokens themselves, on the full cache. Where a near tie
    flips even so, the margin it flipped across is part of the noise."""
    lp_gap = margin_gap = 0.0
    for phase in range(num_draft + 1):
        oracle = OracleDraft(len(prompt), plain.tokens, num_draft, phase)
        tokens, logprobs, margins, _, _ = _complete(
            engine, Policy("full"), prompt, len(plain.tokens), oracle
        )
        n = min(len(tokens), len(plain.tokens))
        same = next((i for i in range(n) if tokens[i] != plain.tokens[i]), n)
        lp = np.abs(np.array(logprobs[:same]) - plain.logprobs[:same]).max(initial=0.0)
        margin = np.abs(np.array(margins[:same]) - plain.margins[:same]).max(initial=0.0)
        lp_gap, margin_gap = max(lp_gap, float(lp)), max(margin_gap, float(margin))
        if same < n:
            margin_gap = max(margin_gap, float(plain.margins[same]))
    return lp_gap, margin_gap
