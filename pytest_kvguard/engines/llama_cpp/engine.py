"""llama.cpp adapter (llama-cpp-python's C API): policies run on llama.cpp's own memory operations
(``stream``), edited prompts on its own prefix reuse (``prefix_cache``); attention read from
its own softmax tensors (``attention``); several policies as sequences of one context
(``group``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines import gguf_vocab
from pytest_kvguard.engines.buffer_sizes import buffer_mib
from pytest_kvguard.engines.conversation import Turn, converse_through_stream
from pytest_kvguard.engines.llama_cpp.api_cache import API_CALLS, CountedLlama, LlamaApiCache
from pytest_kvguard.engines.llama_cpp.attention import read_attention
from pytest_kvguard.engines.llama_cpp.context import UBATCH
from pytest_kvguard.engines.llama_cpp.group import LlamaCppStreamGroup, solo_facts
from pytest_kvguard.engines.llama_cpp.prefix_cache import LlamaCppPrefixCache
from pytest_kvguard.engines.llama_cpp.stream import LlamaCppStream
from pytest_kvguard.engines.llama_log import captured_log, init_backend, log_excerpt
from pytest_kvguard.engines.options import EngineOptions
from pytest_kvguard.engines.protocols import API_STATES, AttentionRows, Decoded
from pytest_kvguard.inputs.chats import ChatTemplate


def load(model_path: Path, options: EngineOptions) -> LlamaCppEngine:
    return LlamaCppEngine(model_path, options)


class LlamaCppEngine:
    """One model loaded once; each stream gets its own context (and so its own cache)."""

    name = "llama_cpp"
    kv_element_bytes = 2.0
    """Contexts are created with llama.cpp's default cache type, f16."""

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        init_backend()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = options.n_gpu_layers
        with captured_log() as log:
            model = lc.llama_model_load_from_file(str(model_path).encode(), params)
        self.model_buffer_bytes = buffer_mib(log)["model"]
        if not model:
            raise EngineError(
                f"llama.cpp could not load {model_path}: {log_excerpt()}",
                fix="check that the file is a GGUF this llama.cpp build supports",
            )
        self.model = model
        self.model_path = model_path
        self.options = options
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_swa = int(lc.llama_model_n_swa(model))
        """The sliding window of the model's sliding layers; 0 for a model without them."""
        self.chat_calls = gguf_vocab.ChatCalls(model_path)
        self.api_llama: CountedLlama | None = None
        """The llama-cpp-python ``Llama`` of edit_replay's API path, kept for the next check
        of the same settings (``api_cache.shared_llama``)."""
        self.probes: dict[tuple[Any, ...], Any] = {}
        """What contexts made to be measured showed, by what was measured (``group``)."""

    def version(self) -> str:
        return str(lc.__version__)

    def describe(self) -> dict[str, str]:
        return {
            "engine": f"llama-cpp-python {lc.__version__}",
            "system_info": lc.llama_print_system_info().decode().strip(),
            "n_gpu_layers": str(self.options.n_gpu_layers),
            "n_threads": str(self.options.n_threads),
        }

    def tokenize(self, text: str) -> list[int]:
        return gguf_vocab.tokenize(self.vocab, text)

    def chat_ids(
        self, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None = None
    ) -> list[int]:
        """What ``Llama.create_chat_completion`` prefills for the messages (``ChatCall``)."""
        return self.chat_calls.ids(messages, template)

    @property
    def bos_id(self) -> int | None:
        return gguf_vocab.bos_id(self.vocab)

    def token_piece(self, token_id: int) -> str:
        return gguf_vocab.token_piece(self.vocab, token_id)

    def attention(
        self, token_ids: Sequence[int], queries: Sequence[int], precision: Policy | None = None
    ) -> AttentionRows:
        """llama.cpp's own ``kq_soft_max`` tensors for the query positions (``attention``), at
        the precision's cache types."""
        if precision is None:
            return read_attention(self, token_ids, queries)
        types = (precision.cache_type_k, precision.cache_type_v)
        return read_attention(self, token_ids, queries, types)

    def open_stream(self, policy: Policy, max_tokens: int) -> LlamaCppStream:
        return LlamaCppStream(self, policy, max_tokens)

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> LlamaCppPrefixCache:
        return LlamaCppPrefixCache(self, policy, max_tokens)

    def open_api_cache(self, policy: Policy, max_tokens: int, state: str = "none") -> LlamaApiCache:
        """The model loaded again through llama-cpp-python's ``Llama``, once per setting."""
        return LlamaApiCache(self, policy, max_tokens, state)

    def api_calls(self, state: str = "none") -> str:
        return API_CALLS + ("" if state == "none" else f", states: {API_STATES[state]}")

    group_figures_own = True
    """A row of a stream group reports what a context of its own would (``group``)."""

    def group_key(self, policy: Policy) -> tuple[str, int] | None:
        """Policies with the same key decode together as sequences of one context
        (``open_stream_group``): capped sink and window policies that evict one token before
        each token they decode, so every row takes the same step once full, at the default
        cache types. Not on models with
        sliding-window layers (a sequence's state leaves out the iSWA cells its kv_bytes must
        count), nor re-indexed on a cache that cannot shift."""
        if policy.kind not in ("sink", "window") or policy.cap is None or policy.precision_set:
            return None  # a context's cache types are its own: a quantized stream runs alone
        if policy.chunk != 1 or policy.evict_step != 1 or self.n_swa > 0:
            return None
        if policy.positions == "reindexed" and not solo_facts(self, policy.cap).can_shift:
            return None
        return ("sequences", policy.cap)

    def open_stream_group(self, policies: Sequence[Policy], max_tokens: int) -> LlamaCppStreamGroup:
        keys = {self.group_key(p) for p in policies}
        if None in keys or len(keys) != 1:
            raise ValueError(f"these policies cannot decode together: {policies}")
        return LlamaCppStreamGroup(self, policies, max_tokens)

    def converse(
        self, policy: Policy, token_ids: Sequence[int], turns: Sequence[Turn], prefill_step: int
    ) -> np.ndarray:
        """llama.cpp's nearest equivalent of a generate call past capacity. llama-cpp-python's
        ``Llama`` refuses a prompt longer than its context ("Requested tokens exceed context
        window") and never shifts; llama.cpp's own servers shift the context instead. So each
        prompt is decoded in calls of ``prefill_step`` tokens (at most the batch, and at most
        what the policy can free beside its sinks) on a stream that evicts for each call with
        llama.cpp's seq_rm / seq_add, and each reply one token at a time.
        """
        step = min(prefill_step, UBATCH, policy.max_chunk or UBATCH)
        stream = self.open_stream(policy, len(token_ids))
        try:
            return converse_through_stream(stream, token_ids, turns, step)
        finally:
            stream.close()

    def speculate(
        self, policy: Policy, prompt: Sequence[int], new_tokens: int, draft: str | None,
        num_draft: int, prefilled: int = 0,
    ) -> Decoded:  # fmt: skip
        """llama-cpp-python's ``Llama`` with (or, draft None, without) prompt lookup."""
        from pytest_kvguard.engines.llama_cpp.speculative import speculate

        return speculate(self, policy, prompt, new_tokens, draft, num_draft, prefilled)

    def verification_noise(
        self, prompt: Sequence[int], plain: Decoded, num_draft: int
    ) -> tuple[float, float]:
        from pytest_kvguard.engines.llama_cpp.speculative import verification_noise

        return verification_noise(self, prompt, plain, num_draft)

    def close(self) -> None:
        self.chat_calls.close()
        if self.api_llama is not None:
            self.api_llama.close()
            self.api_llama = None
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None
