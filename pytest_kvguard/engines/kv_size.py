"""KV-size prediction: what every engine's shares (the bytes one token takes in one layer),
and an engine's prediction by name (its adapter's ``kv_size`` module, else a capped policy's
``min(n, cap)`` entries per layer)."""

from __future__ import annotations

import importlib
from typing import Any

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.registry import engine_info
from pytest_kvguard.inputs.models import ModelArch


def layer_bytes(
    arch: ModelArch, bytes_per_element: float, v_bytes_per_element: float | None = None
) -> float:
    """K and V of one token in one layer; V at ``v_bytes_per_element`` where it differs."""
    v_bytes = bytes_per_element if v_bytes_per_element is None else v_bytes_per_element
    return arch.n_kv_heads * (arch.head_dim_k * bytes_per_element + arch.head_dim_v * v_bytes)


def _kv_size_module(engine: str) -> Any:
    """The adapter's own KV-size module (imports no engine), or None."""
    name = engine_info(engine).kv_size
    return None if name is None else importlib.import_module(name)


def rotating_capacity(engine: str, policy: Policy, arch: ModelArch) -> int | None:
    """Entries a rotating cache of this policy holds on ``engine``: the cap, or where the
    engine's sliding layers rotate (mlx-lm's swa) the model's window; None where nothing
    rotates."""
    module = _kv_size_module(engine)
    return policy.cap if module is None else module.rotating_capacity(policy, arch)


def predict_engine_kv_bytes(
    engine: str,
    arch: ModelArch,
    n_tokens: int,
    policy: Policy,
    *,
    element_bytes: float,
    n_ubatch: int = 512,
    last_call: int = 1,
) -> float:
    """KV bytes an engine should report after ``n_tokens`` fed as the stream scenario feeds
    them, the last call ``last_call`` tokens: the engine's own prediction (its adapter's
    ``kv_size``); on another engine, a capped policy's ``min(n, cap)`` entries per layer."""
    module = _kv_size_module(engine)
    if module is not None:
        prediction: float = module.predict_stream_kv_bytes(
            arch, n_tokens, policy, element_bytes=element_bytes, n_ubatch=n_ubatch,
            last_call=last_call,
        )  # fmt: skip
        return prediction
    if policy.cap is None:
        raise KvguardError(f"no KV prediction for engine '{engine}'")
    return arch.n_layers * min(n_tokens, policy.cap) * layer_bytes(arch, element_bytes)
