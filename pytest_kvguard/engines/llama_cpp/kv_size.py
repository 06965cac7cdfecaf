"""The KV bytes llama.cpp holds, predicted from the architecture alone (no llama.cpp import).

llama.cpp's iSWA cache holds ``pad256(window x n_seq + n_ubatch)`` cells in each sliding layer.
"""

from __future__ import annotations

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import LLAMA_CACHE_TYPES, Policy
from pytest_kvguard.engines.kv_size import layer_bytes
from pytest_kvguard.inputs.models import ModelArch


def cache_type_bytes(name: str) -> float:
    """Bytes per element of a llama.cpp cache type: ggml's block bytes over block elements
    (q8_0: 34 bytes per 32, 1.0625; q4_0: 18 per 32, 0.5625)."""
    block_bytes, block_elements = LLAMA_CACHE_TYPES[name]
    return block_bytes / block_elements


def policy_layer_bytes(arch: ModelArch, policy: Policy | None, element_bytes: float) -> float:
    """K and V of one token in one layer in the policy's cache types; the defaults (f16) at
    ``element_bytes``."""
    if policy is None or not policy.precision_set:
        return layer_bytes(arch, element_bytes)
    return layer_bytes(
        arch, cache_type_bytes(policy.cache_type_k), cache_type_bytes(policy.cache_type_v)
    )


def pad256(n: int) -> int:
    return (n + 255) // 256 * 256


def swa_cells(arch: ModelArch, n_ubatch: int = 512, n_seq: int = 1) -> int:
    """Cells llama.cpp's iSWA cache gives each sliding layer."""
    assert arch.sliding_window is not None
    return pad256(arch.sliding_window * n_seq + n_ubatch)


def predict_kv_bytes(
    arch: ModelArch,
    n_tokens: int,
    policy: str,
    *,
    cap: int | None = None,
    bytes_per_element: float = 2.0,
    n_ubatch: int = 512,
    n_seq: int = 1,
    v_bytes_per_element: float | None = None,
) -> float:
    """KV bytes held after ``n_tokens`` under ``policy`` (full, window, sink, swa, swa_full).

    window and sink hold ``cap`` entries in every layer (the sinks count inside the cap); swa
    holds llama.cpp's iSWA cell count in sliding layers and everything in the others. K takes
    ``bytes_per_element``, V ``v_bytes_per_element`` where it differs (``cache_type_bytes``).
    """
    per_layer = layer_bytes(arch, bytes_per_element, v_bytes_per_element)
    if policy in ("full", "swa_full"):
        return arch.n_layers * n_tokens * per_layer
    if policy in ("window", "sink"):
        if cap is None:
            raise KvguardError(f"policy '{policy}' needs a cap", fix="pass --cap")
        return arch.n_layers * min(n_tokens, cap) * per_layer
    if policy == "swa":
        if arch.sliding_window is None:
            return arch.n_layers * n_tokens * per_layer
        sliding = sum(arch.swa_layers)
        held = min(n_tokens, swa_cells(arch, n_ubatch, n_seq))
        return (sliding * held + (arch.n_layers - sliding) * n_tokens) * per_layer
    raise KvguardError(f"no prediction for policy '{policy}'", fix="use full, window, sink, swa")


def rotating_capacity(policy: Policy, arch: ModelArch) -> int | None:
    """Entries a capped cache holds: the cap; None where nothing is capped."""
    return policy.cap


def predict_stream_kv_bytes(
    arch: ModelArch,
    n_tokens: int,
    policy: Policy,
    *,
    element_bytes: float,
    n_ubatch: int = 512,
    last_call: int = 1,
) -> float:
    """The context's state after ``n_tokens`` fed as the stream scenario feeds them (cells in
    use): window/sink hold ``min(n, cap)`` cells in every layer; full and swa let an iSWA
    model's sliding layers hold at most ``pad256(window + n_ubatch)`` cells; swa_full holds
    everything; K and V in the policy's cache types. ``last_call`` does not matter:
    llama.cpp evicts before a call."""
    per_layer = policy_layer_bytes(arch, policy, element_bytes)
    sliding = arch.swa_layers if arch.sliding_window else (False,) * arch.n_layers
    if policy.cap is not None:  # window, sink, engine_default
        held = [min(n_tokens, policy.cap)] * arch.n_layers
    else:
        limit = n_tokens
        if arch.sliding_window and policy.kind != "swa_full":
            limit = min(n_tokens, swa_cells(arch, n_ubatch))
        held = [limit if slides else n_tokens for slides in sliding]
    return sum(held) * per_layer
