"""What every engine's KV-size prediction shares (each engine's own is in its package's
``kv_size``): the bytes one token takes in one layer."""

from __future__ import annotations

from pytest_kvguard.inputs.models import ModelArch


def layer_bytes(arch: ModelArch, bytes_per_element: float) -> float:
    """K and V of one token in one layer."""
    return arch.n_kv_heads * (arch.head_dim_k + arch.head_dim_v) * bytes_per_element
