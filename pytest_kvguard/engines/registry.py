"""The engine adapters kvguard knows: how to find, install and load each, what policies it
implements per engine path, and which optional capabilities (``protocols.CAPABILITIES``) it has.

Each adapter is declared once, in its own package (``llama_cpp/adapter.py``, ...), and found by
its ``pytest_kvguard.engines`` entry point, so a third party ships an engine as its own package.
Adapters import their engine lazily, so importing this module (and the plugin) stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    "draft_decoding": "the engine's own speculative decoding against its plain greedy decoding "
    "(capability speculates)",
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
    api_states: tuple[str, ...] = ("none",)
    """How an app may keep its API path's states between requests (``protocols.API_STATES``,
    edit_replay's ``api_state``): llama-cpp-python's ``Llama`` has several."""
    window_probe: bool = False
    """Its API path reads which sliding-window positions a reused prefix still holds
    (edit_replay's ``stale_window`` and ``window_missing_tokens``)."""
    companions: str | None = None
    """``module:function``, ``function(requested distribution names) -> requirements``: what
    ``kvguard env`` installs with this engine's distribution besides it."""
    prepare: str | None = None
    """``module:function``, ``function() -> str``: readies the pytest process before any test
    module can import the engine (mlx: OpenBLAS preloaded); it returns the session header's
    line for the engine. Called where the engine is installed; imports no engine."""
    speculative_drafts: tuple[str, ...] = ()
    """The drafts its speculative path takes (``scenarios/speculative.py`` DRAFTS), its
    default first; empty: it has none."""
    speculative_prefilled: bool = False
    """Its speculative path can start from a cache that already holds a prompt (mlx-lm's
    ``prompt_cache``): the speculative scenario's ``prefilled``."""
    architecture_probe: str | None = None
    """``module:function``, ``function(path) -> reason | None``: the engine's own refusal of
    a user's GGUF file, asked before any run where the engine runs in the pytest process."""


ENTRY_POINT_GROUP = "pytest_kvguard.engines"
"""Where engine adapters are registered: an entry point whose name is the engine's and whose
object is its ``EngineInfo`` (kvguard's own four are declared in its pyproject.toml; a third
party's package declares its own)."""


class EngineRegistry(MutableMapping[str, EngineInfo]):
    """The engine adapters by name, read from the ``pytest_kvguard.engines`` entry points on
    first use (each adapter module imports no engine, so this stays cheap). Tests add
    adapters as to a dict; an engine worker ``adopt``s the pytest process's registry."""

    def __init__(self) -> None:
        self._adapters: dict[str, EngineInfo] | None = None

    def adopt(self, adapters: Mapping[str, EngineInfo]) -> None:
        """Take these adapters as the registry, reading no entry point: an engine worker's,
        whose environment (``kvguard env``) may have no kvguard distribution to read."""
        self._adapters = dict(adapters)

    def _loaded(self) -> dict[str, EngineInfo]:
        if self._adapters is None:
            self._adapters = _entry_point_adapters()
        return self._adapters

    def __getitem__(self, name: str) -> EngineInfo:
        return self._loaded()[name]

    def __setitem__(self, name: str, info: EngineInfo) -> None:
        self._loaded()[name] = info

    def __delitem__(self, name: str) -> None:
        del self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())


def _entry_point_adapters() -> dict[str, EngineInfo]:
    """Every registered adapter, kvguard's own first; one that does not load, or is not an
    ``EngineInfo`` of its own name, is refused naming its distribution."""
    found = sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
        key=lambda e: (e.value.split(".")[0] != "pytest_kvguard", e.name),
    )
    adapters: dict[str, EngineInfo] = {}
    values: dict[str, str] = {}
    for entry in found:
        where = f"entry point {ENTRY_POINT_GROUP}:{entry.name} = {entry.value}"
        dist = entry.dist.name if entry.dist is not None else "its distribution"
        try:
            info = entry.load()
        except Exception as exc:  # noqa: BLE001 - a third party's import error, said in one line
            raise KvguardError(
                f"{where} does not load: {type(exc).__name__}: {exc}",
                fix=f"fix or uninstall {dist}",
            ) from None
        if not isinstance(info, EngineInfo) or info.name != entry.name:
            raise KvguardError(
                f"{where} is not the EngineInfo of an engine named '{entry.name}'",
                fix=f"point it at an EngineInfo(name='{entry.name}', ...) in {dist}",
            )
        if entry.name in adapters:
            if values[entry.name] == entry.value:
                continue  # the same distribution seen twice on sys.path (an editable install)
            raise KvguardError(
                f"two adapters register engine '{entry.name}': {values[entry.name]} and "
                f"{entry.value}",
                fix=f"uninstall one of them, or rename {dist}'s engine",
            )
        adapters[entry.name], values[entry.name] = info, entry.value
    if not adapters:
        raise KvguardError(
            f"no engine adapters registered (entry points {ENTRY_POINT_GROUP})",
            fix="install pytest-kvguard as a package (pip install -e .), not only on PYTHONPATH",
        )
    return adapters


ENGINES = EngineRegistry()


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


def adapter_function(reference: str) -> Callable[..., Any]:
    """The function an adapter names as ``module:function`` (imported now; the module
    imports no engine)."""
    module, _, function = reference.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), function)
    return found


def prepare_engine(name: str) -> str | None:
    """Run the adapter's ``prepare`` (once is enough; it may be called again), where it has one
    and the engine is installed here; its header line, or None."""
    info = engine_info(name)
    if info.prepare is None or importlib.util.find_spec(info.import_name) is None:
        return None
    line: str = adapter_function(info.prepare)()
    return line


def load_engine(name: str, model_path: Path | str, options: EngineOptions) -> Engine:
    """Load ``model_path`` (a URL for a server engine's existing deployment) into the engine."""
    info = require_installed(name)
    module = importlib.import_module(info.module)
    engine: Engine = module.load(model_path, options)
    return engine
