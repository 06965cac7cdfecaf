"""What each engine adapter can run, refused at parse time (no engine import needed)."""

from __future__ import annotations

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import POLICY_KINDS, make_policy
from pytest_kvguard.engines import ENGINES, check_policy


def test_mlx_refuses_reindexed_positions() -> None:
    with pytest.raises(KvguardError, match="use positions: absolute"):
        check_policy("mlx", make_policy("sink", cap=256, positions="reindexed"))


def test_mlx_evicts_one_token_per_step() -> None:
    with pytest.raises(KvguardError, match="use evict_step: 1"):
        check_policy("mlx", make_policy("window", cap=256, positions="absolute", evict_step=8))


def test_llama_cpp_has_no_engine_default_yet() -> None:
    with pytest.raises(
        KvguardError, match="does not implement policy 'engine_default' for the feed path"
    ):
        check_policy("llama_cpp", make_policy("engine_default", cap=256))


@pytest.mark.parametrize("engine", ["llama_cpp", "mlx"])
def test_each_engine_accepts_exactly_the_policies_it_lists(engine: str) -> None:
    info = ENGINES[engine]
    positions = info.native_positions
    for scenario, kinds in info.policies.items():
        for kind in POLICY_KINDS:
            policy = make_policy(kind, cap=256, positions=positions)
            if kind in kinds:
                assert check_policy(engine, policy, scenario) is None
            else:
                with pytest.raises(KvguardError, match=f"does not implement policy '{kind}'"):
                    check_policy(engine, policy, scenario)


def test_the_toy_engine_satisfies_the_engine_protocol() -> None:
    """The toy runs every scenario's mechanics, edit_replay's prefix cache included."""
    from kvguard_fake_engine import FakeEngine

    from pytest_kvguard.engines import Engine

    assert isinstance(FakeEngine(), Engine)
    assert callable(FakeEngine().open_prefix_cache)


def test_an_engine_with_an_unknown_path_or_capability_is_refused_by_name() -> None:
    """An adapter keyed by a scenario's name (the registry before engine paths) would be taken
    for a server: it is refused when it is registered, naming the key."""
    from pytest_kvguard.engines import EngineInfo

    with pytest.raises(KvguardError, match="engine 'old' declares 'stream', which kvguard"):
        EngineInfo("old", "m", "m", "m", "pip install m", policies={"stream": ("full",)})
    with pytest.raises(KvguardError, match="declares 'attention'"):
        EngineInfo("old", "m", "m", "m", "pip install m", capabilities=frozenset({"attention"}))
