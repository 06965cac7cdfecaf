"""kvguard's stream runs against the loop a person would write by hand, on the same token ids.

    .venv/bin/python benchmarks/stream_loop.py [--tokens 1500] [--engines mlx,llama_cpp]

For each engine, on the bundled SmolLM2 with a cap of 256: the hand-written loop (a cache of
the engine's own, prefill to the cap, then evict, decode one token, score) for sink4, against
kvguard's ``run_stream`` for the same policy; then five policies (sinks 0, 1, 2, 4, 8): five
hand-written runs against kvguard's ``run_streams``, which decodes them together where the
engine allows it. Prints wall times and the ratios, all measured in this one run. Not a test:
wall time is reported, never asserted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import numpy as np

from pytest_kvguard.core.policies import Policy, make_policy
from pytest_kvguard.core.scoring import nll_of, perplexity
from pytest_kvguard.engines import Engine, EngineOptions
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import pydoc_topics
from pytest_kvguard.scenarios.feeding import run_stream, run_streams

CAP = 256
SINK_COUNTS = (0, 1, 2, 4, 8)


def hand_loop_mlx(engine: Engine, sinks: int, ids: Sequence[int]) -> np.ndarray:
    """mlx-lm as its docs show it: a RotatingKVCache per layer, the prompt, then one token at
    a time, each next token scored from the logits as they come."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    model = engine.model  # type: ignore[attr-defined]
    targets = np.asarray(ids[1:])
    cache = [RotatingKVCache(max_size=CAP, keep=sinks) for _ in model.layers]
    first = CAP - sinks  # a first call that leaves room for the sinks, as kvguard's does
    scores = []
    for start, end in ((0, first), (first, CAP)) if sinks else ((0, CAP),):
        rows = np.array(model(mx.array(ids[start:end])[None], cache=cache)[0].astype(mx.float32))
        scores.append(nll_of(rows, targets[start:end]))
    for i in range(CAP, len(ids) - 1):
        row = np.array(model(mx.array([[ids[i]]]), cache=cache)[0].astype(mx.float32))
        scores.append(nll_of(row, targets[i : i + 1]))
    return np.concatenate(scores)


def hand_loop_llama(engine: Engine, sinks: int, ids: Sequence[int]) -> np.ndarray:
    """llama.cpp's C API as its examples use it: one context of CAP cells, the prompt in one
    batch, then per token: seq_rm the oldest unpinned cell, seq_add the rest down, decode,
    score."""
    import llama_cpp as lc

    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = CAP, 512, 512
    params.n_threads = params.n_threads_batch = engine.options.n_threads  # type: ignore[attr-defined]
    ctx = lc.llama_init_from_model(engine.model, params)  # type: ignore[attr-defined]
    memory = lc.llama_get_memory(ctx)
    n_vocab = engine.n_vocab  # type: ignore[attr-defined]
    batch = lc.llama_batch_init(512, 0, 1)
    targets = np.asarray(ids[1:])
    scores: list[np.ndarray] = []

    def decode(start: int, end: int, first_pos: int) -> None:
        batch.n_tokens = end - start
        for i, token in enumerate(ids[start:end]):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, first_pos + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(end - start, n_vocab))
        scored = min(end, len(ids) - 1) - start
        scores.append(nll_of(rows[:scored], targets[start : start + scored]))

    try:
        first = CAP - sinks
        decode(0, first, 0)
        if sinks:
            decode(first, CAP, first)
        pos = CAP
        for i in range(CAP, len(ids)):
            lc.llama_memory_seq_rm(memory, 0, sinks, sinks + 1)
            lc.llama_memory_seq_add(memory, 0, sinks + 1, -1, -1)
            pos -= 1
            decode(i, i + 1, pos)
            pos += 1
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    return np.concatenate(scores)


def timed(work: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def policy_for(engine_name: str, sinks: int) -> Policy:
    positions = "absolute" if engine_name == "mlx" else "reindexed"
    kind = "sink" if sinks else "window"
    return make_policy(kind, cap=CAP, sinks=sinks or None, positions=positions)


def bench(runner: Runner, engine_name: str, tokens: int) -> None:
    model = ModelRef("smollm2-135m")
    engine = runner.engine(engine_name, model)
    ids = runner.token_ids(engine_name, model, pydoc_topics(), tokens)
    hand = hand_loop_mlx if engine_name == "mlx" else hand_loop_llama
    sink4 = policy_for(engine_name, 4)
    # Warm both paths up once (first allocations, lazy initialisation): not timed.
    hand(engine, 4, ids[: CAP + 8])
    run_stream(engine, sink4, ids[: CAP + 8])
    hand_one_s, hand_nll = timed(lambda: hand(engine, 4, ids))
    ours_one_s, ours = timed(lambda: run_stream(engine, sink4, ids))
    gap = perplexity(ours.nll[CAP:]) / perplexity(hand_nll[CAP:]) - 1  # type: ignore[attr-defined,index]
    print(f"{engine_name}: 1 policy (sink4/{CAP}), {tokens} tokens: "
          f"hand-written {hand_one_s:.1f} s, kvguard {ours_one_s:.1f} s, "
          f"ratio {ours_one_s / hand_one_s:.2f}x "
          f"(post-cap perplexity gap {gap * 100:+.3f}%)", flush=True)  # fmt: skip
    hand_five_s, hand_runs = 0.0, []
    for count in SINK_COUNTS:
        seconds, nll = timed(lambda count=count: hand(engine, count, ids))
        hand_five_s += seconds
        hand_runs.append(nll)
    policies = [policy_for(engine_name, s) for s in SINK_COUNTS]
    ours_five_s, grouped = timed(lambda: run_streams(engine, policies, ids))
    worst = max(
        abs(perplexity(run.nll[CAP:]) / perplexity(nll[CAP:]) - 1)  # type: ignore[index]
        for run, nll in zip(grouped, hand_runs, strict=True)  # type: ignore[call-overload]
    )
    print(f"{engine_name}: 5 policies (sinks {list(SINK_COUNTS)}): "
          f"hand-written {hand_five_s:.1f} s, kvguard {ours_five_s:.1f} s, "
          f"ratio {ours_five_s / hand_five_s:.2f}x "
          f"(largest post-cap perplexity gap {worst * 100:.3f}%)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--engines", default="mlx,llama_cpp")
    args = parser.parse_args()
    runner = Runner(EngineOptions.from_env())
    try:
        for name in args.engines.split(","):
            bench(runner, name, args.tokens)
    finally:
        runner.close()


if __name__ == "__main__":
    main()
