"""The Engine protocol that scenarios call, and the registry of engine adapters.

Adapters import their engine lazily, so importing this module (and the plugin) stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from pytest_kvguard.errors import KvguardError
from pytest_kvguard.policies import Policy

if TYPE_CHECKING:
    from pytest_kvguard.engines.conversation import Turn


class Stream(Protocol):
    """One sequence in an engine's cache, run under one policy."""

    def room(self) -> int | None:
        """Tokens that fit before the policy must evict; None when it never evicts."""
        ...

    def feed(self, token_ids: Sequence[int], logits: bool = True) -> np.ndarray:
        """Evict as the policy says, decode the tokens, return their logits (n, vocab) float32.

        With ``logits=False`` only the cache matters (memory runs): the result may be empty.
        """
        ...

    @property
    def held(self) -> int:
        """KV entries held per layer now."""
        ...

    @property
    def evicted(self) -> int:
        """Tokens evicted so far."""
        ...

    def figures(self) -> dict[str, float]:
        """Engine-measured memory figures now (bytes), e.g. kv_bytes, peak_memory_bytes."""
        ...

    def layer_sizes(self) -> list[tuple[int, int]]:
        """(tokens seen, KV entries held) per layer, where the engine exposes it; else []."""
        ...

    def close(self) -> None: ...


class StreamGroup(Protocol):
    """Several streams of one engine and model, one policy each, that can decode one more token
    each in one engine call: the weights are read once for all of them (``Engine.
    open_stream_group``). Each row keeps its own real cache, and may be fed its own token ids;
    figures stay per row."""

    @property
    def streams(self) -> Sequence[Stream]:
        """One stream per policy, in order; each can also be fed alone."""
        ...

    def feed_rows(self, rows: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Decode ``token_ids[k]`` on row ``rows[k]`` (index into ``streams``), all in one
        engine call (those rows have been fed as many tokens, so their caches hold as many
        entries, and each has room made for one more as its policy says): the logits, one row
        per token (len(rows), vocab) float32."""
        ...

    def close(self) -> None: ...


class PrefixCache(Protocol):
    """An engine's cache holding one prompt, able to serve an edited prompt (edit_replay).

    An adapter may also offer ``save() -> object`` (a snapshot of what the cache holds, in the
    engine's own state format) and ``restore(saved)`` (a fresh cache of the same policy made to
    hold it): the scenario then prefills each chat once per policy."""

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        """Decode ``token_ids`` at positions ``start``, ``start + 1``, ... after the cached ones."""
        ...

    def keep_prefix(self, n_tokens: int) -> tuple[int, int | None]:
        """Trim the cache to the longest prefix of at most ``n_tokens`` the engine can still use.

        Returns the tokens kept and, when a checkpoint was restored to get them, its length.
        """
        ...

    def memory_bytes(self) -> dict[str, float]:
        """state_bytes (the cache), checkpoint_bytes, checkpoints (a count)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class AttentionRows:
    """Attention probabilities an engine computed under the full cache (``Engine.attention``)."""

    probs: np.ndarray
    """(layer, head, query, key position) float32; key positions 0 .. the last query."""
    how: str
    """How they were read, in one line (for the report)."""
    seconds: float
    reconstruction_error: float | None = None
    """Where the probabilities were computed beside a fused kernel: the largest
    |probs @ V - the kernel's output| over the rows read, as a share of what the output's
    dtype allows (above 1: they are not the engine's attention); None where read from the
    engine itself."""
    learned_sinks: bool = False
    """The model has learned sink logits (gpt-oss): rows sum to less than 1."""


@runtime_checkable
class Engine(Protocol):
    """A loaded model in a real inference engine.

    An adapter may also offer ``attention(token_ids, queries) -> AttentionRows`` (its own
    attention probabilities for those query positions under a full cache), ``bos_id`` and
    ``token_piece(token_id) -> str`` (the attention scenario).

    An adapter may also offer ``group_key(policy) -> Hashable | None`` and
    ``open_stream_group(policies, max_tokens) -> StreamGroup``: policies with the same non-None
    key then decode together (see ``scenarios.feeding.run_specs``). Its ``group_figures_own``
    (default False) says whether a row of a group still reports every figure a stream of its
    own would, peak memory included; where it does not, a run judged by its peak runs alone.
    """

    name: str
    kv_element_bytes: float
    """Bytes per element of the K and V caches (f16: 2)."""

    def version(self) -> str: ...

    def describe(self) -> dict[str, str]:
        """Build and backend facts worth recording in a report."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """Token ids as the engine feeds them, with BOS where the model wants one."""
        ...

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt the model's own chat template renders for these messages."""
        ...

    def open_stream(self, policy: Policy, max_tokens: int) -> Stream:
        """A fresh, empty sequence that will be fed at most ``max_tokens`` tokens."""
        ...

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> PrefixCache:
        """A fresh cache for prompts of at most ``max_tokens`` tokens."""
        ...

    def converse(
        self, policy: Policy, token_ids: Sequence[int], turns: Sequence[Turn], prefill_step: int
    ) -> np.ndarray:
        """The turns through the engine's own generation entry point under ``policy``: each
        prompt prefilled ``prefill_step`` tokens per call, each reply generated with the text's
        next token forced as the sampled one. nll[i] scores token i+1; NaN where not generated.
        """
        ...

    def close(self) -> None: ...


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
        default_factory=lambda: {"stream": ("full", "window", "sink")}
    )
    """Policy kinds the adapter implements, per scenario."""
    position_modes: tuple[str, ...] = ("reindexed", "absolute")
    """Position handling it supports; the first is its own (the default)."""

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


ENGINES: dict[str, EngineInfo] = {
    e.name: e
    for e in (
        EngineInfo(
            "llama_cpp",
            "pytest_kvguard.engines.llama_cpp",
            "llama_cpp",
            "llama-cpp-python",
            'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON '
            '-DGGML_F16C=ON" pip install "pytest-kvguard[llama]"',
            policies={
                "stream": ("full", "window", "sink"),
                "memory": ("full", "window", "sink", "swa", "swa_full"),
                "edit_replay": ("full", "swa", "swa_full"),
                "generate": ("window", "sink"),
            },
            max_chunk=512,
            self_evicting=("swa",),
        ),
        EngineInfo(
            "mlx",
            "pytest_kvguard.engines.mlx",
            "mlx_lm",
            "mlx-lm",
            'pip install "pytest-kvguard[mlx]"',
            policies={
                "stream": ("full", "window", "sink", "swa", "engine_default"),
                "memory": ("full", "window", "sink", "swa", "engine_default"),
                "edit_replay": ("full", "swa"),
                "generate": ("window", "sink", "engine_default"),
            },
            position_modes=("absolute",),
            fixed_evict_step=1,
            model_forms=("gguf", "folder", "hub"),
        ),
        EngineInfo(
            "llama_server",
            "pytest_kvguard.engines.llama_server",
            "pytest_kvguard",
            "llama-server",
            "bash .ci/install (builds llama-server into .venv/bin), or set KVGUARD_LLAMA_SERVER",
            policies={
                "edit_replay": ("full", "swa", "swa_full"),
                "generate": ("window", "sink", "engine_default"),
            },
            position_modes=("reindexed",),
            model_forms=("gguf", "url"),
            context_step=256,
            binary=True,
        ),
        EngineInfo(
            "openai",
            "pytest_kvguard.engines.openai_server",
            "pytest_kvguard",
            "pytest-kvguard",
            "nothing to install: start the server (vLLM, SGLang, llama-server) and give "
            "model: http://HOST:PORT",
            # The server's own cache, whatever it was started with: the policy labels it.
            policies={"edit_replay": ("full", "swa")},
            position_modes=("reindexed",),
            model_forms=("url",),
            remote=True,
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


def check_policy_kind(name: str, kind: str, scenario: str) -> None:
    """Refuse a policy kind the engine's adapter does not implement for this scenario."""
    kinds = engine_info(name).policies.get(scenario, ())
    if kind not in kinds:
        raise KvguardError(
            f"engine '{name}' does not implement policy '{kind}' for {scenario}",
            fix="use one of " + ", ".join(kinds) if kinds else f"use another engine for {scenario}",
        )


def check_policy(name: str, policy: Policy, scenario: str = "stream") -> None:
    """Refuse a policy, position handling or eviction step the engine's adapter cannot run."""
    info = engine_info(name)
    check_policy_kind(name, policy.kind, scenario)
    if policy.bounded and policy.positions not in info.position_modes:
        raise KvguardError(
            f"engine '{name}' cannot run positions '{policy.positions}'",
            fix="use positions: " + " or ".join(info.position_modes),
        )
    if policy.cap is not None and info.context_step and (policy.cap + 1) % info.context_step:
        cells = info.context_step
        low = max((policy.cap + 1) // cells * cells - 1, cells - 1)
        raise KvguardError(
            f"engine '{name}' holds at most a multiple of {info.context_step} cells minus one "
            f"(it shifts when one more token would not fit), so cap {policy.cap} cannot be "
            "asked of it",
            fix=f"use cap: {low} or {low + cells}",
            key="params.cap",
        )
    step = info.fixed_evict_step
    if policy.bounded and step is not None and policy.evict_step != step:
        raise KvguardError(
            f"engine '{name}' evicts {step} token(s) per step, not {policy.evict_step}",
            fix=f"use evict_step: {step}",
        )
    if policy.chunk > 1 and policy.kind in info.self_evicting:
        raise KvguardError(
            f"engine '{name}' trims its '{policy.kind}' cache inside each decode call, so "
            "chunk has nothing to change there",
            fix="remove chunk, or use a policy with a cap",
            key="params.chunk",
        )
    if info.max_chunk is not None and policy.chunk > info.max_chunk:
        raise KvguardError(
            f"engine '{name}' takes at most {info.max_chunk} tokens per call, not chunk "
            f"{policy.chunk}",
            fix=f"use chunk: {info.max_chunk} or less",
            key="params.chunk",
        )


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
        from pytest_kvguard.engines.llama_server_process import binary_version

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
