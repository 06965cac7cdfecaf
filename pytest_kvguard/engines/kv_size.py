"""What every engine's KV-size prediction shares (each engine's own is in its package's
``kv_size``): the bytes one token takes in one layer."""

from __future__ import annotations

from pytest_kvguard.inputs.models import ModelArch


def layer_bytes(
    arch: ModelArch, bytes_per_element: float, v_bytes_per_element: float | None = None
) -> float:
    """K and V of one token in one layer; V at ``v_bytes_per_element`` where it differs."""
    v_bytes = bytes_per_element if v_bytes_per_element is None else v_bytes_per_element
    return arch.n_kv_heads * (arch.head_dim_k * bytes_per_element + arch.head_dim_v * v_bytes)
