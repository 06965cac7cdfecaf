"""What each engine adapter can run, refused at parse time (no engine import needed)."""

from __future__ import annotations

import pytest

from pytest_kvguard.engines import check_policy
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.policies import make_policy


def test_mlx_refuses_reindexed_positions() -> None:
    with pytest.raises(KvguardError, match="use positions: absolute"):
        check_policy("mlx", make_policy("sink", cap=256, positions="reindexed"))


def test_mlx_evicts_one_token_per_step() -> None:
    with pytest.raises(KvguardError, match="use evict_step: 1"):
        check_policy("mlx", make_policy("window", cap=256, positions="absolute", evict_step=8))


def test_llama_cpp_has_no_engine_default_yet() -> None:
    with pytest.raises(KvguardError, match="does not implement policy 'engine_default' for stream"):
        check_policy("llama_cpp", make_policy("engine_default", cap=256))


def test_supported_combinations_pass() -> None:
    check_policy("llama_cpp", make_policy("sink", cap=256, positions="absolute", evict_step=128))
    check_policy("mlx", make_policy("swa", positions="absolute"))
