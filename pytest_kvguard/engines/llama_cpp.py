"""llama.cpp adapter (llama-cpp-python's C API): policies run on llama.cpp's own memory operations.

Eviction is ``llama_memory_seq_rm`` on the oldest unpinned cells; re-indexed positions then
shift the survivors down with ``llama_memory_seq_add`` (which re-rotates the RoPE keys),
exactly as llama.cpp's context shift does.
"""

from __future__ import annotations

import ctypes
import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from pytest_kvguard.engines import AttentionRows, EngineOptions
from pytest_kvguard.engines.buffer_sizes import buffer_mib
from pytest_kvguard.engines.conversation import Turn, converse_through_stream
from pytest_kvguard.engines.llama_log import captured_log, init_backend, log_excerpt
from pytest_kvguard.errors import EngineError, KvguardError
from pytest_kvguard.models import BUILTIN_CHAT_TEMPLATES
from pytest_kvguard.policies import Policy

SEQ = 0
"""A stream or prefix cache of its own runs as sequence 0 of its own context."""

UBATCH = 512
"""Tokens per llama_decode call (n_batch and n_ubatch of every context)."""


def load(model_path: Path, options: EngineOptions) -> LlamaCppEngine:
    return LlamaCppEngine(model_path, options)


def _tokenize(vocab: Any, text: str) -> list[int]:
    """Token ids with BOS where the model's metadata asks for one; special tokens not parsed."""
    data = text.encode("utf-8")
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
    capacity = len(data) + 8
    buffer = (lc.llama_token * capacity)()
    n = lc.llama_tokenize(vocab, data, len(data), buffer, capacity, add_bos, False)
    if n < 0:
        raise EngineError(f"tokenizer needed {-n} slots, had {capacity}")
    return list(buffer[:n])


def _render_chat(model: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt llama.cpp's own chat-template code renders for these messages.

    The template comes from the GGUF metadata; a model without one (the Gemma 3 base GGUF) gets
    llama.cpp's built-in template for its architecture family.
    """
    template = lc.llama_model_chat_template(model, None)
    if not template:
        arch = ctypes.create_string_buffer(64)
        lc.llama_model_meta_val_str(model, b"general.architecture", arch, 64)
        family = arch.value.decode()
        builtin = BUILTIN_CHAT_TEMPLATES.get(family)
        template = builtin.encode() if builtin else None
        if template is None:
            raise EngineError(
                f"the model has no chat template, and kvguard knows no built-in one for '{family}'",
                fix="use a model whose GGUF carries tokenizer.chat_template",
            )
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (lc.llama_chat_message * len(keep))(*[lc.llama_chat_message(r, c) for r, c in keep])
    size = 2 * sum(len(c) for _, c in keep) + 4096
    for _ in range(2):
        buffer = ctypes.create_string_buffer(size)
        n = lc.llama_chat_apply_template(template, chat, len(keep), False, buffer, size)
        if n < 0:
            raise EngineError("llama.cpp could not apply the chat template")
        if n <= size:
            return buffer.raw[:n].decode("utf-8")
        size = n
    raise EngineError("chat template output did not fit")


def _bos_id(vocab: Any) -> int | None:
    """The vocabulary's BOS token; None where it has none."""
    bos = int(lc.llama_vocab_bos(vocab))
    return None if bos < 0 else bos


def _token_piece(vocab: Any, token_id: int) -> str:
    """The token's text, special tokens spelt out (``<bos>``)."""
    buffer = ctypes.create_string_buffer(256)
    n = lc.llama_token_to_piece(vocab, token_id, buffer, 256, 0, True)
    return buffer.raw[: max(n, 0)].decode("utf-8", errors="replace")


class GgufVocab:
    """llama.cpp's tokenizer alone (vocab-only load): how other engines get identical ids."""

    def __init__(self, model_path: Path) -> None:
        init_backend()
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self.model = lc.llama_model_load_from_file(str(model_path).encode(), params)
        if not self.model:
            raise EngineError(f"llama.cpp could not read the vocabulary of {model_path}")
        self.vocab = lc.llama_model_get_vocab(self.model)

    def tokenize(self, text: str) -> list[int]:
        return _tokenize(self.vocab, text)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return _render_chat(self.model, messages)

    @property
    def bos_id(self) -> int | None:
        return _bos_id(self.vocab)

    def token_piece(self, token_id: int) -> str:
        return _token_piece(self.vocab, token_id)

    def __del__(self) -> None:
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)


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
        self.probes: dict[tuple[Any, ...], Any] = {}
        """What contexts made to be measured showed, by what was measured (``llama_group``)."""

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
        return _tokenize(self.vocab, text)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return _render_chat(self.model, messages)

    @property
    def bos_id(self) -> int | None:
        return _bos_id(self.vocab)

    def token_piece(self, token_id: int) -> str:
        return _token_piece(self.vocab, token_id)

    def attention(self, token_ids: Sequence[int], queries: Sequence[int]) -> AttentionRows:
        """llama.cpp's own ``kq_soft_max`` tensors for the query positions (``llama_attention``)."""
        from pytest_kvguard.engines.llama_attention import read_attention

        return read_attention(self, token_ids, queries)

    def open_stream(self, policy: Policy, max_tokens: int) -> LlamaCppStream:
        return LlamaCppStream(self, policy, max_tokens)

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> LlamaCppPrefixCache:
        return LlamaCppPrefixCache(self, policy, max_tokens)

    group_figures_own = True
    """A row of a stream group reports what a context of its own would (``llama_group``)."""

    def group_key(self, policy: Policy) -> tuple[str, int] | None:
        """Policies with the same key decode together as sequences of one context
        (``open_stream_group``): capped sink and window policies that evict one token before
        each token they decode, so every row takes the same step once full. Not on models with
        sliding-window layers (a sequence's state leaves out the iSWA cells its kv_bytes must
        count), nor re-indexed on a cache that cannot shift."""
        from pytest_kvguard.engines.llama_group import solo_facts

        if policy.kind not in ("sink", "window") or policy.cap is None:
            return None
        if policy.chunk != 1 or policy.evict_step != 1 or lc.llama_model_n_swa(self.model) > 0:
            return None
        if policy.positions == "reindexed" and not solo_facts(self, policy.cap).can_shift:
            return None
        return ("sequences", policy.cap)

    def open_stream_group(self, policies: Sequence[Policy], max_tokens: int) -> Any:
        """A ``llama_group.LlamaCppStreamGroup`` of these policies."""
        from pytest_kvguard.engines.llama_group import LlamaCppStreamGroup

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

    def close(self) -> None:
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None


class _Context:
    """A llama.cpp context and a reusable batch: one sequence (a stream or prefix cache of its
    own), or ``n_seq`` sequences that each hold their own cells (a stream group)."""

    def __init__(
        self, engine: LlamaCppEngine, n_ctx: int, swa_full: bool = False, n_seq: int = 1
    ) -> None:
        self.n_ctx, self.n_seq = n_ctx, n_seq
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
        params.no_perf = True
        with captured_log() as log:
            ctx = lc.llama_init_from_model(engine.model, params)
        buffers = buffer_mib(log)
        self.kv_buffer_bytes, self.compute_buffer_bytes = buffers["KV"], buffers["compute"]
        if not ctx:
            raise EngineError(f"llama.cpp could not create a context: {log_excerpt()}")
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


class _Sequence:
    """One sequence of a llama.cpp context: sequence 0 of a context of its own, or sequence
    ``seq`` of a group's shared context (which the group owns and frees)."""

    def __init__(
        self, engine: LlamaCppEngine, n_ctx: int, swa_full: bool = False,
        shared: _Context | None = None, seq: int = SEQ,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.seq = seq
        self.n_ctx = n_ctx
        """The cells asked for (of a context of its own; what a row of a group reports as)."""
        self.own_context: _Context | None = None if shared else _Context(engine, n_ctx, swa_full)
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


class LlamaCppStream(_Sequence):
    """A stream under a policy applied by seq_rm (eviction) and seq_add (re-indexing)."""

    def __init__(
        self, engine: LlamaCppEngine, policy: Policy, max_tokens: int,
        shared: _Context | None = None, seq: int = SEQ,
    ) -> None:  # fmt: skip
        # A capped policy never holds more than `cap`; swa and swa_full leave the sliding
        # layers to llama.cpp's own cache (iSWA, or full-size with swa_full).
        super().__init__(
            engine,
            policy.cap if policy.cap is not None else max_tokens,
            swa_full=policy.kind == "swa_full",
            shared=shared,
            seq=seq,
        )
        self.policy = policy
        if (
            policy.positions == "reindexed"
            and policy.cap is not None
            and not lc.llama_memory_can_shift(self.memory)
        ):
            self.close()
            raise EngineError(
                "this model's llama.cpp cache cannot shift positions",
                fix="use positions: absolute for this model",
            )
        self._held = 0
        self._evicted = 0
        self._next_pos = 0  # position the next token is written at
        self._oldest_unpinned = policy.sinks  # position of the oldest evictable token

    @property
    def held(self) -> int:
        return self._held

    @property
    def evicted(self) -> int:
        return self._evicted

    def room(self) -> int | None:
        return None if self.policy.cap is None else self.policy.cap - self._held

    def _evict(self, count: int) -> None:
        """Drop the `count` oldest unpinned tokens, as a decoder under this policy would."""
        first = self._oldest_unpinned
        if not lc.llama_memory_seq_rm(self.memory, self.seq, first, first + count):
            raise EngineError(
                f"llama_memory_seq_rm refused to remove positions {first}..{first + count}"
            )
        if self.policy.positions == "reindexed":
            lc.llama_memory_seq_add(self.memory, self.seq, first + count, -1, -count)
            self._next_pos -= count
        else:
            self._oldest_unpinned += count
        self._held -= count
        self._evicted += count
        self._check_positions()

    def _check_positions(self) -> None:
        # The engine's own view must agree with ours; a silent no-op eviction would not.
        pos_max = lc.llama_memory_seq_pos_max(self.memory, self.seq)
        pos_min = lc.llama_memory_seq_pos_min(self.memory, self.seq)
        expect_min = 0 if self.policy.sinks else self._oldest_unpinned
        if self.policy.positions == "reindexed":
            expect_min = 0
        expect_max = self._next_pos - 1
        if pos_max != expect_max or pos_min != expect_min:
            if self.policy.positions == "reindexed" and pos_max > expect_max:
                cause = "the survivors were not re-based (llama_memory_seq_add had no effect)"
            elif pos_min < expect_min:
                cause = "evicted cells are still held (llama_memory_seq_rm had no effect)"
            else:
                cause = "the engine did not evict as asked"
            raise EngineError(
                f"llama.cpp cache positions {pos_min}..{pos_max} after eviction, expected "
                f"{expect_min}..{expect_max}: {cause}"
            )

    def make_room(self, n: int) -> None:
        """Evict as the policy says until ``n`` more tokens fit under the cap."""
        cap = self.policy.cap
        if cap is None:
            return
        if n > cap - self.policy.sinks:
            raise ValueError(f"a batch of {n} cannot fit beside {self.policy.sinks} sinks in {cap}")
        while self._held + n > cap:
            self._evict(self.policy.evict_step)

    @property
    def next_pos(self) -> int:
        """The position the next token is written at."""
        return self._next_pos

    def took(self, n: int) -> None:
        """Account for ``n`` tokens just decoded at the next positions."""
        self._next_pos += n
        self._held += n

    def feed(self, token_ids: Sequence[int], logits: bool = True) -> np.ndarray:
        n = len(token_ids)
        if not 0 < n <= UBATCH:
            raise ValueError(f"feed 1..{UBATCH} tokens at a time, got {n}")
        self.make_room(n)
        self._decode(token_ids, self._next_pos, all_logits=logits)
        self.took(n)
        if not logits:
            return np.empty((0, self.engine.n_vocab), dtype=np.float32)
        return self.context.logits(n, self.engine.n_vocab)

    def figures(self) -> dict[str, float]:
        return self.memory_figures()

    def layer_sizes(self) -> list[tuple[int, int]]:
        return []  # llama.cpp holds the same cells in every layer of a non-SWA cache


@dataclass(frozen=True)
class _Checkpoint:
    n_tokens: int
    """Tokens in the cache when the sliding-layer state was copied."""
    data: bytes


class LlamaCppPrefixCache(_Sequence):
    """A prompt held in sequence 0; an edited prompt reuses what llama.cpp's memory still holds.

    With an iSWA cache (no swa_full) the sliding layers keep only the last window plus a ubatch
    of positions, so a prefix is usable only while they still hold the window before the split;
    otherwise the newest checkpoint at or before the split is restored, or the prompt is
    re-prefilled from token 0. llama-server does the same (its rule is one token stricter).
    """

    def __init__(self, engine: LlamaCppEngine, policy: Policy, max_tokens: int) -> None:
        if policy.checkpoints and not hasattr(lc, "llama_state_seq_get_size_ext"):
            raise KvguardError(
                "SWA checkpoints need llama-cpp-python 0.3.23 or later (llama_state_seq_*_ext); "
                f"this is {lc.__version__}",
                fix="upgrade llama-cpp-python, or leave checkpoints out of this check",
            )
        swa_full = policy.kind == "swa_full"
        super().__init__(engine, max_tokens + 1, swa_full=swa_full)
        self.policy = policy
        # With swa_full the sliding layers keep everything: for reuse they behave as full ones.
        self.n_swa = 0 if swa_full else int(lc.llama_model_n_swa(engine.model))
        self.checkpoints: list[_Checkpoint] = []

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        """Decode in ubatch-sized chunks, copying the sliding-layer state as the policy says."""
        for offset in range(0, len(token_ids), UBATCH):
            chunk = token_ids[offset : offset + UBATCH]
            self._decode(chunk, start + offset, all_logits=False)
            self._maybe_checkpoint(start + offset + len(chunk))

    def _maybe_checkpoint(self, n_tokens: int) -> None:
        policy = self.policy
        if not policy.checkpoints:
            return
        if self.checkpoints and n_tokens - self.checkpoints[-1].n_tokens < policy.checkpoint_step:
            return
        flags = lc.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
        size = lc.llama_state_seq_get_size_ext(self.ctx, SEQ, flags)
        buffer = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data_ext(self.ctx, buffer, size, SEQ, flags)
        if written != size:
            raise EngineError(f"llama.cpp wrote {written} of {size} checkpoint bytes")
        self.checkpoints.append(_Checkpoint(n_tokens, bytes(buffer)))
        del self.checkpoints[: -policy.checkpoints]  # keep the newest `checkpoints`

    def _window_held(self, keep: int) -> bool:
        """Do the sliding layers still hold every position the token at `keep` attends to?"""
        if not self.n_swa:
            return True
        oldest = lc.llama_memory_seq_pos_min(self.memory, SEQ)
        return bool(oldest <= max(0, keep - self.n_swa + 1))

    def keep_prefix(self, keep: int) -> tuple[int, int | None]:
        """Trim the cache to the longest usable prefix of `keep` tokens: (kept, checkpoint used)."""
        restored: int | None = None
        if keep and not self._window_held(keep):
            usable = [c for c in self.checkpoints if c.n_tokens <= keep]
            if not usable:
                keep = 0
            else:
                newest = usable[-1]
                data = (ctypes.c_uint8 * len(newest.data)).from_buffer_copy(newest.data)
                read = lc.llama_state_seq_set_data_ext(
                    self.ctx, data, len(newest.data), SEQ, lc.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
                )
                if read != len(newest.data):
                    raise EngineError(
                        f"llama.cpp restored {read} of {len(newest.data)} checkpoint bytes"
                    )
                keep = restored = newest.n_tokens
        if not lc.llama_memory_seq_rm(self.memory, SEQ, keep, -1) or (
            keep and lc.llama_memory_seq_pos_max(self.memory, SEQ) != keep - 1
        ):
            held = (
                f"{lc.llama_memory_seq_pos_min(self.memory, SEQ)}.."
                f"{lc.llama_memory_seq_pos_max(self.memory, SEQ)}"
            )
            hint = (
                ": swa_full was asked for, yet the sliding layers lost positions before the split"
                if self.policy.kind == "swa_full"
                else ""
            )
            raise EngineError(
                f"llama.cpp could not keep the first {keep} cached tokens (it holds positions "
                f"{held}){hint}"
            )
        if keep == 0:
            lc.llama_memory_seq_rm(self.memory, SEQ, -1, -1)
        # Checkpoints past the kept prefix describe tokens that are gone.
        self.checkpoints = [c for c in self.checkpoints if c.n_tokens <= keep]
        return keep, restored

    def save(self) -> tuple[bytes, list[_Checkpoint]]:
        """The whole context's state (llama_state_get_data: every cell of every layer, the
        sliding layers' out-of-window cells included) and the checkpoints taken so far."""
        size = lc.llama_state_get_size(self.ctx)
        buffer = (ctypes.c_uint8 * size)()
        written = lc.llama_state_get_data(self.ctx, buffer, size)
        if written != size:
            raise EngineError(f"llama.cpp wrote {written} of {size} state bytes")
        return bytes(buffer), list(self.checkpoints)

    def restore(self, saved: object) -> None:
        assert isinstance(saved, tuple)
        state: bytes = saved[0]
        checkpoints: list[_Checkpoint] = saved[1]
        data = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        read = lc.llama_state_set_data(self.ctx, data, len(state))
        if read != len(state):
            raise EngineError(f"llama.cpp restored {read} of {len(state)} state bytes")
        self.checkpoints = list(checkpoints)

    def memory_bytes(self) -> dict[str, float]:
        return {
            # The whole context state: every KV cell held (sliding layers included, all of them
            # with swa_full) plus the small output buffer. The per-sequence state would leave out
            # sliding-layer cells outside the window, so swa and swa_full would look the same.
            "state_bytes": float(lc.llama_state_get_size(self.ctx)),
            "checkpoint_bytes": float(sum(len(c.data) for c in self.checkpoints)),
            "checkpoints": float(len(self.checkpoints)),
        }
