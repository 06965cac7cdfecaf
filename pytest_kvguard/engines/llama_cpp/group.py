"""Stream groups on llama.cpp: several policies as sequences of one context, decoded together.

Each sequence has cells of its own (``kv_unified`` off), is evicted with its own seq_rm /
seq_add, and attends to its own cells only, as in a context of its own; one decode step sends
one token per sequence in one ``llama_decode``. A row reports what a context of its own would:
the buffers such a context allocates and the state size it writes, measured once on contexts
made for the purpose (``solo_facts``, ``state_header_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llama_cpp as lc
import numpy as np

from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.llama_cpp.context import SEQ, Context
from pytest_kvguard.engines.llama_cpp.stream import LlamaCppStream

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine

PROBE_CELLS = 256
"""Cells per sequence of the context ``state_header_bytes`` measures (llama.cpp's padding)."""


@dataclass(frozen=True)
class SoloFacts:
    """A stream's context of its own, as measured on one made for the purpose."""

    can_shift: bool
    """Whether its cache can shift positions (re-indexing)."""
    kv_buffer_bytes: float
    """The K and V buffers llama.cpp allocated for it (from its log)."""
    compute_buffer_bytes: float
    """The compute buffer llama.cpp allocated for it (from its log)."""


def solo_facts(engine: LlamaCppEngine, n_ctx: int) -> SoloFacts:
    """What a context of its own with ``n_ctx`` cells (a stream's) allocates; measured once per
    model and size."""
    key = ("solo", n_ctx)
    if key not in engine.probes:
        alone = Context(engine, n_ctx)
        try:
            engine.probes[key] = SoloFacts(
                can_shift=bool(lc.llama_memory_can_shift(alone.memory)),
                kv_buffer_bytes=alone.kv_buffer_bytes,
                compute_buffer_bytes=alone.compute_buffer_bytes,
            )
        finally:
            alone.close()
    facts: SoloFacts = engine.probes[key]
    return facts


def state_header_bytes(engine: LlamaCppEngine, n_ctx: int, n_seq: int) -> int:
    """What a context of its own with ``n_ctx`` cells writes in ``llama_state_get_size`` beyond
    what one of ``n_seq`` sequences of a shared context, holding the same cells, writes in
    ``llama_state_seq_get_size``: header fields only. Measured once per model, size and
    sequence count on one decoded token (llama-cpp-python 0.3.36: -3 bytes with 2 sequences,
    4 bytes less for each sequence more, the same at 1, 5 and 100 cells)."""
    key = ("header", n_ctx, n_seq)
    if key not in engine.probes:
        token = max(0, int(lc.llama_vocab_bos(engine.vocab)))
        alone = Context(engine, n_ctx)
        try:
            alone.decode([token], [0], [SEQ], all_logits=False)
            solo_size = int(lc.llama_state_get_size(alone.ctx))
        finally:
            alone.close()
        shared = Context(engine, PROBE_CELLS * n_seq, n_seq=n_seq)
        try:
            shared.decode([token], [0], [SEQ], all_logits=False)
            engine.probes[key] = solo_size - int(lc.llama_state_seq_get_size(shared.ctx, SEQ))
        finally:
            shared.close()
    header: int = engine.probes[key]
    return header


class GroupRow(LlamaCppStream):
    """One sequence of a group's shared context, reporting what a stream of its own would."""

    def memory_figures(self) -> dict[str, float]:
        """Its sequence's state plus the header a context of its own writes (a group holds no
        iSWA cache, so the sequence's state is all its cells), and the buffers such a context
        allocates."""
        solo = solo_facts(self.engine, self.n_ctx)
        header = state_header_bytes(self.engine, self.n_ctx, self.context.n_seq)
        kv_bytes = float(lc.llama_state_seq_get_size(self.ctx, self.seq) + header)
        return self._figures(kv_bytes, solo.kv_buffer_bytes, solo.compute_buffer_bytes)


class LlamaCppStreamGroup:
    """Streams that are sequences of one shared context, one policy each, each with its own
    token ids (tests/test_batched_runs.py compares every row with the same stream alone)."""

    def __init__(self, engine: LlamaCppEngine, policies: Sequence[Policy], max_tokens: int) -> None:
        cells = max(padded(p.cap or max_tokens) for p in policies)
        self.engine = engine
        self.context = Context(engine, cells * len(policies), n_seq=len(policies))
        self.streams: list[GroupRow] = []
        try:
            for seq, policy in enumerate(policies):
                self.streams.append(
                    GroupRow(engine, policy, max_tokens, shared=self.context, seq=seq)
                )
        except BaseException:
            self.close()
            raise

    def feed_rows(self, rows: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        chosen = [self.streams[row] for row in rows]
        for stream in chosen:
            stream.make_room(1)
        self.context.decode(
            token_ids,
            [stream.next_pos for stream in chosen],
            [stream.seq for stream in chosen],
            all_logits=True,
        )
        for stream in chosen:
            stream.took(1)
        return self.context.logits(len(chosen), self.engine.n_vocab)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
        self.context.close()


def padded(cells: int) -> int:
    """llama.cpp's own rounding of a context's cell count (a multiple of 256)."""
    return -(-cells // 256) * 256
