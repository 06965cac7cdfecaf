"""edit_replay through mlx-lm's prompt cache as ``mlx_lm.server`` keeps one between requests:
the ``LRUPromptCache`` of the installed release (``mlx_lm.models.cache`` in 0.31.3 and 0.32,
``mlx_lm.server`` in 0.28.4) finds the nearest cached prompt for the follow-up and trims
it where mlx-lm can; ``generate_step`` (what ``stream_generate`` runs) prefills the rest and
generates. kvguard reads the counts off what the prompt cache hands back and scores a forced
reply through a logits processor. 0.28 and older have no ``LRUPromptCache``: their server kept
one cache inside its request handler, which cannot be called on its own."""

from __future__ import annotations

from pytest_kvguard.engines.mlx.blas import preload_openblas

BLAS_PATH = preload_openblas()

# The engine is imported only after the BLAS choice above.
from collections.abc import Callable, Sequence  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from pytest_kvguard.core.errors import EngineError, KvguardError  # noqa: E402
from pytest_kvguard.core.policies import Policy  # noqa: E402
from pytest_kvguard.core.scoring import nll_of  # noqa: E402
from pytest_kvguard.engines.mlx.caches import cache_nbytes, make_caches  # noqa: E402
from pytest_kvguard.engines.protocols import Prompt, Reuse  # noqa: E402

if TYPE_CHECKING:
    from pytest_kvguard.engines.mlx.engine import MlxEngine

MODEL_KEY = "kvguard"
"""The prompt cache's model key (the server's is its model path)."""


def lru_prompt_cache() -> tuple[type, str]:
    """The installed release's ``LRUPromptCache`` and where it lives."""
    try:
        from mlx_lm.models.cache import LRUPromptCache

        return LRUPromptCache, "mlx_lm.models.cache.LRUPromptCache"
    except ImportError:
        pass
    try:
        from mlx_lm.server import LRUPromptCache

        return LRUPromptCache, "mlx_lm.server.LRUPromptCache"
    except ImportError:
        import mlx_lm

        raise KvguardError(
            f"mlx-lm {mlx_lm.__version__} has no LRUPromptCache (0.28.4 has it in mlx_lm.server; "
            "0.28.0's server kept a single prompt cache inside its request handler)",
            fix="use via: memory with this release, or a later mlx-lm for via: api",
            key="params.via",
        ) from None


def api_calls() -> str:
    return f"{lru_prompt_cache()[1]} + mlx_lm.generate.generate_step, as mlx_lm.server calls them"


def forcing_processor(reply: Sequence[int], nll: list[float]) -> Callable[[Any, Any], Any]:
    """A logits processor that records -log p of the next reply token under the raw logits
    (``nll_of``'s float64 log-softmax, as the rest of a reply is scored: mlx's float32
    ``logsumexp`` over the vocabulary reads 1.6e-4 nats higher on average, up to 8e-4 on
    Gemma 3's 262k entries), then leaves that token the only one the sampler can pick."""

    def force(tokens: Any, logits: Any) -> Any:
        if len(nll) >= len(reply):
            return logits  # generate_step decodes the last reply token too: not scored
        target = reply[len(nll)]
        row = np.array(logits.astype(mx.float32))
        nll.append(float(nll_of(row, np.array([target]))[0]))
        vocab = mx.arange(logits.shape[-1])
        return mx.where(vocab == target, 0.0, -mx.inf)[None].astype(logits.dtype)

    return force


class MlxApiCache:
    """mlx-lm's prompt cache holding the first prompt and its one generated token, as the
    server inserts them; the follow-up takes whatever ``fetch_nearest_cache`` hands back."""

    def __init__(self, engine: MlxEngine, policy: Policy) -> None:
        self.engine = engine
        self.policy = policy
        self.lru = lru_prompt_cache()[0]()
        self.held: list[Any] = []
        """The cache inserted after the first prompt (what memory_bytes measures)."""

    def _generate(self, prompt: Sequence[int], cache: list[Any]) -> list[int]:
        """``generate_step`` on the prompt with this cache, one token generated (greedy), as the
        server answers a request: the tokens generated."""
        from mlx_lm.generate import generate_step

        steps = generate_step(
            mx.array(list(prompt)), self.engine.model, max_tokens=1,
            sampler=lambda logprobs: mx.argmax(logprobs, axis=-1), prompt_cache=cache,
        )  # fmt: skip
        return [int(token) for token, _ in steps]

    def _score(self, prompt: Sequence[int], cache: list[Any], reply: Sequence[int]) -> list[float]:
        """``generate_step`` prefills the prompt on this cache as for a request
        (``max_tokens=0``, as ``mlx_lm.cache_prompt`` calls it) and scores the first reply
        token from its last logits; the rest of the reply is then scored in one call of the
        model on that cache. -log p of each reply token. (Token by token through
        ``generate_step`` costs 0.1 to 0.16 s a token here; mlx on the CPU gives the same
        log-probabilities either way, which tests/test_mlx.py measures.)"""
        from mlx_lm.generate import generate_step

        nll: list[float] = []
        steps = generate_step(
            mx.array(list(prompt)), self.engine.model, max_tokens=0, prompt_cache=cache,
            logits_processors=[forcing_processor(reply[:1], nll)],
        )  # fmt: skip
        for _ in steps:
            pass
        if len(nll) != 1:
            raise EngineError(
                f"mlx-lm's generate_step(max_tokens=0) gave {len(nll)} logits for the prompt's "
                "last token, not 1"
            )
        if len(reply) > 1:
            logits = self.engine.model(mx.array([list(reply[:-1])]), cache=cache)[0]
            nll += nll_of(np.array(logits.astype(mx.float32)), np.asarray(reply[1:])).tolist()
        return nll

    def _hold(self, lru: Any, token_ids: Sequence[int]) -> None:
        """A request as the server serves it: the nearest cached prompt fetched (or a new
        cache), the rest prefilled, one token generated, the whole inserted back."""
        cache, rest = lru.fetch_nearest_cache(MODEL_KEY, list(token_ids))
        if cache is None:
            cache = make_caches(self.engine.model, self.policy)
        generated = self._generate(rest, cache)
        lru.insert_cache(MODEL_KEY, list(token_ids) + generated, cache)
        self.held = cache

    def _follow(self, lru: Any, token_ids: Sequence[int], reply: Sequence[int]) -> Reuse:
        """The next request on that prompt cache, the reply forced: what it reused, its scores."""
        cache, rest = lru.fetch_nearest_cache(MODEL_KEY, list(token_ids))
        if cache is None:
            cache = make_caches(self.engine.model, self.policy)
        reused = len(token_ids) - len(rest)
        if reply:
            return Reuse(reused, len(rest), None, np.array(self._score(rest, cache, reply)))
        self._generate(rest, cache)
        return Reuse(reused, len(rest), None, None)

    def request(self, prompt: Prompt) -> None:
        self._hold(self.lru, prompt.ids)

    def replay(self, prompt: Prompt, reply: Sequence[int]) -> Reuse:
        return self._follow(self.lru, prompt.ids, reply)

    def score_fresh(self, prompt: Prompt, reply: Sequence[int], cut: int = 0) -> np.ndarray:
        """A new prompt cache; with ``cut``, the first ``cut`` ids prefilled alone and inserted
        (as ``mlx_lm.cache_prompt`` fills one), which the prompt then reuses (checked)."""
        lru = lru_prompt_cache()[0]()
        if cut:
            from mlx_lm.generate import generate_step

            cache = make_caches(self.engine.model, self.policy)
            for _ in generate_step(mx.array(list(prompt.ids[:cut])), self.engine.model,
                                   max_tokens=0, prompt_cache=cache):  # fmt: skip
                pass
            lru.insert_cache(MODEL_KEY, list(prompt.ids[:cut]), cache)
        reuse = self._follow(lru, prompt.ids, reply)
        if reuse.reused != cut:
            raise EngineError(f"mlx-lm's prompt cache reused {reuse.reused} of {cut} tokens held")
        return np.array(reuse.reply_nll if reply else [])

    def memory_bytes(self) -> dict[str, float]:
        return {"state_bytes": float(sum(cache_nbytes(c) for c in self.held)),
                "checkpoint_bytes": 0.0, "checkpoints": 0.0}  # fmt: skip

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        raise EngineError("mlx-lm's prompt cache is sent requests: use request()")

    def keep_prefix(self, n_tokens: int) -> tuple[int, int | None]:
        raise EngineError("mlx-lm's prompt cache decides its own reuse: use replay()")

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        raise EngineError("mlx-lm's prompt cache decides its own reuse: use replay()")

    def close(self) -> None:
        self.held = []
        self.lru = None
