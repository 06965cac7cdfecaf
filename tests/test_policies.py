from __future__ import annotations

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import make_policy


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


def test_kv_precision_shows_in_the_label_on_each_engines_terms() -> None:
    assert make_policy("full", kv_bits=8).describe() == "full q8"
    assert make_policy("full", kv_bits=4, kv_group_size=32, quantized_kv_start=1024).describe() == (
        "full q4 g32 from1024"
    )
    q8 = make_policy("sink", cap=256, cache_type_k="q8_0", cache_type_v="q8_0")
    assert q8.describe() == "sink4/256 reidx step1 q8_0"
    assert make_policy("full", cache_type_k="q4_0").describe() == "full k q4_0 v f16"
    assert q8.quantized and q8.unquantized() == make_policy("sink", cap=256)
    # f32 is not quantized, but it is not the default either: the label says so.
    f32 = make_policy("full", cache_type_k="f32", cache_type_v="f32")
    assert not f32.quantized and f32.precision_set and f32.describe() == "full f32"


@pytest.mark.parametrize(
    ("kwargs", "message", "key"),
    [
        ({"kv_bits": 7}, "kv_bits 7 is not a width mlx quantizes to", "params.kv_bits"),
        ({"kv_bits": 4, "kv_group_size": 48}, "kv_group_size 48", "params.kv_group_size"),
        ({"kv_group_size": 32}, "kv_bits is not set", "params.kv_group_size"),
        ({"quantized_kv_start": 512}, "kv_bits is not set", "params.quantized_kv_start"),
        ({"cache_type_k": "q4_k"}, "cache_type_k .q4_k. is not a", "params.cache_type_k"),
    ],
)
def test_kv_precision_values_no_engine_knows(kwargs: dict, message: str, key: str) -> None:
    with pytest.raises(KvguardError, match=message) as caught:
        make_policy("full", **kwargs)
    assert caught.value.key == key


@pytest.mark.parametrize(
    ("engine", "path", "kwargs", "message"),
    [
        ("mlx", "feed", {"cache_type_k": "q8_0"}, "quantizes its KV cache with kv_bits"),
        ("llama_cpp", "feed", {"kv_bits": 8}, "with cache_type_k / cache_type_v, not kv_bits"),
        ("openai", "prefix_cache", {"cache_type_k": "q8_0"}, "takes no KV precision settings"),
        ("llama_cpp", "prefix_cache", {"cache_type_v": "q8_0"}, "not to edit_replay checks"),
        ("mlx", "feed_unscored", {"kv_bits": 8}, "not to memory checks"),
        ("mlx", "generation", {"kv_bits": 4}, "to stream checks, attention checks only"),
        ("llama_server", "generation", {"kv_bits": 8}, "cache_type_v, not kv_bits"),
        ("mlx", "feed", {"kv_bits": 8, "cache_type_k": "q8_0"}, "are set together"),
    ],
)
def test_kv_precision_an_engine_does_not_take_there(
    engine: str, path: str, kwargs: dict, message: str
) -> None:
    from pytest_kvguard.engines import check_policy

    kind = "sink" if path in ("feed", "generation") else "full"
    policy = make_policy(kind, cap=255, positions="reindexed", **kwargs)
    with pytest.raises(KvguardError, match=message):
        check_policy(engine, policy, path)


def test_quantized_caches_take_the_path_users_call() -> None:
    from pytest_kvguard.engines import check_policy

    check_policy("mlx", make_policy("full", kv_bits=8), "feed")
    check_policy("llama_cpp", make_policy("full", cache_type_k="q8_0", cache_type_v="q8_0"))
    check_policy("llama_server", make_policy("full", cache_type_k="q8_0"), "prefix_cache")
