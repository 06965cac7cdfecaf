"""KV-cache policies: what is kept when the cache is full, and how positions are handled."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvguard.errors import KvguardError

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
        """Short label for tables: ``sink4/256 reidx step1``."""
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
) -> Policy:
    """Build a policy, refusing combinations that would not mean what they say.

    ``full``, ``swa`` and ``swa_full`` take no cap (the model decides what each layer keeps).
    ``chunk`` does not apply to ``full`` and ``swa_full``: they never evict, so their runs are
    fed in prefill-sized chunks whatever it says. Whether a chunk fits is for
    ``engines.support.check_chunk``, the one place that refuses a chunk.
    """
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
