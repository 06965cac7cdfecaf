"""The stream scenario's arithmetic and control flow, on the toy engine (mechanics only)."""

from __future__ import annotations

import math

import kvguard_fake_engine
import numpy as np
import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.core.scoring import nll_of as _nll
from pytest_kvguard.scenarios.feeding import run_stream
from pytest_kvguard.scenarios.stream import check_reaches_eviction, compare


def test_nll_matches_a_direct_log_softmax() -> None:
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    targets = np.array([2, 1])
    expected = [-math.log(math.exp(3) / (math.exp(1) + math.exp(2) + math.exp(3))), math.log(3)]
    assert np.allclose(_nll(logits, targets), expected)


def test_nll_is_stable_for_huge_logits() -> None:
    logits = np.array([[1e4, 0.0]], dtype=np.float32)
    assert _nll(logits, np.array([0]))[0] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("step", [1, 16])
def test_first_eviction_and_held_entries(step: int) -> None:
    engine = kvguard_fake_engine.FakeEngine()
    ids = engine.tokenize("x" * 4 * 300)
    policy = make_policy("sink", cap=64, sinks=2, evict_step=step)
    run = run_stream(engine, policy, ids)
    assert run.first_eviction == 64  # tokens 0..63 fill the cache; token 64 forces an eviction
    assert run.kv_entries <= 64
    assert run.evicted + run.kv_entries == 300
    assert run.evicted % step == 0
    assert len(run.nll) == 299 and not np.isnan(run.nll).any()


def test_split_compares_the_same_tokens() -> None:
    engine = kvguard_fake_engine.FakeEngine()
    ids = engine.tokenize("x" * 4 * 300)
    full = run_stream(engine, make_policy("full"), ids)
    window = run_stream(engine, make_policy("window", cap=64), ids)
    metrics = compare(window, full).metrics
    assert metrics["first_eviction"] == 64
    assert metrics["post_eviction_tokens"] == 299 - 64
    assert metrics["pre_eviction_ppl"] == pytest.approx(metrics["baseline_pre_eviction_ppl"])
    assert metrics["ppl_increase_pct"] > 100  # the toy loses its sink under a pure window


def test_progress_is_reported() -> None:
    engine = kvguard_fake_engine.FakeEngine()
    seen: list[tuple[int, int]] = []
    run_stream(
        engine,
        make_policy("full"),
        engine.tokenize("x" * 4 * 1000),
        lambda d, t: seen.append((d, t)),
    )
    assert seen[-1] == (1000, 1000) and len(seen) >= 3


def test_a_run_that_never_evicts_is_refused() -> None:
    with pytest.raises(KvguardError, match="eviction would never start"):
        check_reaches_eviction(make_policy("sink", cap=256), 256)
    with pytest.raises(KvguardError, match="never evicts"):
        check_reaches_eviction(make_policy("full"), 5000)


def test_turns_cover_the_text() -> None:
    from pytest_kvguard.engines.conversation import plan_turns

    turns = plan_turns(1500, 64, 16)
    assert sum(t.prompt + t.reply for t in turns) == 1500
    assert all(t.prompt >= 1 and t.reply >= 1 for t in turns)
    assert turns[0].prompt == 64 and turns[0].reply == 16
    # A single token left at the end is not fed: it could be neither a prompt nor a reply.
    assert sum(t.prompt + t.reply for t in plan_turns(81, 64, 16)) == 80
