"""A llama.cpp prefix cache (edit_replay): a prompt held in sequence 0, reused as far as
llama.cpp's memory (and its SWA checkpoints) still allow."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llama_cpp as lc
import numpy as np

from pytest_kvguard.core.errors import EngineError, KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.core.scoring import nll_of
from pytest_kvguard.engines.llama_cpp.context import SEQ, UBATCH, CacheSequence

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine


@dataclass(frozen=True)
class Checkpoint:
    n_tokens: int
    """Tokens in the cache when the sliding-layer state was copied."""
    data: bytes


def window_missing(kept: int, oldest_held: int, n_swa: int) -> int:
    """Positions the token at ``kept`` attends to in the sliding layers (the ``n_swa - 1``
    before it) that a cache whose oldest position is ``oldest_held`` (-1: none, as when a
    seq_rm emptied the sliding cells) no longer has. The one window rule of both paths."""
    if not kept or not n_swa:  # nothing kept, or no sliding window
        return 0
    oldest = kept if oldest_held < 0 else min(oldest_held, kept)
    return max(0, oldest - max(0, kept - n_swa + 1))


class LlamaCppPrefixCache(CacheSequence):
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
        # Flash attention off, as llama-cpp-python's Llama has it by default. With it on
        # (llama.cpp's auto: on, on the CPU) the scores depend on how the prefill was split
        # into batches, so a prefix kept from the first prompt's batches and the same prefix
        # prefilled again predict differently even when the reuse is right (docs/scenarios/
        # edit_replay.md has the figures), and the reuse gap would measure the kernel.
        super().__init__(engine, max_tokens + 1, swa_full=swa_full, flash_attn=False)
        self.policy = policy
        # The window is checked with swa_full too: there the sliding layers must hold it (all
        # of history), and a cache that does not is llama.cpp not honouring the flag.
        self.n_swa = engine.n_swa
        self.checkpoints: list[Checkpoint] = []

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        """Decode in ubatch-sized chunks, copying the sliding-layer state as the policy says."""
        for offset in range(0, len(token_ids), UBATCH):
            chunk = token_ids[offset : offset + UBATCH]
            self._decode(chunk, start + offset, all_logits=False)
            self._maybe_checkpoint(start + offset + len(chunk))

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        """Decode ``token_ids[:-1]`` with logits for each; -log p of each next token."""
        decoded, targets = token_ids[:-1], np.asarray(token_ids[1:])
        nll = []
        for offset in range(0, len(decoded), UBATCH):
            chunk = decoded[offset : offset + UBATCH]
            self._decode(chunk, start + offset, all_logits=True)
            logits = self.context.logits(len(chunk), self.engine.n_vocab)
            nll.append(nll_of(logits, targets[offset : offset + len(chunk)]))
        return np.concatenate(nll) if nll else np.zeros(0)

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
        self.checkpoints.append(Checkpoint(n_tokens, bytes(buffer)))
        del self.checkpoints[: -policy.checkpoints]  # keep the newest `checkpoints`

    def _window_held(self, keep: int) -> bool:
        """Do the sliding layers still hold every position the token at `keep` attends to?"""
        oldest = int(lc.llama_memory_seq_pos_min(self.memory, SEQ))
        return window_missing(keep, oldest, self.n_swa) == 0

    def _held(self) -> str:
        """The positions the sequence holds, as llama.cpp says: ``713..1736``."""
        return (f"{lc.llama_memory_seq_pos_min(self.memory, SEQ)}.."
                f"{lc.llama_memory_seq_pos_max(self.memory, SEQ)}")  # fmt: skip

    def keep_prefix(self, keep: int) -> tuple[int, int | None]:
        """Trim the cache to the longest usable prefix of `keep` tokens: (kept, checkpoint used)."""
        restored: int | None = None
        if keep and not self._window_held(keep):
            if self.policy.kind == "swa_full":
                raise EngineError(
                    f"llama.cpp could not keep the first {keep} cached tokens (it holds "
                    f"positions {self._held()}): swa_full was asked for, yet the sliding layers "
                    "no longer hold the window before the split"
                )
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
            raise EngineError(
                f"llama.cpp could not keep the first {keep} cached tokens (it holds positions "
                f"{self._held()})"
            )
        if keep == 0:
            lc.llama_memory_seq_rm(self.memory, SEQ, -1, -1)
        # Checkpoints past the kept prefix describe tokens that are gone.
        self.checkpoints = [c for c in self.checkpoints if c.n_tokens <= keep]
        return keep, restored

    def save(self) -> tuple[bytes, list[Checkpoint]] | None:
        """The whole context's state (llama_state_get_data: every cell of every layer, the
        sliding layers' out-of-window cells included) and the checkpoints taken so far; None
        for a model with sliding layers, whose first prompt each check prefills itself.

        A restored iSWA state is not prediction-neutral (llama.cpp#18552; llama.cpp#25297,
        open, places the sliding cells differently on load): on Gemma 3 270M the forced reply
        after llama_state_set_data scores 0.069 nats (760-token chat) to 0.086 (4,153) from
        the context the state was saved from, although saving again gives the same bytes.
        SmolLM2 (no sliding layers): 0 exactly. Shared, the restore would be the reuse gap.
        """
        if self.engine.n_swa:
            return None
        size = lc.llama_state_get_size(self.ctx)
        buffer = (ctypes.c_uint8 * size)()
        written = lc.llama_state_get_data(self.ctx, buffer, size)
        if written != size:
            raise EngineError(f"llama.cpp wrote {written} of {size} state bytes")
        return bytes(buffer), list(self.checkpoints)

    def restore(self, saved: object) -> None:
        assert isinstance(saved, tuple)
        state: bytes = saved[0]
        checkpoints: list[Checkpoint] = saved[1]
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
