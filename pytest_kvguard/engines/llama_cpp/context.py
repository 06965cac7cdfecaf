"""A llama.cpp context (its cache and a reusable batch) and one sequence of it: what the llama.cpp
adapter's streams, prefix caches and stream groups are built on."""

from __future__ import annotations

import resource
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp as lc
import numpy as np

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.core.policies import UNQUANTIZED_CACHE_TYPES
from pytest_kvguard.engines.buffer_sizes import buffer_mib
from pytest_kvguard.engines.llama_log import captured_log, log_excerpt

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine

SEQ = 0
"""A stream or prefix cache of its own runs as sequence 0 of its own context."""

UBATCH = 512
"""Tokens per llama_decode call (n_batch and n_ubatch of every context)."""

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
              "iq4_nl": 20, "bf16": 30}  # fmt: skip
"""ggml's type enum for the cache types llama.cpp takes (``ggml_type``: fixed numbers;
llama-cpp-python exports no constant for bf16)."""


class Context:
    """A llama.cpp context and a reusable batch: one sequence (a stream or prefix cache of its
    own), or ``n_seq`` sequences that each hold their own cells (a stream group)."""

    def __init__(
        self, engine: LlamaCppEngine, n_ctx: int, swa_full: bool = False, n_seq: int = 1,
        flash_attn: bool | None = None, cache_types: tuple[str, str] = ("f16", "f16"),
    ) -> None:  # fmt: skip
        self.n_ctx, self.n_seq = n_ctx, n_seq
        type_k, type_v = cache_types
        if type_v not in UNQUANTIZED_CACHE_TYPES:
            # llama.cpp quantizes V only under flash attention (it refuses the context else).
            if flash_attn is False:
                raise EngineError(
                    f"a {type_v} V cache needs flash attention, which this path turns off",
                    fix="use cache_type_v: f16 here",
                )
            flash_attn = True
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx  # llama.cpp pads the cell count to a multiple of 256
        params.n_batch = UBATCH
        params.n_ubatch = UBATCH
        params.n_seq_max = n_seq
        if n_seq > 1:
            # Each sequence gets n_ctx / n_seq cells of its own and attends to those only, as
            # in a context of its own (kv_unified would make every row attend over all cells).
            params.kv_unified = False
        params.n_threads = engine.options.n_threads
        params.n_threads_batch = engine.options.n_threads
        params.swa_full = swa_full
        params.type_k, params.type_v = GGML_TYPES[type_k], GGML_TYPES[type_v]
        if flash_attn is not None:  # else llama.cpp's own choice (auto: on, on the CPU)
            if hasattr(params, "flash_attn_type"):
                on, off = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
                params.flash_attn_type = on if flash_attn else off
            else:  # releases before llama.cpp's flash_attn_type: a bool
                params.flash_attn = flash_attn
        params.no_perf = True
        with captured_log() as log:
            ctx = lc.llama_init_from_model(engine.model, params)
        buffers = buffer_mib(log)
        self.kv_buffer_bytes, self.compute_buffer_bytes = buffers["KV"], buffers["compute"]
        if not ctx:
            types = "" if cache_types == ("f16", "f16") else f" (K {type_k}, V {type_v})"
            raise EngineError(f"llama.cpp could not create a context{types}: {log_excerpt()}")
        self.ctx = ctx
        self.memory = lc.llama_get_memory(ctx)
        self.batch = lc.llama_batch_init(UBATCH, 0, 1)

    def decode(
        self, token_ids: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
        all_logits: bool,
    ) -> None:  # fmt: skip
        """One llama_decode of up to UBATCH tokens, token i at positions[i] of sequence seqs[i]."""
        batch = self.batch
        batch.n_tokens = len(token_ids)
        for i, token in enumerate(token_ids):
            batch.token[i] = token
            batch.pos[i] = positions[i]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seqs[i]
            batch.logits[i] = 1 if all_logits or i == len(token_ids) - 1 else 0
        status = lc.llama_decode(self.ctx, batch)
        if status != 0:
            raise EngineError(f"llama_decode returned {status}: {log_excerpt()}")

    def logits(self, rows: int, n_vocab: int) -> np.ndarray:
        """A copy of the last decode's logits, ``rows`` of them."""
        out: np.ndarray[Any, np.dtype[np.float32]] = np.ctypeslib.as_array(
            lc.llama_get_logits(self.ctx), shape=(rows, n_vocab)
        )
        return out.copy()

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            lc.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None


class CacheSequence:
    """One sequence of a llama.cpp context: sequence 0 of a context of its own, or sequence
    ``seq`` of a group's shared context (which the group owns and frees)."""

    def __init__(
        self, engine: LlamaCppEngine, n_ctx: int, swa_full: bool = False,
        shared: Context | None = None, seq: int = SEQ, flash_attn: bool | None = None,
        cache_types: tuple[str, str] = ("f16", "f16"),
    ) -> None:  # fmt: skip
        self.engine = engine
        self.seq = seq
        self.n_ctx = n_ctx
        """The cells asked for (of a context of its own; what a row of a group reports as)."""
        self.own_context: Context | None = (
            None
            if shared
            else Context(engine, n_ctx, swa_full, flash_attn=flash_attn, cache_types=cache_types)
        )
        context = shared or self.own_context
        assert context is not None
        self.context = context
        self.ctx = context.ctx
        self.memory = context.memory
        self.kv_buffer_bytes = context.kv_buffer_bytes
        self.compute_buffer_bytes = context.compute_buffer_bytes

    def _decode(self, token_ids: Sequence[int], first_pos: int, all_logits: bool) -> None:
        """One llama_decode of up to UBATCH tokens at consecutive positions of this sequence."""
        n = len(token_ids)
        self.context.decode(token_ids, range(first_pos, first_pos + n), [self.seq] * n, all_logits)

    def memory_figures(self) -> dict[str, float]:
        """What the cache holds now and what llama.cpp allocated, in bytes.

        kv_bytes is the whole context's state (one sequence per context): K and V of every cell
        in use, plus a header of about 15 bytes per cell. ``llama_state_seq_get_size`` would
        skip sliding-layer cells outside the window that an iSWA cache still holds.
        """
        return self._figures(
            float(lc.llama_state_get_size(self.ctx)), self.kv_buffer_bytes,
            self.compute_buffer_bytes,
        )  # fmt: skip

    def _figures(
        self, kv_bytes: float, kv_buffer: float, compute_buffer: float
    ) -> dict[str, float]:
        return {
            "kv_bytes": kv_bytes,
            "kv_buffer_bytes": kv_buffer,
            "compute_buffer_bytes": compute_buffer,
            "peak_memory_bytes": self.engine.model_buffer_bytes + kv_buffer + compute_buffer,
            # Process-wide and cumulative: the largest resident set so far in this session.
            "process_peak_rss_bytes": float(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            ),
        }

    def close(self) -> None:
        own, self.own_context = getattr(self, "own_context", None), None
        if own is not None:
            own.close()
        self.ctx = None
