"""The mlx-lm adapter: ``engine`` loads a model (``gguf`` for a GGUF file); ``caches`` maps
policies to mlx-lm's own cache classes; ``stream`` feeds them; ``attention`` reads the softmax
its layers compute; ``kv_size`` predicts the KV bytes they hold (no mlx import).

Importing this package imports no engine: the adapter's names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "load": "engine",
    "MlxEngine": "engine",
    "MlxStream": "stream",
    "MlxStreamGroup": "stream",
    "MlxPrefixCache": "stream",
    "make_caches": "caches",
    "chunk_visibility": "caches",
    "cache_size": "caches",
    "cache_nbytes": "caches",
    "eval_caches": "caches",
}


def __getattr__(name: str) -> Any:
    """``from pytest_kvguard.engines.mlx import make_caches`` still works, lazily."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
