"""The engines' batched path past capacity, read from the engines themselves.

README's explanation of chunked feeding ("which tokens can a query of a chunk see?") is
asserted here: on mlx-lm from its own cache and mask, on llama.cpp from its cache state and
from what its batched decode computes.
"""

from __future__ import annotations

import numpy as np
import pytest

from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.engines.conversation import plan_turns
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import pydoc_topics
from pytest_kvguard.scenarios.feeding import chunks, run_stream

pytestmark = pytest.mark.engine  # each test names its engine below
SMOLLM2 = ModelRef("smollm2-135m")
CAP, SINKS, CHUNK = 256, 4, 64


def stream_schedule(fed: int) -> list[int]:
    """The call sizes kvguard's stream uses for ``fed`` tokens under sink4/256, chunk 1."""

    class Room:  # the room a sink4/256 cache has left after `held` tokens
        held = 0

        def room(self) -> int:
            return CAP - min(self.held, CAP)

    room, sizes = Room(), []
    for size in chunks(room, make_policy("sink", cap=CAP, sinks=SINKS), fed):  # type: ignore[arg-type]
        sizes.append(size)
        room.held += size
    return sizes


@pytest.mark.mlx
def test_mlx_chunk_queries_lose_the_sinks_one_by_one() -> None:
    """mlx-lm's mask slides over the concatenated keys: query i misses sinks 0..i-1."""
    from pytest_kvguard.engines.mlx.caches import chunk_visibility

    fed = 356  # 100 tokens past the cap, fed one at a time
    schedule = stream_schedule(fed)
    assert schedule[:2] == [CAP - SINKS, SINKS] and set(schedule[2:]) == {1}
    decode = chunk_visibility(CAP, SINKS, [*schedule, 1])[0]
    assert decode == [0, 1, 2, 3, *range(fed - CAP + SINKS + 1, fed + 1)]  # the sinks + 252
    seen = chunk_visibility(CAP, SINKS, [*schedule, CHUNK])
    for i, visible in enumerate(seen):
        position = fed + i
        assert len(visible) == CAP  # every query sees `cap` keys ...
        assert [p for p in visible if p < SINKS] == list(range(i, SINKS))  # ... sinks i..3 only
        window = [p for p in visible if p >= SINKS]
        assert window == list(range(position - len(window) + 1, position + 1))  # contiguous


@pytest.mark.mlx
def test_mlx_real_cache_holds_the_concatenated_keys(kvguard_runner: Runner) -> None:
    """After a real chunk through the real model, each layer holds cap - 1 + chunk keys: what
    chunk_visibility's cache held, so its masks are the ones the model used."""
    import mlx.core as mx

    engine = kvguard_runner.engine("mlx", SMOLLM2)
    ids = kvguard_runner.token_ids("mlx", SMOLLM2, pydoc_topics(), 356 + CHUNK)
    stream = engine.open_stream(make_policy("sink", cap=CAP, sinks=SINKS, positions="absolute"),
                                len(ids))  # fmt: skip
    done = 0
    for size in [*stream_schedule(356), CHUNK]:
        stream.feed(ids[done : done + size], logits=False)
        done += size
    caches = stream.cache  # type: ignore[attr-defined]
    mx.eval([c.keys for c in caches])
    assert {c.keys.shape[2] for c in caches} == {CAP - 1 + CHUNK}
    assert {c.offset for c in caches} == {356 + CHUNK}
    assert stream.held == CAP  # mlx-lm's own size() counts the window, not the buffer
    stream.close()


@pytest.mark.llama_cpp
def test_llama_cpp_chunk_keeps_the_sinks(kvguard_runner: Runner) -> None:
    """llama.cpp evicts for the whole chunk first, keeps the sinks, and each query of the batch
    sees exactly what a one-token decode after the same eviction sees: the sinks, the window
    left, and the chunk up to itself."""
    import llama_cpp as lc

    from pytest_kvguard.engines.llama_cpp.stream import LlamaCppStream

    engine = kvguard_runner.engine("llama_cpp", SMOLLM2)
    fed, cap, chunk = 80, 64, 8
    ids = kvguard_runner.token_ids("llama_cpp", SMOLLM2, pydoc_topics(), fed + chunk)
    policy = make_policy("sink", cap=cap, sinks=SINKS, positions="absolute", chunk=chunk)

    def fill() -> LlamaCppStream:
        stream = engine.open_stream(policy, fed + chunk)
        assert isinstance(stream, LlamaCppStream)
        stream.feed(ids[: cap - SINKS], logits=False)
        stream.feed(ids[cap - SINKS : cap], logits=False)
        for token in ids[cap:fed]:
            stream.feed([token], logits=False)
        return stream

    batched = fill()
    rows = batched.feed(ids[fed:])  # one llama_decode of 8 tokens, after evicting 8
    memory = lc.llama_get_memory(batched.ctx)
    assert lc.llama_memory_seq_pos_min(memory, 0) == 0  # the first sink is still held
    assert lc.llama_memory_seq_pos_max(memory, 0) == fed + chunk - 1
    assert batched.held == cap and batched.evicted == fed + chunk - cap
    # Without the sinks, what is left starts where the chunk's eviction stopped: the queries saw
    # positions 0..3 and, of the window, the cap - chunk - sinks newest before the chunk.
    lc.llama_memory_seq_rm(memory, 0, 0, SINKS)
    oldest_kept = fed - (cap - chunk - SINKS)
    assert lc.llama_memory_seq_pos_min(memory, 0) == oldest_kept  # 28: 60 cells to 87 with 4 sinks
    batched.close()

    sequential = fill()
    sequential._evict(chunk)  # the same cells the batch evicted, then one token per decode
    single = np.stack([sequential.feed([token])[0] for token in ids[fed:]])
    assert sequential.held == cap
    sequential.close()
    # Measured here: bitwise equal (0.0); against a sequential run that lost its sinks instead,
    # up to 11.9. The tolerance leaves room for builds whose batched matmuls round differently.
    assert np.abs(rows - single).max() < 0.05


@pytest.mark.llama_cpp
def test_llama_cpp_converse_scores_only_the_replies(kvguard_runner: Runner) -> None:
    engine = kvguard_runner.engine("llama_cpp", SMOLLM2)
    ids = kvguard_runner.token_ids("llama_cpp", SMOLLM2, pydoc_topics(), 200)
    policy = make_policy("sink", cap=64, sinks=SINKS)
    turns = plan_turns(200, 30, 10)
    nll = engine.converse(policy, ids, turns, 2048)
    scored = np.flatnonzero(~np.isnan(nll))
    # Turn k's reply tokens sit at 40k+30 .. 40k+39: nll[i] scores token i+1.
    assert list(scored) == [40 * k + 30 + j - 1 for k in range(5) for j in range(10)]
    assert (nll[scored] > 0).all()
    # Prompts prefilled one token at a time make the whole conversation the decode path: each
    # reply score is then the loop's own score at that position (llama.cpp's context shift).
    decoded = engine.converse(policy, ids, turns, 1)
    loop = run_stream(engine, policy, ids)
    np.testing.assert_allclose(decoded[scored], loop.nll[scored], rtol=1e-4, atol=1e-4)
