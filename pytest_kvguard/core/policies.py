"""KV-cache policies: what is kept when the cache is full, and how positions are handled."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pytest_kvguard.core.errors import KvguardError

POLICY_KINDS = {
    "full": "keep every token (the reference)",
    "window": "keep the `cap` most recent tokens, nothing pinned",
    "sink": "pin the first `sinks` tokens, rotate the rest; `cap` counts the sinks",
    "swa": "the model's own sliding-window cache (llama.cpp iSWA default; mlx-lm make_cache())",
    "swa_full": "sliding layers keep full history too (llama.cpp swa_full)",
    "engine_default": "whatever the engine does when a user asks for `cap` "
    "(mlx-lm make_prompt_cache(model, max_kv_size=cap))",
}
DEFAULT_CHECKPOINT_STEP = 512

POSITION_MODES = {
    "reindexed": "survivors shift down after eviction (llama.cpp context shift, StreamingLLM)",
    "absolute": "survivors keep the position they were written at (mlx-lm RotatingKVCache)",
}

DEFAULT_SINKS = 4

MLX_KV_BITS = (2, 3, 4, 5, 6, 8)
"""Bits mlx's ``mx.quantize`` packs (what mlx-lm's ``kv_bits`` takes)."""
MLX_KV_GROUP_SIZES = (32, 64, 128)
"""Group sizes mlx's ``mx.quantize`` takes; mlx-lm's default is 64."""
DEFAULT_KV_GROUP_SIZE = 64

LLAMA_CACHE_TYPES = {
    # name: (bytes per block, elements per block), ggml's block layouts.
    "f32": (4, 1),
    "f16": (2, 1),
    "bf16": (2, 1),
    "q8_0": (34, 32),
    "q4_0": (18, 32),
    "q4_1": (20, 32),
    "iq4_nl": (18, 32),
    "q5_0": (22, 32),
    "q5_1": (24, 32),
}
"""The cache types llama.cpp takes for K and V (``-ctk`` / ``-ctv``, ``type_k`` / ``type_v``)."""
UNQUANTIZED_CACHE_TYPES = ("f32", "f16", "bf16")
DEFAULT_CACHE_TYPE = "f16"


@dataclass(frozen=True)
class Policy:
    """A cache policy, complete with its eviction and position handling."""

    kind: str
    """One of POLICY_KINDS."""
    cap: int | None = None
    """Total KV entries kept per layer, sinks included; None only for ``full``."""
    sinks: int = 0
    """Leading tokens pinned forever (``sink`` only)."""
    positions: str = "reindexed"
    """One of POSITION_MODES."""
    evict_step: int = 1
    """Tokens dropped per eviction; 1 matches mlx-lm and StreamingLLM."""
    checkpoints: int = 0
    """``swa`` only: at most this many copies of the sliding-layer state kept while prefilling."""
    checkpoint_step: int = DEFAULT_CHECKPOINT_STEP
    """Minimum tokens between two checkpoints."""
    chunk: int = 1
    """Tokens fed per engine call once the cache is full: 1 is the decode path, more the
    engine's batched (prefill) path, which evicts for the whole chunk at once."""
    kv_bits: int | None = None
    """mlx-lm: quantize the cache to this many bits (``kv_bits``); None keeps it unquantized."""
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    """mlx-lm: elements sharing one scale and bias (``kv_group_size``)."""
    quantized_kv_start: int = 0
    """mlx-lm: quantize once the cache holds this many tokens (``quantized_kv_start``)."""
    cache_type_k: str = DEFAULT_CACHE_TYPE
    """llama.cpp: the K cache's type (``type_k``, ``-ctk``)."""
    cache_type_v: str = DEFAULT_CACHE_TYPE
    """llama.cpp: the V cache's type (``type_v``, ``-ctv``)."""

    @property
    def quantized(self) -> bool:
        """Whether the KV cache is asked to be quantized (on either engine's terms)."""
        return self.kv_bits is not None or any(
            t not in UNQUANTIZED_CACHE_TYPES for t in (self.cache_type_k, self.cache_type_v)
        )

    @property
    def precision_set(self) -> bool:
        """Whether any KV precision setting differs from the engines' defaults."""
        return self != self.unquantized()

    def unquantized(self) -> Policy:
        """The same policy with the engines' default KV precision."""
        return replace(
            self, kv_bits=None, kv_group_size=DEFAULT_KV_GROUP_SIZE, quantized_kv_start=0,
            cache_type_k=DEFAULT_CACHE_TYPE, cache_type_v=DEFAULT_CACHE_TYPE,
        )  # fmt: skip

    def precision(self) -> str:
        """The KV precision part of the label: ``q8``, ``q4 g32 from1024`` (mlx-lm),
        ``q8_0`` or ``k q8_0 v f16`` (llama.cpp); empty for the defaults."""
        if self.kv_bits is not None:
            group = f" g{self.kv_group_size}" if self.kv_group_size != DEFAULT_KV_GROUP_SIZE else ""
            start = f" from{self.quantized_kv_start}" if self.quantized_kv_start else ""
            return f"q{self.kv_bits}{group}{start}"
        k, v = self.cache_type_k, self.cache_type_v
        if (k, v) == (DEFAULT_CACHE_TYPE, DEFAULT_CACHE_TYPE):
            return ""
        return k if k == v else f"k {k} v {v}"

    @property
    def max_chunk(self) -> int | None:
        """The most tokens one call may feed a full cache: what evictions of ``evict_step``
        tokens can free beside the sinks. None without a cap."""
        if self.cap is None:
            return None
        return (self.cap - self.sinks) // self.evict_step * self.evict_step

    @property
    def bounded(self) -> bool:
        """Whether the policy may evict (or, for engine_default, was asked to)."""
        return self.kind not in ("full", "swa_full")

    def describe(self) -> str:
        """Short label for tables: ``sink4/256 reidx step1``, ``full q8``."""
        precision = self.precision()
        return self._describe_eviction() + (f" {precision}" if precision else "")

    def _describe_eviction(self) -> str:
        if self.kind in ("full", "swa_full"):
            return self.kind
        if self.kind == "swa":
            fed = f" chunk{self.chunk}" if self.chunk > 1 else ""
            if self.checkpoints:
                return f"swa +ckpt {self.checkpoints}x/{self.checkpoint_step}{fed}"
            return f"swa (model window){fed}"
        label = f"sink{self.sinks}/{self.cap}" if self.kind == "sink" else f"{self.kind}/{self.cap}"
        pos = "reidx" if self.positions == "reindexed" else "abs"
        fed = f" chunk{self.chunk}" if self.chunk > 1 else ""
        return f"{label} {pos} step{self.evict_step}{fed}"


def make_policy(
    kind: str,
    *,
    cap: int | None = None,
    sinks: int | None = None,
    positions: str = "reindexed",
    evict_step: int = 1,
    checkpoints: int = 0,
    checkpoint_step: int = DEFAULT_CHECKPOINT_STEP,
    chunk: int = 1,
    kv_bits: int | None = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    quantized_kv_start: int = 0,
    cache_type_k: str = DEFAULT_CACHE_TYPE,
    cache_type_v: str = DEFAULT_CACHE_TYPE,
) -> Policy:
    """Build a policy, refusing combinations that would not mean what they say.

    ``full``, ``swa`` and ``swa_full`` take no cap (the model decides what each layer keeps).
    ``chunk`` does not apply to ``full`` and ``swa_full``: they never evict, so their runs are
    fed in prefill-sized chunks whatever it says. Whether a chunk fits is for
    ``engines.support.check_chunk``, the one place that refuses a chunk. The KV precision
    settings are checked here for values no engine knows; which engine takes which is for
    ``engines.support.check_policy``.
    """
    check_precision(kv_bits, kv_group_size, quantized_kv_start, cache_type_k, cache_type_v)
    return replace(
        _eviction_policy(
            kind, cap=cap, sinks=sinks, positions=positions, evict_step=evict_step,
            checkpoints=checkpoints, checkpoint_step=checkpoint_step, chunk=chunk,
        ),
        kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
        cache_type_k=cache_type_k, cache_type_v=cache_type_v,
    )  # fmt: skip


def check_precision(
    kv_bits: int | None, kv_group_size: int, quantized_kv_start: int, cache_type_k: str,
    cache_type_v: str,
) -> None:  # fmt: skip
    """The KV precision fields, refused where no engine would know the value."""
    if kv_bits is not None and kv_bits not in MLX_KV_BITS:
        raise KvguardError(
            f"kv_bits {kv_bits} is not a width mlx quantizes to",
            fix="use kv_bits: " + ", ".join(map(str, MLX_KV_BITS)),
            key="params.kv_bits",
        )
    if kv_group_size not in MLX_KV_GROUP_SIZES:
        raise KvguardError(
            f"kv_group_size {kv_group_size} is not a group size mlx quantizes with",
            fix="use kv_group_size: " + ", ".join(map(str, MLX_KV_GROUP_SIZES)),
            key="params.kv_group_size",
        )
    if kv_bits is None and (kv_group_size != DEFAULT_KV_GROUP_SIZE or quantized_kv_start):
        which = "kv_group_size" if kv_group_size != DEFAULT_KV_GROUP_SIZE else "quantized_kv_start"
        raise KvguardError(
            f"{which} applies to a quantized cache, and kv_bits is not set",
            fix=f"set kv_bits (e.g. kv_bits: 8), or remove {which}",
            key=f"params.{which}",
        )
    for name, value in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
        if value not in LLAMA_CACHE_TYPES:
            raise KvguardError(
                f"{name} '{value}' is not a cache type llama.cpp takes",
                fix=f"use {name}: " + ", ".join(LLAMA_CACHE_TYPES),
                key=f"params.{name}",
            )


def _eviction_policy(
    kind: str,
    *,
    cap: int | None,
    sinks: int | None,
    positions: str,
    evict_step: int,
    checkpoints: int,
    checkpoint_step: int,
    chunk: int,
) -> Policy:
    """The policy's eviction and position handling, refused where it would not mean what it
    says."""
    if kind not in POLICY_KINDS:
        raise KvguardError(f"unknown policy '{kind}'", fix="use one of " + ", ".join(POLICY_KINDS))
    if positions not in POSITION_MODES:
        raise KvguardError(
            f"unknown position handling '{positions}'",
            fix="use one of " + ", ".join(POSITION_MODES),
            key="params.positions",
        )
    if checkpoints and kind != "swa":
        raise KvguardError(
            f"checkpoints apply to policy 'swa', not '{kind}'",
            fix="use policy: swa, or remove checkpoints",
        )
    if checkpoints < 0 or checkpoint_step < 1:
        raise KvguardError("checkpoints must be >= 0 and checkpoint_step >= 1")
    if kind in ("full", "swa_full"):
        # Nothing is evicted, so cap/sinks/positions do not apply.
        return Policy(kind)
    if kind == "swa":
        return Policy(
            "swa",
            positions=positions,
            checkpoints=checkpoints,
            checkpoint_step=checkpoint_step,
            chunk=chunk,
        )
    if cap is None:
        raise KvguardError(f"policy '{kind}' needs a cap", fix="set params.cap, e.g. cap: 256")
    if sinks is None:
        sinks = DEFAULT_SINKS if kind == "sink" else 0
    if kind in ("window", "engine_default") and sinks:
        raise KvguardError(
            f"policy '{kind}' does not take sinks",
            fix="use policy 'sink' to pin tokens, or remove sinks",
        )
    if kind == "sink" and sinks < 1:
        raise KvguardError("policy 'sink' needs sinks >= 1", fix="use policy 'window' for 0 sinks")
    if evict_step < 1:
        raise KvguardError("evict_step must be >= 1", fix="use 1 to evict one token at a time")
    if cap <= sinks + evict_step - 1 or cap < 2:
        raise KvguardError(
            f"cap {cap} leaves no room for recent tokens (sinks {sinks}, evict_step {evict_step})",
            fix="raise cap above sinks + evict_step",
        )
    return Policy(
        kind, cap=cap, sinks=sinks, positions=positions, evict_step=evict_step, chunk=chunk
    )
