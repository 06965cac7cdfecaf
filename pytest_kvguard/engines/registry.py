"""The engine adapters kvguard knows: how to find, install and load each, what policies it
implements per engine path, and which optional capabilities (``protocols.CAPABILITIES``) it has.

Adapters import their engine lazily, so importing this module (and the plugin) stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines.options import EngineOptions
from pytest_kvguard.engines.protocols import CAPABILITIES, PREFIX_CACHE_CAPABILITIES, Engine

ENGINE_PATHS = {
    "feed": "kvguard's own loop feeds the engine and scores every next token (Engine.open_stream)",
    "feed_unscored": "kvguard's own loop feeds the engine for its memory figures only, no "
    "logits read (Engine.open_stream)",
    "prefix_cache": "a cached prompt replayed after an edit (Engine.open_prefix_cache)",
    "api_reuse": "a cached prompt replayed through the engine's own public API, which decides "
    "what it reuses (capability api_reuse)",
    "generation": "the engine's own generation (Engine.converse)",
    "reads_attention": "the engine's attention probabilities under the full cache "
    "(capability reads_attention)",
}
"""How a scenario may drive an engine, and what that path calls."""


@dataclass(frozen=True)
class EngineInfo:
    """How to find, describe and install one engine adapter."""

    name: str
    module: str
    """The adapter module; it has ``load(path, options) -> Engine``."""
    import_name: str
    """The engine's own top-level module."""
    distribution: str
    install: str
    policies: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"feed": ("full", "window", "sink")}
    )
    """Policy kinds the adapter implements, per engine path (``ENGINE_PATHS``: how a
    scenario drives the engine)."""
    position_modes: tuple[str, ...] = ("reindexed", "absolute")
    """Position handling it supports; the first is its own (the default)."""

    def __post_init__(self) -> None:
        """An adapter registered with a path or capability kvguard does not know would be
        silently taken for another kind of engine: refuse it by name."""
        unknown = [p for p in self.policies if p not in ENGINE_PATHS]
        known_capabilities = {*CAPABILITIES, *PREFIX_CACHE_CAPABILITIES}
        unknown += [c for c in sorted(self.capabilities) if c not in known_capabilities]
        if unknown:
            raise KvguardError(
                f"engine '{self.name}' declares {', '.join(map(repr, unknown))}, which kvguard "
                "does not know",
                fix="key its policies by engine path (" + ", ".join(ENGINE_PATHS) + ") and "
                "name capabilities from engines.protocols",
            )

    @property
    def native_positions(self) -> str:
        """What a check gets when it does not say: the engine's own position handling."""
        return self.position_modes[0]

    fixed_evict_step: int | None = None
    """Set when the engine only evicts this many tokens per step."""
    model_forms: tuple[str, ...] = ("gguf",)
    """What a check's model may be: gguf (bundled or file), folder, hub."""
    max_chunk: int | None = None
    """The most tokens one engine call takes (llama.cpp: the context's batch size)."""
    context_step: int | None = None
    """Set where the engine's context is a multiple of this many cells and it shifts when one
    more token would not fit (llama-server: 256), so a cap must be a multiple minus one."""
    binary: bool = False
    """The engine is a program kvguard starts (or an existing server at a URL), not a Python
    package: it is looked for when a check first loads it."""
    remote: bool = False
    """The engine is a server kvguard neither installs nor starts (model: a URL): nothing to
    look for locally, and its version is the server's, read when a check loads it."""
    self_evicting: tuple[str, ...] = ()
    """Policy kinds whose cache the engine trims inside its own decode call, reporting no room
    to kvguard: they are fed in prefill-sized chunks whatever ``chunk`` says."""
    capabilities: frozenset[str] = frozenset()
    """Optional capabilities the adapter has (``protocols.CAPABILITIES``: the engine's;
    ``protocols.PREFIX_CACHE_CAPABILITIES``: its prefix cache's)."""
    kv_precision: str | None = None
    """How the engine is asked to quantize its KV cache: ``kv_bits`` (mlx-lm's kv_bits,
    kv_group_size, quantized_kv_start) or ``cache_types`` (llama.cpp's cache_type_k and
    cache_type_v); None: it is not."""
    kv_precision_paths: tuple[str, ...] = ()
    """The engine paths on which the adapter applies those settings."""
    kv_size: str | None = None
    """The adapter's KV-size module (imports no engine): ``rotating_capacity(policy, arch)``
    and ``predict_stream_kv_bytes(...)``; None: a capped policy's ``min(n, cap)`` entries."""
    gguf_architectures: tuple[str, ...] | None = None
    """The GGUF architectures (``general.architecture``) the adapter loads itself, where it
    maps them to the engine's own model classes; None: whatever the engine's library knows."""
    architecture_probe: str | None = None
    """``module:function``, ``function(path) -> reason | None``: the engine's own refusal of
    a user's GGUF file, asked before any run where the engine runs in the pytest process."""


ENGINES: dict[str, EngineInfo] = {
    e.name: e
    for e in (
        EngineInfo(
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
            },
            max_chunk=512,
            self_evicting=("swa",),
            capabilities=frozenset({"reads_attention", "groups", "snapshot", "api_reuse"}),
            kv_precision="cache_types",
            kv_precision_paths=("feed", "attention_read"),
            kv_size="pytest_kvguard.engines.llama_cpp.kv_size",
            architecture_probe="pytest_kvguard.engines.model_usable:llama_cpp_refusal",
        ),
        EngineInfo(
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
            },
            position_modes=("absolute",),
            fixed_evict_step=1,
            model_forms=("gguf", "folder", "hub"),
            gguf_architectures=("llama", "gemma3"),  # engines/mlx/gguf.py maps these
            capabilities=frozenset({"reads_attention", "groups", "api_reuse"}),
            kv_precision="kv_bits",
            kv_precision_paths=("feed", "attention_read"),
            kv_size="pytest_kvguard.engines.mlx.kv_size",
        ),
        EngineInfo(
            "llama_server",
            "pytest_kvguard.engines.served.llama_server",
            "pytest_kvguard",
            "llama-server",
            "bash .ci/install (builds llama-server into .venv/bin), or set KVGUARD_LLAMA_SERVER",
            policies={
                "prefix_cache": ("full", "swa", "swa_full"),
                "generation": ("window", "sink", "engine_default"),
            },
            position_modes=("reindexed",),
            model_forms=("gguf", "url"),
            context_step=256,
            binary=True,
            capabilities=frozenset({"shifts", "replay"}),
            kv_precision="cache_types",
            kv_precision_paths=("prefix_cache", "generation"),
        ),
        EngineInfo(
            "openai",
            "pytest_kvguard.engines.served.openai",
            "pytest_kvguard",
            "pytest-kvguard",
            "nothing to install: start the server (vLLM, SGLang, llama-server) and give "
            "model: http://HOST:PORT",
            # The server's own cache, whatever it was started with: the policy labels it.
            policies={"prefix_cache": ("full", "swa")},
            position_modes=("reindexed",),
            model_forms=("url",),
            remote=True,
            capabilities=frozenset({"replay"}),
        ),
    )
}


def engine_info(name: str) -> EngineInfo:
    try:
        return ENGINES[name]
    except KeyError:
        raise KvguardError(
            f"unknown engine '{name}'", fix="use one of " + ", ".join(ENGINES)
        ) from None


def require_installed(name: str) -> EngineInfo:
    """Fail early, without importing the engine, when it is not installed."""
    info = engine_info(name)
    if info.binary or info.remote:
        return info  # found (or not) when a check loads it: a URL needs no binary here
    if importlib.util.find_spec(info.import_name) is None:
        raise KvguardError(f"engine '{name}' is not installed", fix=info.install)
    return info


def installed_version(name: str) -> str | None:
    """The engine's package version, read from metadata (no import); for a program kvguard
    starts, the version the binary reports."""
    if engine_info(name).remote:
        return None  # a server elsewhere: its version is in the check's engine facts
    if engine_info(name).binary:
        from pytest_kvguard.engines.served.process import binary_version

        return binary_version()
    try:
        return importlib.metadata.version(engine_info(name).distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_engine(name: str, model_path: Path | str, options: EngineOptions) -> Engine:
    """Load ``model_path`` (a URL for a server engine's existing deployment) into the engine."""
    info = require_installed(name)
    module = importlib.import_module(info.module)
    engine: Engine = module.load(model_path, options)
    return engine
