"""edit_replay through llama-cpp-python's ``Llama``, the path most Python apps call: each chat
request goes through ``Llama.create_chat_completion`` (the model's chat template, or the one
the check gives, as the ``Llama``'s chat handler), whose own prefix matching (in
``Llama.generate``) decides what the follow-up reuses; kvguard reads the counts off the
``Llama``'s own state and scores a forced reply through a ``logits_processor``.

How the app keeps states between requests (``api_state``) is llama-cpp-python's own too: its
``LlamaRAMCache`` or ``LlamaDiskCache`` read back after a request in between, or a
``save_state`` pickled and loaded again.
"""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp as lc
import numpy as np

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.gguf_vocab import chat_handler
from pytest_kvguard.engines.llama_cpp.context import UBATCH
from pytest_kvguard.engines.llama_cpp.prefix_cache import window_missing
from pytest_kvguard.engines.protocols import Prompt, Reuse

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine
    from pytest_kvguard.inputs.chats import ChatTemplate

API_CALLS = "llama_cpp.Llama.create_chat_completion (Llama.generate's own prefix match)"
CONTEXT_STEP = 1024
"""A shared ``Llama``'s context is the check's need rounded up to this, so checks of similar
sizes share one (the context's size does not change what a request computes)."""


def context_size(tokens: int) -> int:
    """The context a ``Llama`` gets for requests of up to ``tokens`` tokens (and one more)."""
    return -(-(tokens + 1) // CONTEXT_STEP) * CONTEXT_STEP


BETWEEN = ({"role": "user", "content": "What does the len() function return for a dict?"},)
"""The request an app serves between the first prompt and the follow-up (another user's, a
new chat): the ``Llama`` then holds something else, so the follow-up's state must come from
the app's state cache."""


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


class CountedLlama:
    """One ``Llama`` per model, ``swa_full`` setting and context size in a worker, shared by
    the checks that ask for it; it counts what each request kept and evaluated."""

    def __init__(self, engine: LlamaCppEngine, swa_full: bool | None, n_ctx: int) -> None:
        from llama_cpp import Llama

        settings: dict[str, Any] = {
            "model_path": str(engine.model_path), "n_ctx": n_ctx, "n_batch": UBATCH,
            "n_ubatch": UBATCH, "n_threads": engine.options.n_threads,
            "n_threads_batch": engine.options.n_threads,
            "n_gpu_layers": engine.options.n_gpu_layers, "verbose": False,
        }  # fmt: skip
        if swa_full is not None:
            settings["swa_full"] = swa_full
        try:
            self.llm = Llama(**settings)
        except (ValueError, RuntimeError) as exc:
            raise EngineError(f"llama_cpp.Llama could not load the model: {exc}") from None
        self.swa_full = swa_full
        self.n_ctx = n_ctx
        self.handlers: dict[str, Any] = {}
        self.evaluations: list[tuple[int, int]] = []
        """(n_tokens before, tokens evaluated) of each ``Llama.eval`` call of a request."""
        self.oldest_held = -1
        """The oldest position the cache held when a request's first ``Llama.eval`` began."""
        self.loaded: int | None = None
        """Tokens of the last state ``Llama.load_state`` loaded (an app's state read back);
        None: none was since the Llama was emptied."""
        real_eval, real_load = self.llm.eval, self.llm.load_state

        def counted_eval(tokens: Sequence[int]) -> None:
            if not self.evaluations:
                # After Llama.generate's own seq_rm of what it does not keep, before the decode.
                memory = lc.llama_get_memory(self.llm.ctx)
                self.oldest_held = int(lc.llama_memory_seq_pos_min(memory, 0))
            self.evaluations.append((int(self.llm.n_tokens), len(tokens)))
            real_eval(tokens)

        def counted_load(state: Any) -> None:
            self.loaded = int(state.n_tokens)
            real_load(state)

        self.llm.eval = counted_eval  # type: ignore[method-assign]
        self.llm.load_state = counted_load  # type: ignore[method-assign]

    def empty(self) -> None:
        """Nothing held, no state cache: as a new app would find it."""
        self.llm.set_cache(None)
        self.llm.reset()  # type: ignore[no-untyped-call]
        self.loaded = None

    def use_template(self, template: ChatTemplate | None) -> None:
        """The chat handler an app passes for ``template`` (None: the model's own)."""
        if template is None:
            self.llm.chat_handler = None
            return
        if template.source not in self.handlers:
            self.handlers[template.source] = chat_handler(self.llm, template)
        self.llm.chat_handler = self.handlers[template.source]

    def send(self, prompt: Prompt, reply: Sequence[int]) -> list[float]:
        """One request: a chat through ``create_chat_completion`` (checked to prefill the
        prompt's ids), a cut prompt through ``create_completion``; the reply forced token by
        token (one token, unscored, without a reply); -log p of each reply token."""
        from llama_cpp import LogitsProcessorList

        nll: list[float] = []
        self.evaluations.clear()
        options: dict[str, Any] = {
            "max_tokens": max(len(reply), 1), "temperature": 0.0,
            "logits_processor": LogitsProcessorList([forcing_processor(reply, nll)]) if reply
            else None,
        }  # fmt: skip
        answer: Any
        if prompt.messages is not None:
            self.use_template(prompt.template)
            messages: Any = [dict(m) for m in prompt.messages]
            answer = self.llm.create_chat_completion(messages=messages, **options)
        else:
            answer = self.llm.create_completion(prompt=list(prompt.ids), **options)
        prefilled = [int(t) for t in self.llm.input_ids[: len(prompt.ids)]]
        if prefilled != list(prompt.ids):
            pairs = zip(prefilled, prompt.ids, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            raise EngineError(
                f"the Llama's chat call prefilled other ids than kvguard's chat_ids (first "
                f"difference at token {at}, {len(prefilled)} ids held for {len(prompt.ids)})"
            )
        if reply and len(nll) != len(reply):
            finish = answer["choices"][0].get("finish_reason")
            raise EngineError(
                f"Llama generated {len(nll)} of {len(reply)} forced reply tokens ({finish})"
            )
        # What the Llama holds after the prompt: the reply tokens it evaluated (the last one
        # sampled may not be).
        held = [int(t) for t in self.llm.input_ids[len(prompt.ids) : self.llm.n_tokens]]
        if reply and (len(held) < len(reply) - 1 or held != list(reply[: len(held)])):
            raise EngineError(f"Llama generated {held[:8]}... where the reply was forced")
        return nll

    def fresh(self, prompt: Prompt, reply: Sequence[int], cut: int = 0) -> list[float]:
        """The prompt and forced reply from an empty ``Llama`` with no state cache: prefilled in
        its own batches, or, with ``cut``, after a ``create_completion`` of the first ``cut``
        ids alone, which the prompt then reuses (checked: a floor cut elsewhere is no floor)."""
        self.empty()
        if cut:
            self.send(prompt.cut(cut), ())
        nll = self.send(prompt, reply)
        kept = self.kept(prompt)[0]
        if kept != cut:
            raise EngineError(f"Llama kept {kept} tokens where {cut} were held for it")
        return nll

    def kept(self, prompt: Prompt) -> tuple[int, int]:
        """(tokens the last request kept, tokens it evaluated), checked to add up."""
        if not self.evaluations:
            raise EngineError("Llama evaluated nothing for the prompt")
        kept, evaluated = self.evaluations[0]
        if kept + evaluated != len(prompt.ids):
            raise EngineError(
                f"Llama kept {kept} tokens and evaluated {evaluated} for a {len(prompt.ids)}-"
                "token prompt"
            )
        return kept, evaluated

    def close(self) -> None:
        self.llm.close()


def shared_llama(engine: LlamaCppEngine, policy: Policy, max_tokens: int) -> CountedLlama:
    """The worker's ``Llama`` for the policy's ``swa_full`` setting and a context of at least
    ``max_tokens + 1``: kept for the next check that asks for the same, one at a time (each
    holds the model and its context)."""
    swa_full = swa_full_setting(policy)
    key = (swa_full, context_size(max_tokens))
    held = engine.api_llama
    if held is not None and (held.swa_full, held.n_ctx) == key:
        return held
    if held is not None:
        held.close()
        engine.api_llama = None
    engine.api_llama = CountedLlama(engine, *key)
    return engine.api_llama


class LlamaApiCache:
    """The shared ``Llama`` holding the first prompt; the follow-up's reuse is its own decision.

    Counts come from the ``Llama``'s own state: ``n_tokens`` when it starts evaluating the
    follow-up (the prefix it kept) and the tokens it then evaluates.
    """

    def __init__(
        self, engine: LlamaCppEngine, policy: Policy, max_tokens: int, state: str = "none"
    ) -> None:
        self.counted = shared_llama(engine, policy, max_tokens)
        self.llm = self.counted.llm
        self.counted.empty()
        self.state = state
        self.saved: bytes | None = None
        """The pickled ``LlamaState`` of ``state: saved``, as an app persists it."""
        self.folder: tempfile.TemporaryDirectory[str] | None = None
        self.state_bytes = float("nan")
        if state == "ram":
            from llama_cpp.llama_cache import LlamaRAMCache

            self.llm.set_cache(LlamaRAMCache())
        elif state == "disk":
            from llama_cpp.llama_cache import LlamaDiskCache

            self.folder = tempfile.TemporaryDirectory(prefix="kvguard-llama-disk-cache-")
            self.llm.set_cache(LlamaDiskCache(cache_dir=self.folder.name))
        # Measured with swa_full too: its sliding layers must hold every position, so a window
        # missing there is llama.cpp not honouring the flag.
        self.n_swa = engine.n_swa

    def request(self, prompt: Prompt) -> None:
        self.counted.send(prompt, ())
        self.state_bytes = float(lc.llama_state_get_size(self.llm.ctx))
        if self.state == "saved":
            self.saved = pickle.dumps(self.llm.save_state())
        if self.state in ("ram", "disk", "saved"):
            # Another request in between: what the follow-up reuses must come back from the
            # app's own states, not from what the Llama still holds.
            self.counted.send(Prompt((), BETWEEN, prompt.template), ())

    def replay(self, prompt: Prompt, reply: Sequence[int]) -> Reuse:
        """The follow-up; where the app keeps states, the one loaded for it is reported as
        the restored state's tokens (none loaded: the Llama reuses what it holds, the request
        in between, so nearly everything is prefilled again)."""
        self.counted.loaded = None
        if self.saved is not None:
            self.llm.reset()  # type: ignore[no-untyped-call]
            self.llm.load_state(pickle.loads(self.saved))  # noqa: S301 - our own pickle
        nll = self.counted.send(prompt, reply)
        kept, evaluated = self.counted.kept(prompt)
        return Reuse(
            kept, evaluated, None, np.array(nll) if reply else None,
            window_missing(kept, self.counted.oldest_held, self.n_swa),
            loaded_state=self.counted.loaded,
        )  # fmt: skip

    def score_fresh(self, prompt: Prompt, reply: Sequence[int], cut: int = 0) -> np.ndarray:
        return np.array(self.counted.fresh(prompt, reply, cut))

    def memory_bytes(self) -> dict[str, float]:
        """The context's state after the first request (``llama_state_get_size``: every cell
        held); a pickled ``LlamaState`` an app keeps also carries the Llama's logits buffer,
        n_batch x vocabulary floats (512 MiB on Gemma 3)."""
        return {"state_bytes": self.state_bytes, "checkpoint_bytes": 0.0,
                "checkpoints": 0.0}  # fmt: skip

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        raise EngineError("a Llama is sent requests: use request()")

    def keep_prefix(self, n_tokens: int) -> tuple[int, int | None]:
        raise EngineError("Llama decides its own reuse: use replay()")

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        raise EngineError("Llama decides its own reuse: use replay()")

    def close(self) -> None:
        """The Llama stays loaded for the next check; what this one left in it goes."""
        disk: Any = self.llm.cache
        self.counted.empty()
        self.saved = None
        if self.folder is not None:
            if disk is not None:
                disk.cache.close()  # LlamaDiskCache's diskcache.Cache: its SQLite file
            self.folder.cleanup()
            self.folder = None
