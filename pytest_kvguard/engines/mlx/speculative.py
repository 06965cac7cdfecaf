"""mlx-lm's speculative decoding, as its ``stream_generate(draft_model=...)`` runs it:
``speculative_generate_step`` over one ``prompt_cache`` list (the target's layers, then the
draft's), greedy, against ``generate_step`` on the same policy without the draft.

kvguard's GGUF-loaded models have no mlx-lm tokenizer, so the calls get token ids (what
``stream_generate`` hands them after tokenizing). The draft is the target's own weights at
lower precision: re-quantized by llama.cpp's quantizer and loaded as the target is
(dequantized to float32, so it decodes as fast as the target on CPU), or quantized by mlx
(``nn.quantize``; mlx's quantized matmul on CPU decodes about 3 times slower than float32).
It agrees with the target often, not always, so some drafts are rejected and
``trim_prompt_cache`` has work to do.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from pytest_kvguard.core.errors import EngineError, KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.mlx.caches import cache_size, eval_caches, make_caches
from pytest_kvguard.engines.protocols import Decoded

if TYPE_CHECKING:
    from pytest_kvguard.engines.mlx.engine import MlxEngine

MLX_DRAFT_BITS = {"mlx_q3": 3, "mlx_q4": 4}
"""mlx quantizations of the target a draft may be: bits per weight, in groups of 64."""
PREFILL_STEP = 2048
"""prefill_step_size as mlx-lm's generate passes it by default."""


def draft_model(engine: MlxEngine, draft: str) -> Any:
    """The draft model: the target's GGUF re-quantized by llama.cpp and loaded as the target
    is, or its weights loaded again and quantized by mlx (kept on the engine: one per draft
    kind per worker)."""
    import mlx.nn as nn

    from pytest_kvguard.engines.gguf_quantize import GGUF_DRAFT_TYPES, requantized
    from pytest_kvguard.engines.mlx.gguf import load_gguf_model

    if draft not in (*MLX_DRAFT_BITS, *GGUF_DRAFT_TYPES):
        known = [*GGUF_DRAFT_TYPES, *MLX_DRAFT_BITS]
        raise KvguardError(f"mlx has no draft '{draft}'", fix="use one of " + ", ".join(known))
    drafts: dict[str, Any] = engine.__dict__.setdefault("_drafts", {})
    if draft not in drafts:
        if draft in GGUF_DRAFT_TYPES:
            if not engine.model_path.is_file():
                raise KvguardError(
                    f"draft {draft} re-quantizes a GGUF file; this model is a folder",
                    fix="use draft: " + " or ".join(MLX_DRAFT_BITS),
                )
            source = requantized(engine.model_path, GGUF_DRAFT_TYPES[draft])
            drafts[draft] = load_gguf_model(source)[0]
        else:
            model = engine.load_weights_again()
            nn.quantize(model, group_size=64, bits=MLX_DRAFT_BITS[draft])
            drafts[draft] = model
    return drafts[draft]


def _prefill(model: Any, caches: list[Any], ids: Sequence[int]) -> None:
    """Feed ids through the model into its caches in mlx-lm's prefill steps (what an earlier
    turn of a chat left in a prompt cache)."""
    for start in range(0, len(ids), PREFILL_STEP):
        model(mx.array(list(ids[start : start + PREFILL_STEP]))[None], cache=caches)
        eval_caches(caches)


def rounds_of(flags: Sequence[bool], new_tokens: int, num_draft: int) -> list[tuple[int, int, int]]:
    """The verification rounds behind speculative_generate_step's ``from_draft`` flags: each
    round drafts min(num_draft, tokens still to make), yields the drafts the target accepted
    (flag True), then the target's own token (False) unless the call's tokens are all made."""
    rounds = []
    i = 0
    while i < len(flags):
        start, drafted, accepted = i, min(num_draft, new_tokens - i), 0
        while accepted < drafted and i < len(flags) and flags[i]:
            accepted += 1
            i += 1
        if i < len(flags) and not flags[i]:
            i += 1
        rounds.append((start, drafted, accepted))
    return rounds


def runner_up(logprobs: np.ndarray, best: int) -> int:
    """The second-best token: the best of the others."""
    two = np.argpartition(logprobs, -2)[-2:]
    return int(two[0] if int(two[1]) == best else two[1])


def speculate(
    engine: MlxEngine,
    policy: Policy,
    prompt: Sequence[int],
    new_tokens: int,
    draft: str | None,
    num_draft: int,
    prefilled: int = 0,
) -> Decoded:
    """See ``protocols.Speculates.speculate``: mlx-lm's plain ``generate_step`` (draft None)
    or its ``speculative_generate_step``, greedy, one prompt cache list of the policy."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    caches = make_caches(engine.model, policy)
    drafter = None if draft is None else draft_model(engine, draft)
    draft_caches = [] if drafter is None else make_caches(drafter, policy)
    if prefilled:
        _prefill(engine.model, caches, prompt[:prefilled])
        if drafter is not None:
            _prefill(drafter, draft_caches, prompt[:prefilled])
    rest = mx.array(list(prompt[prefilled:]))
    started = time.perf_counter()
    steps: Iterator[tuple[Any, Any, bool]]
    if drafter is None:
        steps = (
            (token, logprobs, False)
            for token, logprobs in generate_step(
                rest, engine.model, prompt_cache=caches, max_tokens=new_tokens,
                prefill_step_size=PREFILL_STEP,
            )
        )  # fmt: skip
    else:
        steps = speculative_generate_step(
            rest, engine.model, drafter, prompt_cache=caches + draft_caches,
            num_draft_tokens=num_draft, max_tokens=new_tokens, prefill_step_size=PREFILL_STEP,
        )  # fmt: skip
    tokens: list[int] = []
    logprobs: list[float] = []
    margins: list[float] = []
    seconds_best: list[int] = []
    flags: list[bool] = []
    try:
        for token, vector, from_draft in steps:
            lp = np.array(vector.astype(mx.float32)).reshape(-1)
            token_id = int(token.item() if hasattr(token, "item") else token)
            second = runner_up(lp, token_id)
            tokens.append(token_id)
            logprobs.append(float(lp[token_id]))
            margins.append(float(lp[token_id] - lp[second]))
            seconds_best.append(second)
            flags.append(bool(from_draft))
    except ValueError as exc:
        # mlx-lm (from 0.31.2) refuses a cache it cannot trim before it generates anything:
        # said, not hidden. Any other error is the engine failing.
        if tokens or "trimmable" not in str(exc):
            raise EngineError(f"mlx-lm failed after {len(tokens)} tokens: {exc}") from None
        return Decoded((), np.zeros(0), np.zeros(0), refused=f"ValueError: {exc}",
                       seconds=time.perf_counter() - started)  # fmt: skip
    seconds = time.perf_counter() - started
    return Decoded(
        tuple(tokens), np.array(logprobs), np.array(margins), runners_up=tuple(seconds_best),
        rounds=tuple(rounds_of(flags, new_tokens, num_draft)) if drafter is not None else (),
        seconds=seconds, held=max(cache_size(c) for c in caches),
    )  # fmt: skip


NOISE_TOKENS = 32
"""Plain tokens the verification noise is measured over (the noise is the kernels', not the
length's: a few verification batches show it)."""


def _logprobs(logits: Any) -> np.ndarray:
    wide = np.array(logits.astype(mx.float32), dtype=np.float64).reshape(-1, logits.shape[-1])
    wide -= wide.max(axis=1, keepdims=True)
    result: np.ndarray = wide - np.log(np.exp(wide).sum(axis=1, keepdims=True))
    return result


def verification_noise(
    engine: MlxEngine, prompt: Sequence[int], plain: Decoded, num_draft: int
) -> tuple[float, float]:
    """See ``protocols.Speculates.verification_noise``. The model is called as mlx-lm's
    generate paths call it, on ``KVCache`` layers: the prompt but its last token prefilled,
    then the last prompt token and the plain tokens one per call (``generate_step``) or
    ``num_draft + 1`` per call (``speculative_generate_step``'s verification), at every phase
    of those batches (the first one 0 to ``num_draft`` tokens shorter)."""
    from mlx_lm.models.cache import KVCache

    tokens = list(plain.tokens[:NOISE_TOKENS])
    fed = [prompt[-1], *tokens[:-1]]
    at = np.arange(len(tokens))

    def run(first: int, step: int) -> np.ndarray:
        """Log probabilities after each fed token: ``first`` tokens in one call, then
        ``step`` per call (so the batches fall at another phase)."""
        caches = [KVCache() for _ in engine.model.layers]
        _prefill(engine.model, caches, prompt[:-1])
        bounds = [0, *range(first or step, len(fed), step), len(fed)]
        rows = [_logprobs(engine.model(mx.array(fed[a:b])[None], cache=caches)[0])
                for a, b in itertools.pairwise(bounds)]  # fmt: skip
        return np.concatenate(rows)

    def margins(lp: np.ndarray) -> np.ndarray:
        top = np.partition(lp, -2, axis=1)
        result: np.ndarray = top[:, -1] - top[:, -2]
        return result

    single = run(0, 1)
    lp_gap = margin_gap = 0.0
    for phase in range(num_draft + 1):
        batched = run(phase, num_draft + 1)
        lp_gap = max(lp_gap, float(np.abs(single[at, tokens] - batched[at, tokens]).max()))
        margin_gap = max(margin_gap, float(np.abs(margins(single) - margins(batched)).max()))
    return lp_gap, margin_gap
