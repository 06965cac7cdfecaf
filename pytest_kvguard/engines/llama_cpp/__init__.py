"""The llama.cpp adapter (llama-cpp-python): ``engine`` loads a model; ``stream``,
``prefix_cache`` and ``group`` run policies on its contexts (``context``); ``attention`` reads its
softmax tensors; ``kv_size`` predicts the KV bytes it holds (no llama.cpp import).

Importing this package imports no engine: the adapter's names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "load": "engine",
    "LlamaCppEngine": "engine",
    "LlamaCppStream": "stream",
    "LlamaCppPrefixCache": "prefix_cache",
    "LlamaCppStreamGroup": "group",
    "SEQ": "context",
    "UBATCH": "context",
}


def __getattr__(name: str) -> Any:
    """``from pytest_kvguard.engines.llama_cpp import LlamaCppStream`` still works, lazily."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
