"""mlx-lm adapter: policies are mlx-lm's own cache classes, used as mlx-lm ships them.

full = ``KVCache``; sink = ``RotatingKVCache(cap, keep=S)``; window = ``RotatingKVCache(cap,
keep=0)``; swa = the model's own ``make_cache()``; engine_default =
``make_prompt_cache(model, max_kv_size=cap)`` exactly as mlx-lm users call it. mlx-lm stores keys
already rotated at their absolute position, so positions are always ``absolute``.

On Linux, OpenBLAS is preloaded before mlx where installed (see ``blas.py``).
"""

from __future__ import annotations

from pytest_kvguard.engines.blas import preload_openblas

BLAS_PATH = preload_openblas()

# The engine is imported only after the BLAS choice above.
import importlib.metadata  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import (  # noqa: E402
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from pytest_kvguard.engines import EngineOptions  # noqa: E402
from pytest_kvguard.engines.mlx_gguf import load_gguf_model  # noqa: E402
from pytest_kvguard.errors import EngineError, KvguardError  # noqa: E402
from pytest_kvguard.policies import Policy  # noqa: E402


def load(model_path: Path, options: EngineOptions) -> MlxEngine:
    return MlxEngine(model_path, options)


def _gguf_tokenizer(path: Path) -> Any:
    """llama.cpp's own tokenizer for the GGUF (vocab only): both engines see the same ids."""
    try:
        from pytest_kvguard.engines.llama_cpp import GgufVocab
    except ImportError:
        raise KvguardError(
            "tokenizing a GGUF model for mlx needs llama-cpp-python (vocab only)",
            fix='pip install "pytest-kvguard[llama]"',
        ) from None
    return GgufVocab(path)


class MlxEngine:
    name = "mlx"

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        self.model_path = model_path
        self.options = options
        if model_path.is_file():
            self.model, self.facts = load_gguf_model(model_path)
            self._tokenizer = _gguf_tokenizer(model_path)
            self._encode = self._tokenizer.tokenize
            self._render = self._tokenizer.render_chat
        else:
            # An mlx-lm model folder, or a hub id on machines that can reach the hub.
            from mlx_lm import load as mlx_load

            self.model, tokenizer = mlx_load(str(model_path))[:2]
            self.facts = {"weights": "mlx_lm.load", "architecture": self.model.model_type}
            self._encode = tokenizer.encode
            self._render = lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)
        self.kv_element_bytes = float(_float_dtype(self.model).size)
        self.weight_bytes = float(_weight_bytes(self.model))
        """Caches take the activations' dtype: float32 for a dequantized GGUF, else the model's."""

    def version(self) -> str:
        return importlib.metadata.version("mlx-lm")

    def describe(self) -> dict[str, str]:
        return {
            "engine": f"mlx-lm {self.version()}, mlx {importlib.metadata.version('mlx')}",
            "device": str(mx.default_device()),
            "blas": BLAS_PATH,
            **self.facts,
        }

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return str(self._render(messages))

    def open_stream(self, policy: Policy, max_tokens: int) -> MlxStream:
        return MlxStream(self, policy)

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> MlxPrefixCache:
        return MlxPrefixCache(self, policy)

    def close(self) -> None:
        self.model = None
        mx.clear_cache()


def _weight_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(int(value.nbytes) for _, value in tree_flatten(model.parameters()))


def _float_dtype(model: Any) -> Any:
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def cache_size(cache: Any) -> int:
    """KV entries one layer's cache holds. ``size()`` arrived in mlx-lm 0.30.4; before it, a
    ``KVCache`` held its offset and a ``RotatingKVCache`` at most ``max_size`` of it."""
    if hasattr(cache, "size"):
        return int(cache.size())
    if isinstance(cache, RotatingKVCache):
        return int(min(cache.offset, cache.max_size))
    return int(cache.offset)


def cache_nbytes(cache: Any) -> int:
    """Bytes of one layer's K and V buffers as allocated. ``nbytes`` arrived in mlx-lm 0.31; it
    is the same sum of the two arrays' sizes."""
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


class MlxStream:
    def __init__(self, engine: MlxEngine, policy: Policy) -> None:
        # Absolute positions and one-token eviction only: engines.check_policy refuses the rest.
        self.model = engine.model
        self.weight_bytes = engine.weight_bytes
        self.policy = policy
        mx.synchronize()
        mx.reset_peak_memory()
        self.active_before = mx.get_active_memory()
        self.cache = make_caches(self.model, policy)

    def _rotating(self) -> list[Any]:
        return [c for c in self.cache if isinstance(c, RotatingKVCache)]

    @property
    def held(self) -> int:
        return max(cache_size(c) for c in self.cache)

    @property
    def evicted(self) -> int:
        return max((int(c.offset) - cache_size(c) for c in self._rotating()), default=0)

    def room(self) -> int | None:
        rotating = self._rotating()
        if not rotating:
            return None
        return min(int(c.max_size) - cache_size(c) for c in rotating)

    def feed(self, token_ids: Sequence[int], logits: bool = True) -> np.ndarray:
        try:
            rows = self.model(mx.array(list(token_ids))[None], cache=self.cache)
            if not logits:
                mx.eval(rows)  # the cache is filled lazily; evaluate without copying out
                return np.empty((0, rows.shape[-1]), dtype=np.float32)
            out = np.array(rows[0].astype(mx.float32))
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"mlx-lm forward pass failed: {exc}") from None
        return out

    def figures(self) -> dict[str, float]:
        mx.synchronize()
        return {
            "kv_bytes": float(sum(cache_nbytes(c) for c in self.cache)),
            "kv_entries_total": float(sum(cache_size(c) for c in self.cache)),
            # mlx counts every array in the process, other models' weights included: this
            # model's weights plus what the run added on top of what was there when it began.
            "peak_memory_bytes": float(mx.get_peak_memory())
            - self.active_before
            + self.weight_bytes,
            "process_peak_memory_bytes": float(mx.get_peak_memory()),
            "active_memory_bytes": float(mx.get_active_memory() - self.active_before),
        }

    def layer_sizes(self) -> list[tuple[int, int]]:
        """(offset, size) per layer: tokens seen, and KV entries held."""
        return [(int(c.offset), cache_size(c)) for c in self.cache]

    def close(self) -> None:
        self.cache = []


class MlxPrefixCache:
    """A prompt held in mlx-lm caches; an edited prompt reuses what mlx-lm's trim allows.

    ``can_trim_prompt_cache`` / ``trim_prompt_cache`` decide, as in mlx-lm's own prompt caching:
    a ``RotatingKVCache`` that has wrapped cannot be trimmed, so the prompt is re-prefilled.
    """

    CHUNK = 512

    def __init__(self, engine: MlxEngine, policy: Policy) -> None:
        self.engine = engine
        self.policy = policy
        self.cache = make_caches(engine.model, policy)
        self.n_tokens = 0

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        for offset in range(0, len(token_ids), self.CHUNK):
            chunk = mx.array(list(token_ids[offset : offset + self.CHUNK]))[None]
            mx.eval(self.engine.model(chunk, cache=self.cache))
        self.n_tokens = start + len(token_ids)

    def keep_prefix(self, keep: int) -> tuple[int, int | None]:
        drop = self.n_tokens - keep
        if can_trim_prompt_cache(self.cache) and trim_prompt_cache(self.cache, drop) == drop:
            self.n_tokens = keep
        else:
            self.cache = make_caches(self.engine.model, self.policy)
            self.n_tokens = 0
        return self.n_tokens, None

    def memory_bytes(self) -> dict[str, float]:
        return {
            "state_bytes": float(sum(cache_nbytes(c) for c in self.cache)),
            "checkpoint_bytes": 0.0,
            "checkpoints": 0.0,
        }

    def close(self) -> None:
        self.cache = []
