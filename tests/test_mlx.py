"""Real mlx-lm (CPU on Linux) on the bundled models: its own caches, exact cache bytes, parity."""

from __future__ import annotations

import ctypes.util
import sys

import pytest

from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.core.scoring import perplexity
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import pydoc_topics
from pytest_kvguard.scenarios.feeding import run_stream

pytestmark = pytest.mark.mlx
SMOLLM2 = ModelRef("smollm2-135m")


@pytest.fixture(scope="module")
def short_ids(kvguard_runner: Runner) -> list[int]:
    return kvguard_runner.token_ids("mlx", SMOLLM2, pydoc_topics(), 100)


def test_policies_are_mlx_lms_own_caches(kvguard_runner: Runner) -> None:
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from pytest_kvguard.engines.mlx.caches import make_caches

    engine = kvguard_runner.engine("mlx", SMOLLM2)
    model = engine.model  # type: ignore[attr-defined]
    sink = make_caches(model, make_policy("sink", cap=256, sinks=4, positions="absolute"))
    assert all(type(c) is RotatingKVCache and (c.keep, c.max_size) == (4, 256) for c in sink)
    window = make_caches(model, make_policy("window", cap=256, positions="absolute"))
    assert all(type(c) is RotatingKVCache and c.keep == 0 for c in window)
    assert all(type(c) is KVCache for c in make_caches(model, make_policy("full")))
    # engine_default is whatever mlx-lm hands a user who asks for a cap; on llama it is make_cache.
    default = make_caches(model, make_policy("engine_default", cap=256, positions="absolute"))
    asked = make_prompt_cache(model, max_kv_size=256)
    assert [type(c) for c in default] == [type(c) for c in asked]


def test_cache_bytes_match_the_formula(kvguard_runner: Runner, short_ids: list[int]) -> None:
    engine = kvguard_runner.engine("mlx", SMOLLM2)
    run = run_stream(engine, make_policy("sink", cap=64, sinks=4, positions="absolute"), short_ids)
    # 30 layers x K,V x 3 KV heads x head dim 64 x 4 bytes (float32 weights give a float32 cache).
    assert run.engine_figures["kv_bytes"] == 30 * 2 * 3 * 64 * 4 * 64
    assert run.layer_sizes == [(100, 64)] * 30
    assert run.first_eviction == 64 and run.evicted == 36


def test_the_report_says_which_blas_path_ran(kvguard_runner: Runner) -> None:
    engine = kvguard_runner.engine("mlx", SMOLLM2)
    blas = engine.describe()["blas"]
    if sys.platform == "linux" and ctypes.util.find_library("openblas"):
        assert blas.startswith("OpenBLAS")
    else:
        assert "OpenBLAS" not in blas


@pytest.mark.llama_cpp
@pytest.mark.kv_budget(max_mean_abs_nll_diff=0.1, max_ppl_diff_pct=2)
def test_parity_marker(kvguard, kvguard_runner: Runner) -> None:  # type: ignore[no-untyped-def]
    outcome = kvguard.parity(engines=("llama_cpp", "mlx"), tokens=256)
    # The reference is llama.cpp's own full-cache run on the same ids, run again here: bitwise.
    ids = kvguard_runner.token_ids("llama_cpp", SMOLLM2, pydoc_topics(), 256)
    direct = run_stream(kvguard_runner.engine("llama_cpp", SMOLLM2), make_policy("full"), ids)
    assert outcome.metrics["reference_ppl"] == perplexity(direct.nll)


def test_a_quantized_cache_is_mlx_lms_own_and_holds_the_predicted_bytes(
    kvguard_runner: Runner, short_ids: list[int]
) -> None:
    from mlx_lm.models.cache import QuantizedKVCache

    from pytest_kvguard.engines.kv_size import predict_engine_kv_bytes
    from pytest_kvguard.inputs.models import read_arch

    engine = kvguard_runner.engine("mlx", SMOLLM2)
    full = run_stream(engine, make_policy("full"), short_ids)
    policy = make_policy("full", kv_bits=8)
    stream = engine.open_stream(policy, len(short_ids))
    try:
        stream.feed(short_ids[:60])
        assert all(type(c) is QuantizedKVCache and c.bits == 8 for c in stream.cache)  # type: ignore[attr-defined]
        assert stream.quantized_from == 60 and stream.held == 60
    finally:
        stream.close()
    q8 = run_stream(engine, policy, short_ids)
    predicted = predict_engine_kv_bytes(
        "mlx", read_arch(SMOLLM2.resolve()), 100, policy, element_bytes=engine.kv_element_bytes
    )
    assert q8.engine_figures["kv_bytes"] == predicted  # 256 rows x 30 layers x (64 + 8) x 3 x 2
    assert q8.engine_figures["kv_layers_unquantized"] == 0
    # The first call (100 tokens, one prefill chunk) ran before quantization; the scores match.
    assert q8.quantized_from == 100
    assert perplexity(q8.nll) == pytest.approx(perplexity(full.nll), rel=1e-4)


def test_mlx_lm_refuses_to_quantize_a_rotating_cache_in_one_line(
    kvguard_runner: Runner, short_ids: list[int]
) -> None:
    from pytest_kvguard.core.errors import EngineRefusal

    engine = kvguard_runner.engine("mlx", SMOLLM2)
    policy = make_policy("sink", cap=64, sinks=4, positions="absolute", kv_bits=4)
    with pytest.raises(EngineRefusal) as refused:
        run_stream(engine, policy, short_ids)
    assert refused.value.message.startswith("mlx-lm ")
    assert "refuses to quantize RotatingKVCache to 4 bits (sink4/64 abs step1 q4)" in str(
        refused.value
    )


@pytest.mark.parametrize(("model", "policy"), [("smollm2-135m", "full"), ("gemma3-270m", "swa")])
def test_the_api_paths_batched_reply_scores_as_token_by_token_decoding(
    kvguard_runner: Runner, model: str, policy: str
) -> None:
    """edit_replay's mlx API path scores the forced reply's tokens after the first in one call
    of the model (generate_step costs 0.1 to 0.16 s a token here): the same log-probabilities
    as generate_step forcing them one at a time, on a full cache and on Gemma 3's own cache
    (its sliding layers wrapped: 600 prompt tokens past its 512 window). Measured here: 8.7e-6
    and 1.5e-5 nats at most, the model's one-row and 47-row float32 sums; scoring one half
    with mlx's float32 logsumexp instead read 2.4e-4 and 8.2e-4 apart."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    from pytest_kvguard.engines.mlx.api_cache import MlxApiCache, forcing_processor
    from pytest_kvguard.engines.mlx.caches import make_caches
    from pytest_kvguard.inputs.chats import reply_ids

    engine = kvguard_runner.engine("mlx", ModelRef(model))
    prompt = kvguard_runner.token_ids("mlx", ModelRef(model), pydoc_topics(), 600)
    reply = reply_ids(engine.tokenize, 48)
    api = MlxApiCache(engine, make_policy(policy))  # type: ignore[arg-type]
    batched = np.array(api._score(prompt, make_caches(engine.model, make_policy(policy)), reply))
    nll: list[float] = []
    steps = generate_step(
        mx.array(prompt), engine.model, max_tokens=len(reply),
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
        logits_processors=[forcing_processor(reply, nll)],
        prompt_cache=make_caches(engine.model, make_policy(policy)),
    )  # fmt: skip
    assert [int(token) for token, _ in steps] == reply
    one_by_one = np.array(nll)
    assert len(batched) == len(one_by_one) == 48
    assert batched[0] == one_by_one[0]  # both from generate_step's prefill
    assert np.abs(batched - one_by_one).max() < 1e-4, np.abs(batched - one_by_one).max()
