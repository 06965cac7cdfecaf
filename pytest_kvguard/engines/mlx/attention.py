"""mlx-lm's attention probabilities, from the queries, keys, mask and scale its layers pass.

mlx-lm's layers call ``scaled_dot_product_attention`` (``mlx_lm.models.base``), imported by
name into each model module; it runs mlx's fused kernel, which never materialises the
probabilities. While a capture runs, that name in the model's module points at a wrapper that
calls the original (so the model computes exactly what it always does) and, for the wanted
query rows, also computes ``softmax(Q K^T * scale + mask)`` from the very arrays the layer
passed: the keys after RoPE and the cache, the layer's own mask and scale. ``probs @ V`` is
compared with the fused kernel's output on those rows, so a capture that is not the
attention the engine ran shows as a reconstruction error.
"""

from __future__ import annotations

from pytest_kvguard.engines.mlx.blas import preload_openblas

preload_openblas()

# mlx is imported only after the BLAS choice above.
import contextlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import maybe_quantize_kv_cache  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from pytest_kvguard.core.errors import EngineError  # noqa: E402
from pytest_kvguard.core.policies import Policy  # noqa: E402
from pytest_kvguard.engines.mlx.caches import eval_caches  # noqa: E402
from pytest_kvguard.engines.protocols import AttentionRows  # noqa: E402

CHUNK = 512
"""Tokens per forward call while filling the cache (as llama.cpp's batch)."""


class _Recorder:
    """Keeps, per layer call of one forward, the wanted rows' probabilities."""

    def __init__(self, original: Any, rows: Sequence[int], width: int) -> None:
        self.original = original
        self.rows = sorted(rows)
        self.width = width
        """Key positions kept: 0 .. the last wanted row."""
        self.layer = 0
        self.probs: dict[int, list[np.ndarray]] = {}
        """Per layer, (n_head, rows of a call, width) arrays, one per forward call."""
        self.max_error = 0.0
        """The largest |probs @ V - fused output| over the rows kept."""
        self.worst_ratio = 0.0
        """The largest such error over what the output's dtype allows (above 1: wrong)."""
        self.learned_sinks = False
        """A layer passed learned sink logits (gpt-oss)."""

    def __call__(self, queries: Any, keys: Any, values: Any, *args: Any, **kwargs: Any) -> Any:
        # mlx-lm's quantized path scales the queries in place (``queries *= scale``): it gets
        # an array of its own, so these stay the ones the layer passed.
        out = self.original(mx.array(queries), keys, values, *args, **kwargs)
        layer, self.layer = self.layer, self.layer + 1
        cache = kwargs["cache"] if "cache" in kwargs else args[0]
        if isinstance(keys, (tuple, list)):  # a QuantizedKVCache: packed data, scales, biases
            keys, values = dequantized(keys, cache), dequantized(values, cache)
        n_queries, n_keys = queries.shape[2], keys.shape[2]
        first = n_keys - n_queries  # a full cache: key j is position j
        local = [r - first for r in self.rows if 0 <= r - first < n_queries]
        if not local:
            return out
        scale = float(kwargs["scale"] if "scale" in kwargs else args[1])
        mask = kwargs.get("mask", args[2] if len(args) > 2 else None)
        sinks = kwargs.get("sinks", args[3] if len(args) > 3 else None)
        self.learned_sinks = self.learned_sinks or sinks is not None
        probs = attention_probs(queries, keys, scale, mask, local, sinks)
        repeats = queries.shape[1] // keys.shape[1]
        expected = probs @ mx.repeat(values, repeats, axis=1).astype(mx.float32)
        got = out[:, :, mx.array(local), :].astype(mx.float32)
        error = float(mx.abs(expected - got).max())
        # The kernel's output is rounded to the model's dtype: allow a few units of it.
        allowed = max(1e-3, 8 * float(mx.finfo(out.dtype).eps) * float(mx.abs(got).max()))
        self.max_error = max(self.max_error, error)
        self.worst_ratio = max(self.worst_ratio, error / allowed)
        kept = np.array(probs[0, :, :, : self.width])
        kept = np.pad(kept, [(0, 0), (0, 0), (0, self.width - kept.shape[-1])])
        self.probs.setdefault(layer, []).append(kept)
        return out


def dequantized(packed: Sequence[Any], cache: Any) -> Any:
    """The keys or values a ``QuantizedKVCache`` holds (packed data, scales, biases), as its
    quantized matmuls read them."""
    data, scales, biases = packed
    return mx.dequantize(data, scales, biases, group_size=cache.group_size, bits=cache.bits)


def attention_probs(
    queries: Any, keys: Any, scale: float, mask: Any, local: Sequence[int], sinks: Any = None
) -> Any:
    """softmax(Q K^T * scale + mask) in float32 for the query rows ``local`` of this call:
    (batch, n_head, len(local), n_keys). A query head ``h`` reads key head ``h // repeats``,
    as mlx's kernel does. Learned sink logits (gpt-oss), where given, join the normalisation
    and are dropped after it: the rows then sum to 1 minus the mass they took."""
    n_queries, n_keys = queries.shape[2], keys.shape[2]
    rows = mx.array(list(local))
    repeats = queries.shape[1] // keys.shape[1]
    q = queries[:, :, rows, :].astype(mx.float32)
    k = mx.repeat(keys, repeats, axis=1).astype(mx.float32)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    if isinstance(mask, str):  # "causal": query i sits at position n_keys - n_queries + i
        allowed = (rows + n_keys - n_queries)[:, None] >= mx.arange(n_keys)[None]
        scores = mx.where(allowed, scores, -mx.inf)
    elif mask is not None:
        picked = mx.take(mask, rows, axis=-2)
        if picked.dtype == mx.bool_:
            scores = mx.where(picked, scores, -mx.inf)
        else:
            scores = scores + picked.astype(mx.float32)
    if sinks is not None:
        sink = mx.broadcast_to(
            sinks.astype(mx.float32)[None, :, None, None], (*scores.shape[:-1], 1)
        )
        return mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return mx.softmax(scores, axis=-1)


def model_module(model: Any) -> Any:
    """The module that defines the model's attention layers (where the name is looked up)."""
    inner = getattr(model, "model", None) or getattr(model, "language_model", None) or model
    layers = getattr(inner, "layers", None)
    if not layers:
        raise EngineError(f"mlx model {type(model).__name__} has no .layers to capture")
    attention = getattr(layers[0], "self_attn", None)
    module = sys.modules[type(attention if attention is not None else layers[0]).__module__]
    if not hasattr(module, "scaled_dot_product_attention"):
        raise EngineError(
            f"{module.__name__} does not call mlx-lm's scaled_dot_product_attention by name, so "
            "its attention probabilities cannot be captured"
        )
    return module


@contextlib.contextmanager
def _patched(module: Any, recorder: _Recorder) -> Iterator[None]:
    original = module.scaled_dot_product_attention
    module.scaled_dot_product_attention = recorder
    try:
        yield
    finally:
        module.scaled_dot_product_attention = original


def feed_spans(width: int, first_row: int, quantized: bool) -> list[tuple[int, int]]:
    """The (start, end) of each forward call over positions 0 .. width - 1: ``CHUNK`` tokens
    each; a quantized capture also starts a call at the first wanted row, so that every
    wanted row attends over a cache mlx-lm has already quantized (as its decode steps do)."""
    cuts = {*range(0, width, CHUNK), width}
    if quantized and 0 < first_row < width:
        cuts.add(first_row)
    ends = sorted(cuts)
    return list(zip(ends[:-1], ends[1:], strict=True))


def capture(
    model: Any, token_ids: Sequence[int], rows: Sequence[int], precision: Policy | None = None
) -> tuple[np.ndarray, float, bool]:
    """Feed ``token_ids`` up to the last wanted row through full ``KVCache``s, ``CHUNK`` tokens
    per call, and return the attention probabilities (layer, head, row, key position) of the
    rows ``rows`` (ascending), the largest reconstruction error (see the module doc) as a
    share of what the output's dtype allows (above 1: not the engine's attention), and whether
    the model has learned sink logits. With a precision's ``kv_bits``, mlx-lm's own
    ``maybe_quantize_kv_cache`` runs after each call, as ``generate_step`` runs it after each
    step, so the wanted rows read quantized keys and values."""
    module = model_module(model)
    width = max(rows) + 1
    recorder = _Recorder(module.scaled_dot_product_attention, rows, width)
    n_layers = len(model.layers)
    caches: list[Any] = [KVCache() for _ in range(n_layers)]
    bits = None if precision is None else precision.kv_bits
    with _patched(module, recorder):
        for start, end in feed_spans(width, min(rows), bits is not None):
            recorder.layer = 0
            chunk = mx.array(list(token_ids[start:end]))[None]
            model(chunk, cache=caches)  # the logits are not needed: evaluate the caches only
            eval_caches(caches)
            if precision is not None and bits is not None:
                maybe_quantize_kv_cache(
                    caches, precision.quantized_kv_start, precision.kv_group_size, bits
                )
            if recorder.layer != n_layers:
                raise EngineError(
                    f"{module.__name__}: {recorder.layer} attention calls for {n_layers} layers; "
                    "kvguard cannot tell which layer each call belongs to"
                )
    probs = np.stack([np.concatenate(recorder.probs[i], axis=1) for i in range(n_layers)])
    return probs, recorder.worst_ratio, recorder.learned_sinks


def read_attention(
    model: Any, token_ids: Sequence[int], queries: Sequence[int], precision: Policy | None = None
) -> AttentionRows:
    """``capture`` as the Engine protocol's ``attention`` returns it."""
    started = time.perf_counter()
    probs, error, learned_sinks = capture(model, token_ids, queries, precision)
    bits = None if precision is None else precision.kv_bits
    return AttentionRows(
        probs,
        "softmax(QK^T) of the arrays mlx-lm's layers pass to its fused attention"
        + ("" if bits is None else f", keys and values dequantized from {bits} bits"),
        time.perf_counter() - started,
        reconstruction_error=error,
        learned_sinks=learned_sinks,
    )
