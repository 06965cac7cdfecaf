"""edit_replay through llama-cpp-python's ``Llama``, the path most Python apps call: the first
prompt and the follow-up go through ``Llama.create_completion``, whose own prefix matching (in
``Llama.generate``) decides what the follow-up reuses; kvguard only reads the counts off the
``Llama``'s own state and scores a forced reply through a ``logits_processor``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp as lc
import numpy as np

from pytest_kvguard.engines.llama_cpp.context import UBATCH
from pytest_kvguard.engines.llama_cpp.prefix_cache import window_missing
from pytest_kvguard.engines.protocols import Reuse
from pytest_kvguard.errors import EngineError
from pytest_kvguard.gate.policies import Policy

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine

API_CALLS = "llama_cpp.Llama.create_completion (Llama.generate's own prefix match)"


def swa_full_setting(policy: Policy) -> bool | None:
    """``Llama(swa_full=...)`` as a user sets it for the policy: False for ``swa`` (the small
    cache), True for ``swa_full``; ``full`` leaves llama.cpp's default (a full-size cache)."""
    return {"swa": False, "swa_full": True}.get(policy.kind)


def forcing_processor(reply: Sequence[int], nll: list[float]) -> Callable[[Any, Any], Any]:
    """A ``logits_processor`` that records -log p of the next reply token under the raw logits
    it is given, then leaves that token the only one that can be sampled."""

    def force(input_ids: Any, scores: np.ndarray) -> np.ndarray:
        if len(nll) >= len(reply):
            return scores
        target = reply[len(nll)]
        wide = scores.astype(np.float64)
        peak = wide.max()
        nll.append(float(peak + np.log(np.exp(wide - peak).sum()) - wide[target]))
        forced = np.full_like(scores, np.finfo(np.float32).min)
        forced[target] = 0.0
        return forced

    return force


class LlamaApiCache:
    """A ``Llama`` holding the first prompt; the follow-up's reuse is its own decision.

    Counts come from the ``Llama``'s own state: ``n_tokens`` when it starts evaluating the
    follow-up (the prefix it kept) and the tokens it then evaluates.
    """

    def __init__(
        self, engine: LlamaCppEngine, policy: Policy, max_tokens: int, state: str = "none"
    ) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_cache import LlamaRAMCache

        settings: dict[str, Any] = {
            "model_path": str(engine.model_path), "n_ctx": max_tokens + 1, "n_batch": UBATCH,
            "n_ubatch": UBATCH, "n_threads": engine.options.n_threads,
            "n_threads_batch": engine.options.n_threads,
            "n_gpu_layers": engine.options.n_gpu_layers, "verbose": False,
        }  # fmt: skip
        swa_full = swa_full_setting(policy)
        if swa_full is not None:
            settings["swa_full"] = swa_full
        try:
            self.llm = Llama(**settings)
        except (ValueError, RuntimeError) as exc:
            raise EngineError(f"llama_cpp.Llama could not load the model: {exc}") from None
        self.state = state
        self.saved: Any = None
        """The state ``save_state`` copied after the first request (``state: saved``)."""
        if state == "ram":
            self.llm.set_cache(LlamaRAMCache())
        self.evaluations: list[tuple[int, int]] = []
        """(n_tokens before, tokens evaluated) of each ``Llama.eval`` call of a request."""
        self.oldest_held = -1
        """The oldest position the cache held when a request's first ``Llama.eval`` began."""
        # With swa_full the sliding layers keep every position: no window can go missing.
        self.n_swa = 0 if swa_full is not False else engine.n_swa
        real_eval = self.llm.eval

        def counted_eval(tokens: Sequence[int]) -> None:
            if not self.evaluations:
                # After Llama.generate's own seq_rm of what it does not keep, before the decode.
                memory = lc.llama_get_memory(self.llm.ctx)
                self.oldest_held = int(lc.llama_memory_seq_pos_min(memory, 0))
            self.evaluations.append((int(self.llm.n_tokens), len(tokens)))
            real_eval(tokens)

        self.llm.eval = counted_eval  # type: ignore[method-assign]

    def _complete(self, token_ids: Sequence[int], reply: Sequence[int]) -> list[float]:
        """One ``create_completion`` of the prompt: the reply forced token by token (one token,
        unscored, without a reply); -log p of each reply token."""
        from llama_cpp import LogitsProcessorList

        nll: list[float] = []
        self.evaluations.clear()
        answer = self.llm.create_completion(
            prompt=list(token_ids), max_tokens=max(len(reply), 1), temperature=0.0,
            logits_processor=LogitsProcessorList([forcing_processor(reply, nll)]) if reply
            else None,
        )  # fmt: skip
        if reply and len(nll) != len(reply):
            finish = answer["choices"][0].get("finish_reason")  # type: ignore[index]
            raise EngineError(
                f"Llama generated {len(nll)} of {len(reply)} forced reply tokens ({finish})"
            )
        # What the Llama holds after the prompt: the reply tokens it evaluated (the last one
        # sampled may not be).
        held = [int(t) for t in self.llm.input_ids[len(token_ids) : self.llm.n_tokens]]
        if reply and (len(held) < len(reply) - 1 or held != list(reply[: len(held)])):
            raise EngineError(f"Llama generated {held[:8]}... where the reply was forced")
        return nll

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        if start != 0:
            raise EngineError("a Llama is given whole prompts only")
        self._complete(token_ids, ())
        if self.state == "saved":
            self.saved = self.llm.save_state()

    def replay(self, token_ids: Sequence[int], reply: Sequence[int]) -> Reuse:
        if self.saved is not None:
            self.llm.reset()  # type: ignore[no-untyped-call]
            self.llm.load_state(self.saved)
        nll = self._complete(token_ids, reply)
        if not self.evaluations:
            raise EngineError("Llama evaluated nothing for the follow-up")
        kept, evaluated = self.evaluations[0]
        if kept + evaluated != len(token_ids):
            raise EngineError(
                f"Llama kept {kept} tokens and evaluated {evaluated} for a {len(token_ids)}-"
                "token prompt"
            )
        return Reuse(
            kept, evaluated, None, np.array(nll) if reply else None,
            window_missing(kept, self.oldest_held, self.n_swa),
        )  # fmt: skip

    def score_fresh(self, token_ids: Sequence[int], reply: Sequence[int]) -> np.ndarray:
        # No saved state, and n_tokens = 0: nothing matches, the prompt is evaluated from 0.
        self.llm.set_cache(None)
        self.llm.reset()  # type: ignore[no-untyped-call]
        nll = np.array(self._complete(token_ids, reply))
        if self.evaluations and self.evaluations[0][0] != 0:
            raise EngineError(f"Llama kept {self.evaluations[0][0]} tokens after reset()")
        return nll

    def memory_bytes(self) -> dict[str, float]:
        """The context's state as ``Llama.save_state`` copies it (every cell held)."""
        state = self.llm.save_state()
        return {"state_bytes": float(state.llama_state_size), "checkpoint_bytes": 0.0,
                "checkpoints": 0.0}  # fmt: skip

    def keep_prefix(self, n_tokens: int) -> tuple[int, int | None]:
        raise EngineError("Llama decides its own reuse: use replay()")

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        raise EngineError("Llama decides its own reuse: use replay()")

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()
