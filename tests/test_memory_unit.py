"""The memory scenario's prediction and judging arithmetic, no engine (real runs: bundled gate)."""

from __future__ import annotations

from pathlib import Path

import kvguard_fake_engine
import numpy as np
import pytest

from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.core.units import format_size
from pytest_kvguard.engines.kv_size import predict_engine_kv_bytes
from pytest_kvguard.inputs.architecture import arch_from_config
from pytest_kvguard.scenarios.feeding import StreamRun, StreamSample, run_stream
from pytest_kvguard.scenarios.memory import check_lengths, memory_result

GEMMA = arch_from_config(Path(__file__).parent.parent / "fixtures" / "gemma-3-270m.config.json")
# One token in one Gemma 3 layer: 1 KV head x (256 + 256) elements: 1,024 B at f16, 2,048 B at f32.


@pytest.mark.parametrize(
    ("engine", "kind", "n", "element", "expected"),
    [
        # llama.cpp iSWA: 15 sliding layers x min(n, pad256(512 + 512) = 1,024), 3 global x n.
        ("llama_cpp", "swa", 4096, 2, (15 * 1024 + 3 * 4096) * 1024),
        ("llama_cpp", "swa", 700, 2, 18 * 700 * 1024),
        ("llama_cpp", "full", 4096, 2, (15 * 1024 + 3 * 4096) * 1024),  # full is iSWA too
        ("llama_cpp", "swa_full", 4096, 2, 18 * 4096 * 1024),
        # mlx-lm: RotatingKVCache(512) on sliding layers, KVCache (256-token steps) on global.
        ("mlx", "swa", 768, 4, (15 * 512 + 3 * 768) * 2048),
        ("mlx", "swa", 700, 4, (15 * 512 + 3 * 768) * 2048),
        ("mlx", "full", 300, 4, 18 * 512 * 2048),
    ],
)
def test_engine_prediction_matches_hand_arithmetic(
    engine: str, kind: str, n: int, element: float, expected: int
) -> None:
    policy = make_policy(kind)
    assert predict_engine_kv_bytes(engine, GEMMA, n, policy, element_bytes=element) == expected


@pytest.mark.parametrize("engine", ["llama_cpp", "mlx"])
def test_a_cap_is_predicted_the_same_on_every_engine(engine: str) -> None:
    for kind in ("sink", "window", "engine_default"):
        policy = make_policy(kind, cap=256, sinks=4 if kind == "sink" else None)
        assert predict_engine_kv_bytes(engine, GEMMA, 100, policy, element_bytes=2) == (
            18 * 100 * 1024
        )
        assert predict_engine_kv_bytes(engine, GEMMA, 5000, policy, element_bytes=2) == (
            18 * 256 * 1024
        )


def test_a_chunk_on_a_full_mlx_cache_holds_cap_minus_one_plus_the_chunk() -> None:
    """mlx-lm appends a chunk to the cap - 1 newest keys; llama.cpp evicts for it first."""
    sink = make_policy("sink", cap=256, sinks=4, chunk=64)
    full_then_chunk = predict_engine_kv_bytes("mlx", GEMMA, 400, sink, element_bytes=2,
                                              last_call=64)  # fmt: skip
    assert full_then_chunk == 18 * (256 - 1 + 64) * 1024
    # A call that filled the room left (the cache was not full yet) fits exactly.
    filling = predict_engine_kv_bytes("mlx", GEMMA, 256, sink, element_bytes=2, last_call=64)
    assert filling == 18 * 256 * 1024
    held = predict_engine_kv_bytes("llama_cpp", GEMMA, 400, sink, element_bytes=2, last_call=64)
    assert held == 18 * 256 * 1024
    # Gemma's sliding layers under mlx swa: the same rule at the model's window (512).
    swa = make_policy("swa", chunk=64)
    sliding = predict_engine_kv_bytes("mlx", GEMMA, 704, swa, element_bytes=2, last_call=64)
    assert sliding == (15 * (512 - 1 + 64) + 3 * 768) * 1024


def _run(kv_bytes: dict[int, float], cap: int | None = 256) -> StreamRun:
    policy = make_policy("window", cap=cap) if cap else make_policy("full")
    samples = [StreamSample(n, min(n, cap or n), {"kv_bytes": b}) for n, b in kv_bytes.items()]
    n = max(kv_bytes)
    return StreamRun(policy, n, np.empty(0), None, 0, 0, 1.0, samples[-1].figures, [], samples)


def test_memory_rows_deviation_and_bounded_growth() -> None:
    run = _run({256: 1000.0, 512: 1005.0, 1024: 1005.0})
    result = memory_result(run, [256, 512, 1024], lambda n: 1000.0)
    assert [round(r.deviation_pct, 6) for r in result.rows] == [0.0, 0.5, 0.5]
    m = result.metrics
    assert m["kv_deviation_pct"] == pytest.approx(0.5)
    assert m["kv_growth_after_cap_bytes"] == 5.0
    assert m["kv_bytes_per_token"] == pytest.approx(1005 / 1024)
    assert result.findings() == []
    violations = Budgets(bounded=True, max_kv_deviation_pct=1).check(m)
    assert [v.budget for v in violations] == ["bounded"]


def test_far_above_the_prediction_is_flagged_not_applied() -> None:
    run = _run({256: 1000.0, 512: 1500.0, 1024: 4000.0})
    result = memory_result(run, [256, 512, 1024], lambda n: 1000.0)
    assert [r.not_applied for r in result.rows] == [False, False, True]  # 1.5x is the edge
    (finding,) = result.findings()
    assert "cap or window not applied" in finding and "at 1024 tokens" in finding
    assert format_size(4000.0) in finding


def test_lengths_are_checked() -> None:
    assert check_lengths([256, 512]) == [256, 512]
    for bad in ([], [0, 5], [512, 256], [256, 256], "512", [1.5]):
        with pytest.raises(KvguardError):
            check_lengths(bad)


def test_stream_samples_land_exactly_on_the_lengths() -> None:
    engine = kvguard_fake_engine.FakeEngine()
    ids = engine.tokenize("x" * 4 * 300)
    policy = make_policy("sink", cap=64, sinks=2)
    run = run_stream(engine, policy, ids, lengths=(50, 100, 299), score=False)
    assert [(s.tokens, s.held) for s in run.samples] == [
        (50, 50), (64, 64), (100, 64), (299, 64), (300, 64)
    ]  # fmt: skip
    assert len(run.nll) == 0  # score=False: no logits asked for
    assert run.kv_growth_after_cap() == 0


def test_predictions_follow_the_calls_the_policy_plans_not_the_engine() -> None:
    from pytest_kvguard.scenarios.memory import planned_calls

    chunked = make_policy("sink", cap=256, sinks=4, chunk=64)
    # 252 + 4 fill the cap, then 64-token chunks, the last one cut at 600.
    assert planned_calls(chunked, 256, 600, [256, 384, 600]) == {
        252: 252,
        256: 4,
        320: 64,
        384: 64,
        448: 64,
        512: 64,
        576: 64,
        600: 24,
    }
    # One token at a time past the cap, whatever the engine reports: a dropped cap cannot
    # move its own prediction.
    default = make_policy("engine_default", cap=256, positions="absolute")
    assert planned_calls(default, 256, 384, [256, 384])[384] == 1
