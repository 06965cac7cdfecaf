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

from pytest_kvguard.engines import AttentionRows, EngineOptions  # noqa: E402
from pytest_kvguard.engines.conversation import Turn  # noqa: E402
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
            self._piece = self._tokenizer.token_piece
            self.bos_id: int | None = self._tokenizer.bos_id
        else:
            # An mlx-lm model folder, or a hub id on machines that can reach the hub.
            from mlx_lm import load as mlx_load

            self.model, tokenizer = mlx_load(str(model_path))[:2]
            self.facts = {"weights": "mlx_lm.load", "architecture": self.model.model_type}
            self._encode = tokenizer.encode
            self._piece = lambda token_id: tokenizer.decode([token_id])
            self.bos_id = tokenizer.bos_token_id
            self._render = lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)
        self._group_keys: dict[Policy, tuple[str, int] | None] = {}
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

    def token_piece(self, token_id: int) -> str:
        return str(self._piece(token_id))

    def attention(self, token_ids: Sequence[int], queries: Sequence[int]) -> AttentionRows:
        """The softmax of the queries and keys mlx-lm's layers pass (``mlx_attention``)."""
        from pytest_kvguard.engines.mlx_attention import read_attention

        return read_attention(self.model, token_ids, queries)

    def open_stream(self, policy: Policy, max_tokens: int) -> MlxStream:
        return MlxStream(self, policy)

    group_figures_own = True
    """A row of a stream group reports its own memory figures: its cache's bytes throughout,
    mlx's peak and active memory as measured over the calls it makes alone (its fill and first
    one-token call), which settle them for a cache whose every layer rotates."""

    def group_key(self, policy: Policy) -> tuple[str, int] | None:
        """Policies with the same key decode together (``open_stream_group``): every layer a
        ``RotatingKVCache`` of one size. Such caches, fed a token at a time once full, hold as
        many entries at every step whatever their ``keep``, so their keys stack along the batch
        dimension; and once full they grow no more, so a row's memory measured up to then is
        its run's. None for anything else (a layer that keeps everything, or rotates at another
        size, goes on growing past the point where the row joins the group)."""
        if policy.chunk != 1 or policy.kind == "full":
            return None
        if policy not in self._group_keys:
            try:
                caches = make_caches(self.model, policy)
            except KvguardError:
                caches = []
            sizes = {int(c.max_size) for c in caches if isinstance(c, RotatingKVCache)}
            rotating = bool(caches) and all(isinstance(c, RotatingKVCache) for c in caches)
            self._group_keys[policy] = (
                ("rotating", sizes.pop()) if rotating and len(sizes) == 1 else None
            )
        return self._group_keys[policy]

    def open_stream_group(self, policies: Sequence[Policy], max_tokens: int) -> MlxStreamGroup:
        keys = {self.group_key(p) for p in policies}
        if None in keys or len(keys) != 1:
            raise ValueError(f"these policies cannot decode together: {policies}")
        return MlxStreamGroup(self, policies)

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> MlxPrefixCache:
        return MlxPrefixCache(self, policy)

    def converse(
        self, policy: Policy, token_ids: Sequence[int], turns: Sequence[Turn], prefill_step: int
    ) -> np.ndarray:
        """The turns through ``mlx_lm.generate.generate_step``, as mlx-lm's own generate and
        server call it: one prompt cache for the conversation (for ``engine_default`` exactly
        what ``generate_step(max_kv_size=cap)`` builds), each prompt prefilled in steps of
        ``prefill_step_size``, each reply generated by a sampler that returns the text's next
        token (teacher forcing through the public sampler hook), scored from the log
        probabilities generate_step yields.
        """
        from mlx_lm.generate import generate_step

        cache = make_caches(self.model, policy)
        nll = np.full(len(token_ids) - 1, np.nan)
        done = 0
        for turn in turns:
            prompt = mx.array(list(token_ids[done : done + turn.prompt]))
            done += turn.prompt
            reply = list(token_ids[done : done + turn.reply])
            # generate_step samples once more than it yields (that token is never fed): any id.
            forced = iter([*reply, reply[-1]])
            steps = generate_step(
                prompt,
                self.model,
                prompt_cache=cache,
                prefill_step_size=prefill_step,
                sampler=lambda logprobs, forced=forced: mx.array([next(forced)]),
                max_tokens=len(reply),
            )
            try:
                for k, (_, logprobs) in enumerate(steps):
                    nll[done + k - 1] = -float(logprobs[reply[k]].astype(mx.float32).item())
            except (RuntimeError, ValueError) as exc:
                raise EngineError(f"mlx-lm generate_step failed: {exc}") from None
            done += len(reply)
        return nll

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


def eval_caches(caches: Sequence[Any]) -> None:
    """Compute what the model's last call wrote into its caches, and nothing else: the graph
    for the logits (the final norm and the vocabulary projection, Gemma 3's 262,144 rows) is
    dropped unevaluated. mlx-lm's own prompt prefill does the same (``mx.eval([c.state for c in
    prompt_cache])`` in generate_step); the cached keys and values are the same either way."""
    mx.eval([c.state for c in caches])


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
        if group is not None and group.measuring is self:
            self._measure()
        return out

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
