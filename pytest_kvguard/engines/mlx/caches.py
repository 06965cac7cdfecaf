"""mlx-lm's own cache classes as kvguard's policies use them: the cache list a policy stands
for, what a layer's cache holds and allocates (across mlx-lm releases), and which positions a
chunk's queries can see."""

from __future__ import annotations

from pytest_kvguard.engines.mlx.blas import preload_openblas

BLAS_PATH = preload_openblas()

# The engine is imported only after the BLAS choice above.
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import (  # noqa: E402
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from pytest_kvguard.core.errors import KvguardError  # noqa: E402
from pytest_kvguard.core.policies import Policy  # noqa: E402


def eval_caches(caches: Sequence[Any]) -> None:
    """Compute what the model's last call wrote into its caches, and nothing else: the graph
    for the logits (the final norm and the vocabulary projection, Gemma 3's 262,144 rows) is
    dropped unevaluated. mlx-lm's own prompt prefill does the same (``mx.eval([c.state for c in
    prompt_cache])`` in generate_step); the cached keys and values are the same either way."""
    mx.eval([c.state for c in caches])


def cache_size(cache: Any) -> int:
    """KV entries one layer's cache holds. ``size()`` arrived in mlx-lm 0.30.4; before it, a
    ``KVCache`` held its offset and a ``RotatingKVCache`` at most ``max_size`` of it. A
    ``QuantizedKVCache`` holds its offset: it defines no ``size()`` (the base class's says 0
    in every release up to 0.32.2)."""
    if isinstance(cache, QuantizedKVCache):
        return int(cache.offset)
    if hasattr(cache, "size"):
        return int(cache.size())
    if isinstance(cache, RotatingKVCache):
        return int(min(cache.offset, cache.max_size))
    return int(cache.offset)


def cache_nbytes(cache: Any) -> int:
    """Bytes of one layer's K and V buffers as allocated. ``nbytes`` arrived in mlx-lm 0.31; it
    is the same sum of the two arrays' sizes. A ``QuantizedKVCache`` holds a (packed, scales,
    biases) tuple each for K and V, summed here: its ``nbytes`` raises NameError in mlx-lm
    0.31.1 and 0.31.2 (a missing import) and is the same sum from 0.31.3."""
    if isinstance(cache, QuantizedKVCache):
        if cache.keys is None:
            return 0
        return int(sum(a.nbytes for a in (*cache.keys, *cache.values)))
    if hasattr(type(cache), "nbytes"):
        return int(cache.nbytes)
    if cache.keys is None:
        return 0
    return int(cache.keys.nbytes + cache.values.nbytes)


def make_caches(model: Any, policy: Policy) -> list[Any]:
    """The mlx-lm cache list a policy stands for."""
    n_layers = len(model.layers)
    if policy.kind == "full":
        return [KVCache() for _ in range(n_layers)]
    if policy.kind in ("sink", "window"):
        return [RotatingKVCache(max_size=policy.cap, keep=policy.sinks) for _ in range(n_layers)]
    if policy.kind == "swa":
        if not hasattr(model, "make_cache"):
            raise KvguardError("this model defines no sliding-window cache (make_cache)")
        return list(model.make_cache())
    if policy.kind == "engine_default":
        return list(make_prompt_cache(model, max_kv_size=policy.cap))
    raise KvguardError(f"policy '{policy.kind}' is not supported by the mlx engine")


def chunk_visibility(max_size: int, keep: int, calls: Sequence[int]) -> list[list[int]]:
    """The token positions each query of the last call may attend to, read from mlx-lm itself.

    A ``RotatingKVCache(max_size, keep)`` is fed keys tagged with their token position, in
    calls of the given sizes; before the last call the mask is built with mlx-lm's
    ``create_attention_mask``, exactly as a model does before it updates its cache, and the
    keys the update returns are read back. No model runs: the cache and the mask decide what a
    query can see, whatever the weights.
    """
    from mlx_lm.models.base import create_attention_mask

    def tagged(first: int, count: int) -> Any:
        return mx.arange(first, first + count, dtype=mx.float32).reshape(1, 1, count, 1)

    cache = RotatingKVCache(max_size=max_size, keep=keep)
    fed = 0
    for size in calls[:-1]:
        cache.update_and_fetch(tagged(fed, size), tagged(fed, size))
        fed += size
    chunk = calls[-1]
    mask = create_attention_mask(mx.zeros((1, chunk, 1)), cache)
    keys, _ = cache.update_and_fetch(tagged(fed, chunk), tagged(fed, chunk))
    tags = [int(t) for t in np.array(keys[0, 0, :, 0])]
    if mask is None:
        allowed = np.ones((chunk, len(tags)), dtype=bool)
    elif isinstance(mask, str):  # "causal": the chunk's own keys are the last ones
        allowed = np.arange(len(tags))[None, :] <= (len(tags) - chunk + np.arange(chunk))[:, None]
    else:
        allowed = np.broadcast_to(np.array(mask), (chunk, len(tags)))
    return [sorted(tags[j] for j in np.flatnonzero(row)) for row in allowed]
