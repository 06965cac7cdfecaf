"""The attention scenario: the probabilities read from each real engine are its softmax(QK^T),
and the sink figures drawn from them."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import pydoc_topics
from pytest_kvguard.scenarios.attention import default_queries, sink_figures, with_bos

SMOLLM2 = ModelRef("smollm2-135m")
GEMMA3 = ModelRef("gemma3-270m")
ROWS = [100, 200, 299]
"""Query positions compared with an explicit softmax."""


def explicit_softmax(q: np.ndarray, k: np.ndarray, scale: float, rows: list[int]) -> np.ndarray:
    """softmax(Q K^T * scale) under a causal mask, float64: q (head, token, dim) of the query
    rows, k (kv head, token, dim) of every token; query head h reads key head h // repeats."""
    repeats = q.shape[0] // k.shape[0]
    k = np.repeat(k.astype(np.float64), repeats, axis=0)
    scores = np.einsum("hrd,htd->hrt", q.astype(np.float64), k) * scale
    causal = np.arange(k.shape[1])[None, None, :] <= np.array(rows)[None, :, None]
    scores = np.where(causal, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    weights = np.exp(scores)
    result: np.ndarray = weights / weights.sum(-1, keepdims=True)
    return result


@pytest.mark.llama_cpp
@pytest.mark.parametrize("model", [SMOLLM2, GEMMA3], ids=["smollm2", "gemma3"])
def test_llama_cpp_probabilities_are_softmax_of_its_own_q_and_k(
    kvguard_runner: Runner, model: ModelRef
) -> None:
    from pytest_kvguard.engines.llama_cpp.attention import SOFTMAX, capture

    engine: Any = kvguard_runner.engine("llama_cpp", model)
    ids = kvguard_runner.token_ids("llama_cpp", model, pydoc_topics(), 300)
    # Every row: Kcur is needed at every position the query rows attend to.
    tensors = capture(engine, ids, range(300), prefixes=(SOFTMAX, "Qcur", "Kcur"))
    n_layers = sum(name.startswith(SOFTMAX) for name in tensors)
    assert n_layers == {SMOLLM2: 30, GEMMA3: 18}[model]
    for layer in range(n_layers):
        probs = tensors[f"{SOFTMAX}-{layer}"][0]  # (head, row, key)
        np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
        q = tensors[f"Qcur-{layer}"][0].transpose(1, 0, 2)[:, ROWS]  # (head, row, dim)
        k = tensors[f"Kcur-{layer}"][0].transpose(1, 0, 2)
        expected = explicit_softmax(q, k, q.shape[-1] ** -0.5, ROWS)
        # K is read back from llama.cpp's f16 cache: a few 1e-3 of rounding, not more.
        np.testing.assert_allclose(probs[:, ROWS], expected, atol=3e-3)


@pytest.mark.mlx
@pytest.mark.parametrize("model", [SMOLLM2, GEMMA3], ids=["smollm2", "gemma3"])
def test_mlx_probabilities_are_softmax_of_the_layer_inputs(
    kvguard_runner: Runner, model: ModelRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx

    from pytest_kvguard.engines.mlx.attention import capture, model_module

    engine: Any = kvguard_runner.engine("mlx", model)
    ids = kvguard_runner.token_ids("mlx", model, pydoc_topics(), 300)
    attention_class = type(engine.model.layers[0].self_attn)
    assert model_module(engine.model).__name__ == attention_class.__module__
    inputs: list[Any] = []
    original_call = attention_class.__call__

    def recording_call(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        inputs.append((self, x))
        return original_call(self, x, *args, **kwargs)

    monkeypatch.setattr(attention_class, "__call__", recording_call)
    probs, reconstruction_error, learned_sinks = capture(engine.model, ids, ROWS)
    assert not learned_sinks
    assert reconstruction_error < 1.0  # |probs @ V - fused output| within float32 rounding
    assert len(inputs) == len(engine.model.layers)  # one forward call: 300 tokens < CHUNK
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    for layer, (attn, x) in enumerate(inputs):
        # The layer's own projections, norms and RoPE, from its input: not the capture's arrays.
        q = attn.q_proj(x).reshape(1, 300, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(x).reshape(1, 300, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rope(q), attn.rope(k)
        mx.eval(q, k)
        expected = explicit_softmax(np.array(q[0])[:, ROWS], np.array(k[0]), attn.scale, ROWS)
        np.testing.assert_allclose(probs[layer], expected, atol=1e-4)


def test_sink_figures_find_the_sink_and_count_sink_heads() -> None:
    # 2 layers x 2 heads x 2 queries over 100 keys: head (0, 0) parks 60% on key 0, head
    # (1, 1) 30% on key 2; the rest spreads evenly over the keys each query sees.
    queries = [80, 99]
    probs = np.zeros((2, 2, 2, 100), dtype=np.float32)
    for i, q in enumerate(queries):
        probs[:, :, i, : q + 1] = 1.0 / (q + 1)
        probs[0, 0, i, : q + 1] = 0.4 / q
        probs[0, 0, i, 0] = 0.6
        probs[1, 1, i, : q + 1] = 0.7 / q
        probs[1, 1, i, 2] = 0.3
    metrics, detail = sink_figures(probs, queries, sinks=4, threshold_pct=50, recent=10)
    assert metrics["sink_position"] == 0
    assert metrics["sink_heads_pct"] == 25.0  # 1 of 4 heads at >= 50% on the first 4 keys
    assert metrics["max_row_sum_error"] < 1e-5
    assert detail["head_sink_mass"][0][0] == pytest.approx(0.6 + 1.2 * (1 / 80 + 1 / 99) / 2)
    assert detail["sink_mass_by_k"][0] < detail["sink_mass_by_k"][3] < detail["sink_mass_by_k"][7]
    assert np.array(detail["head_mass_by_k"]).shape == (2, 2, 8)
    assert detail["head_mass_by_k"][0][0][3] == pytest.approx(
        detail["head_sink_mass"][0][0], abs=1e-6
    )
    assert detail["head_mass_by_k"][0][0][0] == pytest.approx(0.6)
    # Head (0, 1) spreads evenly: its 10 most recent keys hold 10 / (q + 1) of its attention.
    assert detail["head_recent_mass"][0][1] == pytest.approx((10 / 81 + 10 / 100) / 2, rel=1e-4)
    # Move the big head's mass from key 0 to key 40: the sink moves, and no head is a sink head.
    probs[0, 0, :, [0, 40]] = probs[0, 0, :, [40, 0]].copy()
    metrics, _ = sink_figures(probs, queries, sinks=4, threshold_pct=50, recent=10)
    assert metrics["sink_position"] == 40
    assert metrics["sink_heads_pct"] == 0.0


def test_a_recent_token_is_not_the_sink() -> None:
    # Every query puts half its mass on itself: the sink must be found before the recent window.
    queries = [60, 90]
    probs = np.zeros((1, 1, 2, 91), dtype=np.float32)
    for i, q in enumerate(queries):
        probs[0, 0, i, :q] = 0.5 / q
        probs[0, 0, i, q] = 0.5
    probs[0, 0, :, 5] += 0.01
    probs[0, 0, :, 6] -= 0.01
    metrics, _ = sink_figures(probs, queries, sinks=4, threshold_pct=50, recent=8)
    assert metrics["sink_position"] == 5
    assert metrics["recent_mass_pct"] == pytest.approx(50 + 50 * 7 / 60 / 2 + 50 * 7 / 90 / 2,
                                                       rel=1e-3)  # fmt: skip


def test_bos_modes() -> None:
    assert with_bos([2, 5, 6], 2, "model") == [2, 5, 6]
    assert with_bos([2, 5, 6], 2, "drop") == [5, 6]
    assert with_bos([5, 6], 2, "drop") == [5, 6]
    assert with_bos([5, 6], 2, "add") == [2, 5, 6]
    assert with_bos([2, 5], 2, "add") == [2, 5]


def test_default_queries_sit_in_the_second_half() -> None:
    assert default_queries(512) == (256, 292, 329, 365, 402, 438, 475, 511)


def test_an_engine_without_attention_says_so_in_one_line(gate: pytest.Pytester) -> None:
    gate.makefile(
        ".yaml",
        budgets="version: 1\ndefaults: {engine: fake, model: tiny.gguf}\nchecks:\n"
        "  - name: att\n    scenario: attention\n    budgets: {min_sink_heads_pct: 10}\n",
    )
    result = gate.runpytest("--kvguard", "budgets.yaml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*att*engine 'fake' cannot expose its attention probabilities*"])


def test_a_red_stream_check_names_the_heads_that_lose_their_sink(
    gate: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jsonschema

    from pytest_kvguard.gate.report import report_schema

    monkeypatch.setenv("KVGUARD_FAKE_ATTENTION", "1")
    gate.makefile(
        ".yaml",
        budgets="version: 1\ndefaults: {engine: fake, model: tiny.gguf}\nchecks:\n"
        "  - name: win\n    policy: window\n    params: {cap: 64, tokens: 300}\n"
        "    budgets: {max_ppl_increase_pct: 25}\n"
        "  - name: sink\n    policy: sink\n    params: {cap: 64, tokens: 300, sinks: 4}\n"
        "    budgets: {max_ppl_increase_pct: 25}\n",
    )
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json",
                            "--kvguard-plot")  # fmt: skip
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([
        "*kvguard sink heads*",
        "2 of 4 heads put >= 50% of their attention on the first 4 tokens (sink: #0 't0', *); "
        "the policy keeps 0 of the first 4 tokens, so these heads lose their sink",
        "    0  |  |",
        "    1  |%%|",
    ])  # fmt: skip
    report = json.loads((gate.path / "r.json").read_text())
    jsonschema.validate(report, report_schema())
    explained = {c["name"]: c["explanation"] for c in report["checks"]}
    assert explained["sink"] is None  # green: nothing to explain
    assert explained["win"]["sinks_kept"] == 0
    assert [h[:2] for h in explained["win"]["sink_heads"]] == [[1, 0], [1, 1]]
    assert (gate.path / "r.sink-heads.png").stat().st_size > 0


@pytest.mark.llama_cpp
@pytest.mark.mlx
def test_captures_past_one_batch_keep_positions_and_masks(
    kvguard_runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """700 tokens: two llama.cpp batches and two mlx forward calls (the second with a cache
    offset and its own mask); rows on both sides of token 512."""
    from pytest_kvguard.engines.llama_cpp.attention import SOFTMAX, capture
    from pytest_kvguard.engines.mlx import attention as mlx_attention

    rows = [300, 600, 699]
    engine: Any = kvguard_runner.engine("llama_cpp", SMOLLM2)
    ids = kvguard_runner.token_ids("llama_cpp", SMOLLM2, pydoc_topics(), 700)
    tensors = capture(engine, ids, range(700), prefixes=(SOFTMAX, "Qcur", "Kcur"))
    for layer in (0, 14, 29):
        probs = tensors[f"{SOFTMAX}-{layer}"][0]
        q = tensors[f"Qcur-{layer}"][0].transpose(1, 0, 2)[:, rows]
        k = tensors[f"Kcur-{layer}"][0].transpose(1, 0, 2)
        expected = explicit_softmax(q, k, q.shape[-1] ** -0.5, rows)
        np.testing.assert_allclose(probs[:, rows], expected, atol=3e-3)

    model = kvguard_runner.engine("mlx", SMOLLM2).model  # type: ignore[attr-defined]
    chunked, _, _ = mlx_attention.capture(model, ids, rows)
    monkeypatch.setattr(mlx_attention, "CHUNK", 1024)
    whole, _, _ = mlx_attention.capture(model, ids, rows)
    np.testing.assert_allclose(chunked, whole, atol=1e-5)
    np.testing.assert_allclose(chunked.sum(-1), 1.0, atol=1e-5)


@pytest.mark.llama_cpp
def test_llama_cpp_reads_its_attention_over_a_quantized_k_cache(kvguard_runner: Runner) -> None:
    """K is written to the cache before KQ reads it back: the probabilities move with the K
    type, further at 4 bits than at 8, and stay rows of a softmax."""
    engine: Any = kvguard_runner.engine("llama_cpp", SMOLLM2)
    ids = kvguard_runner.token_ids("llama_cpp", SMOLLM2, pydoc_topics(), 300)
    f16 = engine.attention(ids, ROWS).probs
    q8 = engine.attention(ids, ROWS, make_policy("full", cache_type_k="q8_0"))
    q4 = engine.attention(ids, ROWS, make_policy("full", cache_type_k="q4_0"))
    assert q4.how.endswith("K cache q4_0")
    for rows in (q8.probs, q4.probs):
        np.testing.assert_allclose(rows.sum(-1), 1.0, atol=1e-5)
    moved_q8, moved_q4 = np.abs(q8.probs - f16).max(), np.abs(q4.probs - f16).max()
    assert 0 < moved_q8 < moved_q4, (moved_q8, moved_q4)


@pytest.mark.mlx
def test_mlx_reads_its_attention_over_its_own_quantized_cache(kvguard_runner: Runner) -> None:
    """mlx-lm's maybe_quantize_kv_cache runs after each call, the query rows start a call of
    their own, and probs @ the dequantized V reproduce mlx-lm's quantized attention output."""
    from pytest_kvguard.engines.mlx.attention import capture, feed_spans

    assert feed_spans(700, 300, False) == [(0, 512), (512, 700)]
    assert feed_spans(700, 300, True) == [(0, 300), (300, 512), (512, 700)]
    model = kvguard_runner.engine("mlx", SMOLLM2).model  # type: ignore[attr-defined]
    ids = kvguard_runner.token_ids("mlx", SMOLLM2, pydoc_topics(), 300)
    f16, _, _ = capture(model, ids, ROWS)
    moved = []
    for bits in (8, 4):
        precision = make_policy("full", kv_bits=bits)
        probs, reconstruction_error, _ = capture(model, ids, ROWS, precision)
        assert reconstruction_error < 1.0, (bits, reconstruction_error)
        np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
        moved.append(np.abs(probs - f16).max())
    assert 0 < moved[0] < moved[1], moved
