"""mlx streams, stream groups and prefix caches: a policy's mlx-lm caches fed by the model."""

from __future__ import annotations

from pytest_kvguard.engines.mlx.blas import preload_openblas

BLAS_PATH = preload_openblas()

# The engine is imported only after the BLAS choice above.
from collections.abc import Sequence  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import maybe_quantize_kv_cache  # noqa: E402
from mlx_lm.models.cache import (  # noqa: E402
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from pytest_kvguard.core.errors import EngineError, EngineRefusal  # noqa: E402
from pytest_kvguard.core.policies import Policy  # noqa: E402
from pytest_kvguard.core.scoring import nll_of  # noqa: E402
from pytest_kvguard.engines.mlx.caches import (  # noqa: E402
    cache_nbytes,
    cache_size,
    eval_caches,
    make_caches,
)

if TYPE_CHECKING:
    from pytest_kvguard.engines.mlx.engine import MlxEngine


class MlxStream:
    def __init__(
        self, engine: MlxEngine, policy: Policy, group: MlxStreamGroup | None = None
    ) -> None:
        # Absolute positions and one-token eviction only: engines.check_policy refuses the rest.
        self.model = engine.model
        self.weight_bytes = engine.weight_bytes
        self.policy = policy
        self.group = group
        """The stream group this is a row of: mlx's memory counters measure the whole process,
        so a row's peak and active memory are those of the calls it made alone, one row after
        another (``feeding``), before the rows decode together."""
        self.memory: dict[str, float] = {}
        """Peak and active memory as last measured: at each sample point when alone, after
        each call it made alone when a row of a group."""
        self.measured_kv_bytes = 0.0
        """The cache's bytes when ``memory`` was measured."""
        self.active_before = 0.0
        if group is None:
            self._start_measuring()
        self.cache = make_caches(self.model, policy)
        self.version = engine.version()
        self.quantized_from: int | None = None
        """Tokens fed when mlx-lm first quantized a layer's cache (``kv_bits``)."""
        self.unquantized_layers = 0
        """Layers mlx-lm left unquantized after the last call although they held more than
        ``quantized_kv_start`` tokens (mlx-lm 0.28.0 skips every cache but ``KVCache``)."""

    def _start_measuring(self) -> None:
        mx.synchronize()
        mx.reset_peak_memory()
        self.active_before = float(mx.get_active_memory())

    def _measure(self) -> None:
        """mlx counts every array in the process, other models' weights included: this model's
        weights plus what the run added on top of what was there when it began."""
        mx.synchronize()
        peak = float(mx.get_peak_memory())
        self.measured_kv_bytes = self._kv_bytes()
        self.memory = {
            "peak_memory_bytes": peak - self.active_before + self.weight_bytes,
            "process_peak_memory_bytes": peak,
            "active_memory_bytes": float(mx.get_active_memory()) - self.active_before,
        }

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
        """One forward pass of the model over ``token_ids`` with this stream's caches. A row of
        a group is fed alone through its fill and its first one-token call (``feeding``): its
        memory is measured over those calls, as a stream of its own measures it throughout."""
        group = self.group
        if group is not None and group.measuring is not self:
            if self.memory:
                group.measuring = None  # a measured row fed alone again: no one's figures now
            else:
                # The row's first call: counters start here, what other rows hold is theirs.
                group.measuring = self
                self._start_measuring()
        try:
            rows = self.model(mx.array(list(token_ids))[None], cache=self.cache)
            if not logits:
                # The logits are computed all the same (and not copied out): the peak of a
                # memory run counts them, as a prefill that ends in logits does.
                mx.eval(rows)
                out = np.empty((0, rows.shape[-1]), dtype=np.float32)
            else:
                out = np.array(rows[0].astype(mx.float32))
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"mlx-lm forward pass failed: {exc}") from None
        del rows
        if self.policy.kv_bits is not None:
            self._quantize()
        if group is not None and group.measuring is self:
            self._measure()
        return out

    def _quantize(self) -> None:
        """mlx-lm's own step after each model call in ``generate_step``: quantize the caches
        that hold ``quantized_kv_start`` tokens or more. Its refusal (``NotImplementedError``
        for a ``RotatingKVCache`` from 0.28.1 on) is reported as the engine's, in one line."""
        p = self.policy
        try:
            maybe_quantize_kv_cache(self.cache, p.quantized_kv_start, p.kv_group_size, p.kv_bits)
        except NotImplementedError as exc:
            kinds = sorted({type(c).__name__ for c in self.cache
                            if not isinstance(c, QuantizedKVCache)})  # fmt: skip
            raise EngineRefusal(
                f"mlx-lm {self.version} refuses to quantize {' and '.join(kinds)} to "
                f"{p.kv_bits} bits ({p.describe()}): NotImplementedError: {exc}",
                fix="quantize a full cache, or keep this policy unquantized",
            ) from None
        quantized = [isinstance(c, QuantizedKVCache) for c in self.cache]
        if any(quantized) and self.quantized_from is None:
            self.quantized_from = max(int(c.offset) for c in self.cache)
        self.unquantized_layers = sum(
            not q and int(c.offset) > p.quantized_kv_start
            for q, c in zip(quantized, self.cache, strict=True)
        )

    def _kv_bytes(self) -> float:
        return float(sum(cache_nbytes(c) for c in self.cache))

    def figures(self) -> dict[str, float]:
        if self.group is None:
            self._measure()
        kv_bytes = self._kv_bytes()
        figures = {
            "kv_bytes": kv_bytes,
            "kv_entries_total": float(sum(cache_size(c) for c in self.cache)),
        }
        if self.policy.kv_bits is not None:
            figures["kv_layers_unquantized"] = float(self.unquantized_layers)
        # A grouped row's memory figures hold while its cache has not grown since they were
        # measured (a rotating cache, full, does not); otherwise it has none to report.
        if kv_bytes == self.measured_kv_bytes:
            figures.update(self.memory)
        return figures

    def layer_sizes(self) -> list[tuple[int, int]]:
        """(offset, size) per layer: tokens seen, and KV entries held."""
        return [(int(c.offset), cache_size(c)) for c in self.cache]

    def close(self) -> None:
        self.cache = []


class _RowStack:
    """One layer's caches of a stream group, seen by the model as one batched cache: each row's
    keys and values go to that row's own mlx-lm cache, and what the caches return is stacked
    back. Rows of a group hold the same number of entries, so the stacks line up."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows

    @property
    def offset(self) -> int:
        return int(self.rows[0].offset)  # rows have been fed as many tokens: one position

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.rows[0].make_mask(*args, **kwargs)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        fetched = [
            cache.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            for i, cache in enumerate(self.rows)
        ]
        return (mx.concatenate([k for k, _ in fetched]), mx.concatenate([v for _, v in fetched]))


class MlxStreamGroup:
    """Streams whose rotating caches each decode their next token in one forward pass, the
    rows stacked along the batch dimension. Batched matmuls round differently from one row's,
    so scores are close to, not bit-identical with, the same stream decoding alone
    (tests/test_batched_runs.py bounds it)."""

    def __init__(self, engine: MlxEngine, policies: Sequence[Policy]) -> None:
        self.model = engine.model
        self.measuring: MlxStream | None = None
        """The row whose calls alone mlx's memory counters measure now, if any."""
        self.streams: list[MlxStream] = [MlxStream(engine, p, self) for p in policies]

    def feed_rows(self, rows: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        self.measuring = None  # the counters now count every row
        chosen = [self.streams[row] for row in rows]
        per_layer = zip(*(stream.cache for stream in chosen), strict=True)
        layers = [_RowStack(list(row_caches)) for row_caches in per_layer]
        batch = mx.array([[token] for token in token_ids])
        try:
            logits = self.model(batch, cache=layers)
            return np.array(logits[:, -1].astype(mx.float32))
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"mlx-lm batched forward pass failed: {exc}") from None

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


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
            self.engine.model(chunk, cache=self.cache)
            eval_caches(self.cache)
        self.n_tokens = start + len(token_ids)

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        """Decode ``token_ids[:-1]`` with logits for each; -log p of each next token."""
        decoded, targets = token_ids[:-1], np.asarray(token_ids[1:])
        nll = []
        for offset in range(0, len(decoded), self.CHUNK):
            chunk = mx.array(list(decoded[offset : offset + self.CHUNK]))[None]
            logits = np.array(self.engine.model(chunk, cache=self.cache)[0].astype(mx.float32))
            nll.append(nll_of(logits, targets[offset : offset + logits.shape[0]]))
        self.n_tokens = start + len(decoded)
        return np.concatenate(nll) if nll else np.zeros(0)

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
