"""What every in-process engine adapter promises, one parametrized test per promise, on the real
bundled SmolLM2-135M (each engine's own contract: test_llama_cpp.py, test_mlx.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.engines import ENGINES
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import pydoc_topics
from pytest_kvguard.scenarios.feeding import run_stream

SMOLLM2 = ModelRef("smollm2-135m")


@pytest.mark.parametrize(
    ("engine_name", "cap", "tokens"),
    [
        pytest.param("llama_cpp", 64, 200, marks=pytest.mark.llama_cpp, id="llama_cpp"),
        # mlx-lm feeds one token per call past the cap: a shorter run.
        pytest.param("mlx", 32, 80, marks=pytest.mark.mlx, id="mlx"),
    ],
)
def test_same_run_twice_is_bitwise_identical(
    kvguard_runner: Runner, engine_name: str, cap: int, tokens: int
) -> None:
    engine = kvguard_runner.engine(engine_name, SMOLLM2)
    positions = ENGINES[engine_name].native_positions
    policy = make_policy("window", cap=cap, positions=positions)
    ids = kvguard_runner.token_ids(engine_name, SMOLLM2, pydoc_topics(), tokens)
    first, second = run_stream(engine, policy, ids), run_stream(engine, policy, ids)
    assert first.evicted == tokens - cap  # past the cap: the window evicted
    assert np.array_equal(first.nll, second.nll)
    # Token counts and KV figures too (peak RSS is process-wide and cumulative: not compared).
    assert (first.first_eviction, first.evicted, first.kv_entries) == (
        second.first_eviction,
        second.evicted,
        second.kv_entries,
    )
    assert [(s.tokens, s.held, s.figures["kv_bytes"]) for s in first.samples] == [
        (s.tokens, s.held, s.figures["kv_bytes"]) for s in second.samples
    ]
