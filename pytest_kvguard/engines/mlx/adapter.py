"""The mlx-lm adapter's declaration, registered under the
``pytest_kvguard.engines`` entry point (pyproject.toml) and read by ``engines.registry``.
Imports no engine."""

from __future__ import annotations

import sys
from collections.abc import Set

from pytest_kvguard.engines.registry import EngineInfo, installed_version

ADAPTER = EngineInfo(
    "mlx",
    "pytest_kvguard.engines.mlx.engine",
    "mlx_lm",
    "mlx-lm",
    'pip install "pytest-kvguard[mlx]"',
    policies={
        "feed": ("full", "window", "sink", "swa", "engine_default"),
        "feed_unscored": ("full", "window", "sink", "swa", "engine_default"),
        "prefix_cache": ("full", "swa"),
        "api_reuse": ("full", "swa"),
        "generation": ("window", "sink", "engine_default"),
        "draft_decoding": ("full", "window", "sink", "swa", "engine_default"),
    },
    position_modes=("absolute",),
    fixed_evict_step=1,
    model_forms=("gguf", "folder", "hub"),
    gguf_architectures=("llama", "gemma3"),  # engines/mlx/gguf.py maps these
    capabilities=frozenset({"reads_attention", "groups", "api_reuse", "speculates"}),
    speculative_drafts=("gguf_q3_k", "gguf_q4_0", "mlx_q4", "mlx_q3"),
    speculative_prefilled=True,
    kv_precision="kv_bits",
    kv_precision_paths=("feed", "reads_attention"),
    kv_size="pytest_kvguard.engines.mlx.kv_size",
    companions=f"{__name__}:companions",
    prepare="pytest_kvguard.engines.mlx.blas:prepare",
)


def companions(requested: Set[str]) -> list[str]:
    """What an environment with mlx-lm needs besides it: on Linux mlx runs through the
    mlx[cpu] wheel; on a GGUF model its tokens come from llama.cpp's tokenizer, so
    llama-cpp-python comes too (this environment's version, which pip's wheel cache usually
    has)."""
    extra = []
    if sys.platform == "linux" and "mlx" not in requested:
        extra.append("mlx[cpu]")
    if "llama-cpp-python" not in requested:
        here = installed_version("llama_cpp")
        extra.append(f"llama-cpp-python=={here}" if here else "llama-cpp-python")
    return extra
