"""The llama.cpp (llama-cpp-python) adapter's declaration, registered under the
``pytest_kvguard.engines`` entry point (pyproject.toml) and read by ``engines.registry``.
Imports no engine."""

from __future__ import annotations

from pytest_kvguard.engines.registry import EngineInfo

ADAPTER = EngineInfo(
    "llama_cpp",
    "pytest_kvguard.engines.llama_cpp.engine",
    "llama_cpp",
    "llama-cpp-python",
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON '
    '-DGGML_F16C=ON" pip install "pytest-kvguard[llama]"',
    policies={
        "feed": ("full", "window", "sink"),
        "feed_unscored": ("full", "window", "sink", "swa", "swa_full"),
        "prefix_cache": ("full", "swa", "swa_full"),
        "api_reuse": ("full", "swa", "swa_full"),
        "generation": ("window", "sink"),
        "draft_decoding": ("full", "swa", "swa_full"),
    },
    max_chunk=512,
    self_evicting=("swa",),
    capabilities=frozenset({"reads_attention", "groups", "snapshot", "api_reuse", "speculates"}),
    speculative_drafts=("prompt_lookup",),
    kv_precision="cache_types",
    kv_precision_paths=("feed", "reads_attention"),
    kv_size="pytest_kvguard.engines.llama_cpp.kv_size",
    api_states=("none", "ram", "disk", "saved"),
    window_probe=True,
    architecture_probe="pytest_kvguard.engines.llama_cpp.model_probe:llama_cpp_refusal",
)
