"""The KV bytes mlx-lm's caches allocate, predicted from the architecture alone (no mlx import).

``KVCache`` allocates in steps of 256 tokens; ``RotatingKVCache`` (window, sink, a model's
sliding layers) holds ``min(n, max_size)`` exactly when filled in chunks that fit, and
``max_size - 1 + last_call`` right after a call of ``last_call`` > 1 tokens on a full cache (its
chunked path appends the whole chunk to the ``max_size - 1`` newest keys).
"""

from __future__ import annotations

from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.kv_size import layer_bytes
from pytest_kvguard.inputs.models import ModelArch

MLX_STEP = 256
"""mlx-lm's KVCache (and QuantizedKVCache) grows its buffers in steps of this many tokens."""


def quantized_element_bytes(bits: int, group_size: int, element_bytes: float) -> float:
    """Bytes per cached element of a ``QuantizedKVCache``: ``bits`` packed into uint32 words,
    plus a scale and a bias per ``group_size`` elements in the cache's own dtype
    (``mx.quantize``). ``KVCache.to_quantized`` quantizes the whole allocated buffer, so the
    256-token steps stay."""
    return bits / 8 + 2 * element_bytes / group_size


def element_bytes_of(policy: Policy, n_tokens: int, element_bytes: float) -> float:
    """Bytes per element after ``n_tokens``: quantized once the cache holds
    ``quantized_kv_start`` tokens, as the policy asks of every layer (a layer mlx-lm leaves
    unquantized shows up as a deviation)."""
    if policy.kv_bits is None or n_tokens < policy.quantized_kv_start:
        return element_bytes
    return quantized_element_bytes(policy.kv_bits, policy.kv_group_size, element_bytes)


def rotating_capacity(policy: Policy, arch: ModelArch) -> int | None:
    """Entries a rotating cache of this policy holds: the cap, or on swa the model's window
    (its sliding layers are rotating caches); None where nothing rotates."""
    if policy.cap is not None:
        return policy.cap
    if policy.kind == "swa":
        return arch.sliding_window
    return None


def predict_stream_kv_bytes(
    arch: ModelArch,
    n_tokens: int,
    policy: Policy,
    *,
    element_bytes: float,
    n_ubatch: int = 512,
    last_call: int = 1,
) -> float:
    """The caches' buffers after ``n_tokens`` fed as the stream scenario feeds them, the last
    call ``last_call`` tokens. engine_default is predicted as the cap applied, so an engine
    that ignores the cap shows up as a deviation; a quantized policy as quantized in every
    layer. ``n_ubatch`` does not matter here."""

    def rotating(max_size: int) -> int:
        if last_call > 1 and n_tokens - last_call >= max_size:
            return max_size - 1 + last_call
        return min(n_tokens, max_size)

    per_layer = layer_bytes(arch, element_bytes_of(policy, n_tokens, element_bytes))
    sliding = arch.swa_layers if arch.sliding_window else (False,) * arch.n_layers
    if policy.cap is not None:  # window, sink, engine_default
        held = [rotating(policy.cap)] * arch.n_layers
    else:
        stepped = -(-n_tokens // MLX_STEP) * MLX_STEP
        window = arch.sliding_window or 0
        if policy.kind == "swa":
            held = [rotating(window) if slides else stepped for slides in sliding]
        else:
            held = [stepped] * arch.n_layers
    return sum(held) * per_layer
