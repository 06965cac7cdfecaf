"""The llama-server adapter's declaration, registered under the
``pytest_kvguard.engines`` entry point (pyproject.toml) and read by ``engines.registry``.
Imports no engine."""

from __future__ import annotations

from pytest_kvguard.engines.registry import EngineInfo

ADAPTER = EngineInfo(
    "llama_server",
    "pytest_kvguard.engines.served.llama_server",
    "pytest_kvguard",
    "llama-server",
    "bash .ci/install (builds llama-server into .venv/bin), or set KVGUARD_LLAMA_SERVER",
    policies={
        "prefix_cache": ("full", "swa", "swa_full"),
        "generation": ("window", "sink", "engine_default"),
        "draft_decoding": ("full", "swa", "swa_full"),
    },
    position_modes=("reindexed",),
    model_forms=("gguf", "url"),
    context_step=256,
    binary=True,
    capabilities=frozenset({"shifts", "replay", "speculates"}),
    speculative_drafts=("gguf_q4_0", "gguf_q3_k"),
    kv_precision="cache_types",
    kv_precision_paths=("prefix_cache", "generation"),
)
