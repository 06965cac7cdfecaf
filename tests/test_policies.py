from __future__ import annotations

import pytest

from pytest_kvguard.errors import KvguardError
from pytest_kvguard.gate.policies import make_policy


def test_sink_defaults_to_four_pinned_tokens() -> None:
    policy = make_policy("sink", cap=256)
    assert (policy.sinks, policy.cap, policy.positions, policy.evict_step) == (
        4,
        256,
        "reindexed",
        1,
    )
    assert policy.describe() == "sink4/256 reidx step1"


def test_full_ignores_cap() -> None:
    assert make_policy("full", cap=256).cap is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "sinks", "cap": 9}, "unknown policy 'sinks'"),
        ({"kind": "window"}, "needs a cap"),
        ({"kind": "window", "cap": 64, "sinks": 4}, "does not take sinks"),
        ({"kind": "sink", "cap": 64, "sinks": 0}, "needs sinks >= 1"),
        ({"kind": "sink", "cap": 4, "sinks": 4}, "leaves no room"),
        ({"kind": "sink", "cap": 64, "positions": "relative"}, "unknown position handling"),
        ({"kind": "window", "cap": 64, "evict_step": 0}, "evict_step must be >= 1"),
    ],
)
def test_policies_that_would_not_mean_what_they_say(kwargs: dict, message: str) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(KvguardError, match=message):
        make_policy(kind, **kwargs)


def test_chunk_shows_in_the_label_and_full_ignores_it() -> None:
    assert make_policy("sink", cap=256, chunk=64).describe() == "sink4/256 reidx step1 chunk64"
    assert make_policy("sink", cap=256).describe() == "sink4/256 reidx step1"
    assert make_policy("full", chunk=64) == make_policy("full")  # never evicts: fed as before


def test_llama_cpp_takes_at_most_its_batch_per_call() -> None:
    from pytest_kvguard.engines import check_policy

    policy = make_policy("sink", cap=2048, chunk=513)
    with pytest.raises(KvguardError, match="at most 512 tokens per call, not chunk 513"):
        check_policy("llama_cpp", policy)
    check_policy("mlx", make_policy("sink", cap=2048, chunk=513, positions="absolute"))
    # llama.cpp trims its iSWA cache inside llama_decode: there is no full cache to chunk into.
    with pytest.raises(KvguardError, match="trims its 'swa' cache inside each decode call"):
        check_policy("llama_cpp", make_policy("swa", chunk=64), "feed_unscored")
    check_policy("mlx", make_policy("swa", chunk=64, positions="absolute"), "feed_unscored")
