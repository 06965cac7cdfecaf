"""A model's cache-relevant facts, read without loading weights, and what differs between two.

A model swap (a re-quantization, a re-exported GGUF, an mlx conversion) breaks sink handling
through facts like these more often than through the weights: whether the tokenizer adds a
BOS token and which token it is, the chat template, the sliding window and which layers slide,
KV heads, head size, rope settings. The facts come from a GGUF header
(``read_gguf_header``) or an mlx / Hugging Face model folder's config and tokenizer files.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.gguf_header import GgufHeader, read_gguf_header
from pytest_kvguard.inputs.model_folder import (
    as_bool,
    folder_facts,
    head_size_text,
    rope_scaling_text,
    sliding_facts,
    template_hash,
)
from pytest_kvguard.inputs.models import file_sha256, gguf_swa_layers

Fact = int | float | bool | str | None


@dataclass(frozen=True)
class ModelFacts:
    """What a model declares that decides how its KV cache behaves; None where unknown."""

    path: Path
    architecture: str | None = None
    adds_bos: bool | None = None
    """Does the tokenizer put BOS in front of every text it encodes?"""
    adds_eos: bool | None = None
    bos_id: int | None = None
    bos_text: str | None = None
    eos_id: str | None = None
    """One id, or several comma-separated (a generation config may list more than one)."""
    eos_text: str | None = None
    chat_template: str | None = None
    """First 12 hex digits of the template's sha256, or ``none`` (with the built-in template
    llama.cpp falls back to, where it has one)."""
    sliding_window: int | str | None = None
    """Window of the sliding layers, or ``none`` where no layer slides."""
    sliding_layers: str | None = None
    """How many layers slide and which do not (``15 of 18 (full: 5, 11, 17)``), ``none``, or
    ``unknown`` (a window whose layers the config does not say)."""
    layers: int | None = None
    attention_heads: int | None = None
    kv_heads: int | None = None
    head_size: int | str | None = None
    """One size, or ``k 192 / v 128`` where keys and values differ."""
    rope_base: float | None = None
    rope_scaling: str | None = None
    """``type xfactor`` (``linear x8``), or ``none``."""
    context_length: int | None = None
    weight_type: str | None = None
    sha256: str | None = None
    sha256_of: str | None = None
    """What ``sha256`` hashed: the file, or a folder's weight files."""


LABELS = {
    "architecture": "architecture",
    "adds_bos": "tokenizer adds BOS",
    "adds_eos": "tokenizer adds EOS",
    "bos_id": "BOS id",
    "bos_text": "BOS text",
    "eos_id": "EOS id",
    "eos_text": "EOS text",
    "chat_template": "chat template sha256",
    "sliding_window": "sliding window",
    "sliding_layers": "sliding layers",
    "layers": "layers",
    "attention_heads": "attention heads",
    "kv_heads": "KV heads",
    "head_size": "head size",
    "rope_base": "rope base",
    "rope_scaling": "rope scaling",
    "context_length": "context length",
    "weight_type": "weight type",
    "sha256": "sha256",
    "sha256_of": "sha256 of",
}
"""Each fact's name as printed, in the order printed."""
NOT_DIFFED = {"sha256_of"}
"""Shown, never a difference of its own (the hash differs with it)."""
IDENTICAL = "no cache-relevant fact differs"


@dataclass(frozen=True)
class FactDifference:
    fact: str
    """The fact's printed name (``tokenizer adds BOS``)."""
    before: str
    after: str

    @property
    def line(self) -> str:
        return f"{self.fact}: {self.before} -> {self.after}"


def show(value: Fact) -> str:
    """A fact as printed: ``-`` for unknown, ``true``/``false``, whole floats without a point."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:g}"
    return str(value)


def shown(facts: ModelFacts, name: str) -> str:
    """Fact ``name`` of ``facts`` as printed: a token text that has spaces quoted, a hash
    cut to 16 hex digits (the JSON output keeps all 64)."""
    value = getattr(facts, name)
    if name in ("bos_text", "eos_text") and isinstance(value, str):
        return repr(value) if not value or any(c.isspace() for c in value) else value
    if name == "sha256" and isinstance(value, str):
        return value[:16]
    return show(value)


def fact_rows(facts: ModelFacts) -> list[tuple[str, str]]:
    """(printed name, printed value) for every fact, in order."""
    return [(label, shown(facts, name)) for name, label in LABELS.items()]


def diff_facts(before: ModelFacts, after: ModelFacts) -> list[FactDifference]:
    """One entry per fact whose printed value differs (so 1e5 and 100000.0 are the same)."""
    return [
        FactDifference(label, shown(before, name), shown(after, name))
        for name, label in LABELS.items()
        if name not in NOT_DIFFED and shown(before, name) != shown(after, name)
    ]


def diff_lines(differences: list[FactDifference]) -> list[str]:
    return [d.line for d in differences] or [IDENTICAL]


def facts_json(facts: ModelFacts) -> dict[str, Any]:
    return {f.name: (str(v) if isinstance(v := getattr(facts, f.name), Path) else v)
            for f in fields(facts)}  # fmt: skip


def read_model_facts(path: Path) -> ModelFacts:
    """The facts of a GGUF file or a model folder, or a one-line error naming what is wrong."""
    if path.is_dir():
        return ModelFacts(path=path, **folder_facts(path))
    if not path.exists():
        raise KvguardError(
            "no such file or folder", path=path, fix="give a .gguf file or a model folder"
        )
    return _gguf_facts(read_gguf_header(path))


# GGUF


def _gguf_facts(header: GgufHeader) -> ModelFacts:
    arch = header.field("general.architecture")
    if not isinstance(arch, str):
        raise KvguardError(
            "GGUF metadata lacks general.architecture, so it is no model kvguard can read",
            path=header.path,
            fix="give a model's GGUF file (not a LoRA adapter or vocabulary-only file)",
        )

    def number(key: str) -> int | None:
        value = header.field(f"{arch}.{key}")
        if isinstance(value, list) and value:  # per-layer arrays (KV heads may vary by layer)
            value = max(value)
        if value is None:
            return None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise KvguardError(
                f"GGUF metadata {arch}.{key} is {value!r}, not a number",
                path=header.path,
                fix="re-export the model with llama.cpp's convert_hf_to_gguf.py",
            )
        return int(value)

    layers, heads = number("block_count"), number("attention.head_count")
    embedding = number("embedding_length")
    head_k = number("attention.key_length") or (embedding // heads if embedding and heads else None)
    head_v = number("attention.value_length") or head_k
    bos, eos = (
        header.field("tokenizer.ggml.bos_token_id"),
        header.field("tokenizer.ggml.eos_token_id"),
    )
    window, sliding = sliding_facts(number("attention.sliding_window"), gguf_swa_layers(header))
    base = header.field(f"{arch}.rope.freq_base")
    scaling = header.field(f"{arch}.rope.scaling.type")
    factor = header.field(f"{arch}.rope.scaling.factor")
    return ModelFacts(
        path=header.path,
        architecture=arch,
        adds_bos=as_bool(header.field("tokenizer.ggml.add_bos_token")),
        adds_eos=as_bool(header.field("tokenizer.ggml.add_eos_token")),
        bos_id=bos,
        bos_text=_token_text(header, bos),
        eos_id=None if eos is None else str(eos),
        eos_text=_token_text(header, eos),
        chat_template=template_hash(header.field("tokenizer.chat_template")) or "none",
        sliding_window=window,
        sliding_layers=sliding,
        layers=layers,
        attention_heads=heads,
        kv_heads=number("attention.head_count_kv") or heads,
        head_size=head_size_text(head_k, head_v),
        rope_base=float(base) if isinstance(base, int | float) else None,
        rope_scaling=rope_scaling_text(scaling, factor)
        if scaling not in (None, "none")
        else "none",
        context_length=number("context_length"),
        weight_type=_file_type(header.field("general.file_type")),
        sha256=file_sha256(header.path),
        sha256_of="the file",
    )


def _token_text(header: GgufHeader, token: Any) -> str | None:
    if not isinstance(token, int):
        return None
    return header.string_at("tokenizer.ggml.tokens", token)


def _file_type(value: Any) -> str | None:
    """``general.file_type`` by its llama.cpp name (15 -> Q4_K_M)."""
    if not isinstance(value, int):
        return None
    from gguf.constants import LlamaFileType

    try:
        name = LlamaFileType(value).name
    except ValueError:
        return f"file type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
