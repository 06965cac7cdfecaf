"""Where an engine runs (threads, GPU layers): the same for every adapter."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pytest_kvguard.core.errors import KvguardError


@dataclass(frozen=True)
class EngineOptions:
    """Knobs that change where an engine runs, not what it computes."""

    n_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    n_gpu_layers: int = 0
    """Layers offloaded to a GPU; -1 for all. Override with KVGUARD_N_GPU_LAYERS."""

    @classmethod
    def from_env(cls) -> EngineOptions:
        kwargs: dict[str, int] = {}
        for attr, var in (
            ("n_threads", "KVGUARD_THREADS"),
            ("n_gpu_layers", "KVGUARD_N_GPU_LAYERS"),
        ):
            raw = os.environ.get(var)
            if raw:
                try:
                    kwargs[attr] = int(raw)
                except ValueError:
                    raise KvguardError(
                        f"${var}={raw!r} is not an integer", fix=f"unset {var}"
                    ) from None
        return cls(**kwargs)
