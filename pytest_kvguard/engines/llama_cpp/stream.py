"""A llama.cpp stream: a policy applied with llama.cpp's own memory operations.

Eviction is ``llama_memory_seq_rm`` on the oldest unpinned cells; re-indexed positions then
shift the survivors down with ``llama_memory_seq_add`` (which re-rotates the RoPE keys),
exactly as llama.cpp's context shift does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import llama_cpp as lc
import numpy as np

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.llama_cpp.context import SEQ, UBATCH, CacheSequence, Context

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine


class LlamaCppStream(CacheSequence):
    """A stream under a policy applied by seq_rm (eviction) and seq_add (re-indexing)."""

    def __init__(
        self, engine: LlamaCppEngine, policy: Policy, max_tokens: int,
        shared: Context | None = None, seq: int = SEQ,
    ) -> None:  # fmt: skip
        # A capped policy never holds more than `cap`; swa and swa_full leave the sliding
        # layers to llama.cpp's own cache (iSWA, or full-size with swa_full).
        super().__init__(
            engine,
            policy.cap if policy.cap is not None else max_tokens,
            swa_full=policy.kind == "swa_full",
            shared=shared,
            seq=seq,
            cache_types=(policy.cache_type_k, policy.cache_type_v),
        )
        self.policy = policy
        self.quantized_from = 0 if policy.quantized else None
        """llama.cpp writes every cell in the context's cache types, from the first token."""
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
