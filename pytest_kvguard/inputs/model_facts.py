"""A model's cache-relevant facts, read without loading weights, and what differs between two.

A model swap (a re-quantization, a re-exported GGUF, an mlx conversion) breaks sink handling
through facts like these more often than through the weights: whether the tokenizer adds a
BOS token and which token it is, the chat template, the sliding window and which layers slide,
KV heads, head size, rope settings. The facts come from a GGUF header
(``read_gguf_header``) or an mlx / Hugging Face model folder's config and tokenizer files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pytest_kvguard.errors import KvguardError
from pytest_kvguard.inputs.gguf_header import GgufHeader, read_gguf_header
from pytest_kvguard.inputs.models import BUILTIN_CHAT_TEMPLATES, _swa_layers, file_sha256

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
    """Window of the sliding layers, or ``none`` for full attention everywhere."""
    sliding_layers: str | None = None
    """How many layers slide and which do not (``15 of 18 (full: 5, 11, 17)``), or ``none``."""
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
        return _folder_facts(path)
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
        if isinstance(value, list):  # per-layer arrays (KV heads may vary by layer)
            return int(max(value)) if value else None
        return None if value is None else int(value)

    layers, heads = number("block_count"), number("attention.head_count")
    embedding = number("embedding_length")
    head_k = number("attention.key_length") or (embedding // heads if embedding and heads else None)
    head_v = number("attention.value_length") or head_k
    bos, eos = (
        header.field("tokenizer.ggml.bos_token_id"),
        header.field("tokenizer.ggml.eos_token_id"),
    )
    window = number("attention.sliding_window")
    base = header.field(f"{arch}.rope.freq_base")
    scaling = header.field(f"{arch}.rope.scaling.type")
    factor = header.field(f"{arch}.rope.scaling.factor")
    return ModelFacts(
        path=header.path,
        architecture=arch,
        adds_bos=_bool(header.field("tokenizer.ggml.add_bos_token")),
        adds_eos=_bool(header.field("tokenizer.ggml.add_eos_token")),
        bos_id=bos,
        bos_text=_token_text(header, bos),
        eos_id=None if eos is None else str(eos),
        eos_text=_token_text(header, eos),
        chat_template=_template_hash(header.field("tokenizer.chat_template"))
        or _none_or_builtin(arch),
        sliding_window=window or "none",
        sliding_layers=_sliding_layers(_gguf_swa(header, arch, layers, window)),
        layers=layers,
        attention_heads=heads,
        kv_heads=number("attention.head_count_kv") or heads,
        head_size=_head_size(head_k, head_v),
        rope_base=None if base is None else float(base),
        rope_scaling=_scaling(scaling, factor) if scaling not in (None, "none") else "none",
        context_length=number("context_length"),
        weight_type=_file_type(header.field("general.file_type")),
        sha256=file_sha256(header.path),
        sha256_of="the file",
    )


def _gguf_swa(
    header: GgufHeader, arch: str, layers: int | None, window: int | None
) -> tuple[bool, ...] | None:
    if layers is None:
        return None
    pattern = header.field(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer exports: one flag per layer
        return tuple(bool(p) for p in pattern)
    if isinstance(pattern, int) and window:  # every pattern-th layer is global
        return tuple((i + 1) % pattern != 0 for i in range(layers))
    return _swa_layers(arch, layers, window)  # llama.cpp's own pattern for the architecture


def _token_text(header: GgufHeader, token: Any) -> str | None:
    if not isinstance(token, int):
        return None
    return header.string_at("tokenizer.ggml.tokens", token)


def _none_or_builtin(arch: str) -> str:
    builtin = BUILTIN_CHAT_TEMPLATES.get(arch)
    return f"none (llama.cpp built-in: {builtin})" if builtin else "none"


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


# Folders


def _folder_facts(folder: Path) -> ModelFacts:
    config = _json(
        folder / "config.json",
        required="give the folder mlx_lm.convert or save_pretrained wrote, with its config.json",
    )
    text = config.get("text_config") or config  # a multimodal config nests the text model
    tokenizer_config = _json(folder / "tokenizer_config.json")
    tokenizer = _json(folder / "tokenizer.json")
    if not tokenizer_config and not tokenizer:
        raise KvguardError(
            "the model folder has neither tokenizer_config.json nor tokenizer.json",
            path=folder,
            fix="copy the tokenizer files next to config.json (mlx_lm.convert writes them)",
        )
    generation = _json(folder / "generation_config.json")
    ids = _special_ids(tokenizer_config, tokenizer)
    bos_text = _token_content(tokenizer_config.get("bos_token"))
    eos_text = _token_content(tokenizer_config.get("eos_token"))
    bos_id = _first_int(ids.get(bos_text or ""), generation.get("bos_token_id"),
                        text.get("bos_token_id"), config.get("bos_token_id"))  # fmt: skip
    eos = _first(generation.get("eos_token_id"), text.get("eos_token_id"),
                 config.get("eos_token_id"), ids.get(eos_text or ""))  # fmt: skip
    layers, heads = _int(text.get("num_hidden_layers")), _int(text.get("num_attention_heads"))
    hidden = _int(text.get("hidden_size"))
    head = _int(text.get("head_dim")) or (hidden // heads if hidden and heads else None)
    window = _int(text.get("sliding_window"))
    swa = _folder_swa(text, layers, window)
    if swa is not None and not any(swa):
        window = None
    scaling = text.get("rope_scaling") or {}
    template = tokenizer_config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    sha256, sha256_of = _weights_sha256(folder)
    return ModelFacts(
        path=folder,
        architecture=_str(text.get("model_type") or config.get("model_type")),
        adds_bos=_adds_bos(tokenizer_config, tokenizer),
        adds_eos=_bool(tokenizer_config.get("add_eos_token")),
        bos_id=bos_id,
        bos_text=bos_text,
        eos_id=None
        if eos is None
        else ", ".join(map(str, eos if isinstance(eos, list) else [eos])),
        eos_text=eos_text,
        chat_template=_template_hash(template) or "none",
        sliding_window=window or "none",
        sliding_layers=_sliding_layers(swa),
        layers=layers,
        attention_heads=heads,
        kv_heads=_int(text.get("num_key_value_heads")) or heads,
        head_size=_head_size(head, head),
        rope_base=_float(text.get("rope_theta")),
        rope_scaling=_scaling(
            scaling.get("rope_type") or scaling.get("type"), scaling.get("factor")
        )
        if scaling
        else "none",
        context_length=_int(text.get("max_position_embeddings")),
        weight_type=_folder_weight_type(config),
        sha256=sha256,
        sha256_of=sha256_of,
    )


def _json(path: Path, required: str | None = None) -> dict[str, Any]:
    """A JSON object file; {} where an optional one is absent."""
    if not path.is_file():
        if required is None:
            return {}
        raise KvguardError(f"no {path.name} in the model folder", path=path.parent, fix=required)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvguardError(
            f"not readable JSON: {exc}", path=path, fix="re-export the model"
        ) from None
    if not isinstance(data, dict):
        raise KvguardError("not a JSON object", path=path, fix="re-export the model")
    return data


def _special_ids(tokenizer_config: dict[str, Any], tokenizer: dict[str, Any]) -> dict[str, int]:
    """Special token text -> id, from tokenizer_config's added_tokens_decoder and
    tokenizer.json's added_tokens."""
    ids = {str(t.get("content")): int(t["id"]) for t in tokenizer.get("added_tokens") or []
           if isinstance(t, dict) and "id" in t}  # fmt: skip
    for key, token in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        if isinstance(token, dict) and str(key).isdigit():
            ids[str(token.get("content"))] = int(key)
    return ids


def _adds_bos(tokenizer_config: dict[str, Any], tokenizer: dict[str, Any]) -> bool | None:
    """tokenizer_config's ``add_bos_token``, else whether tokenizer.json's post-processor
    template puts a special token first (how Llama 3 adds BOS)."""
    if isinstance(tokenizer_config.get("add_bos_token"), bool):
        return bool(tokenizer_config["add_bos_token"])
    processor = tokenizer.get("post_processor") or {}
    steps = processor.get("processors") if processor.get("type") == "Sequence" else [processor]
    for step in steps or []:
        if isinstance(step, dict) and step.get("type") == "TemplateProcessing":
            single = step.get("single") or []
            return bool(single) and "SpecialToken" in single[0]
    return None


def _folder_swa(
    text: dict[str, Any], layers: int | None, window: int | None
) -> tuple[bool, ...] | None:
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list):
        return tuple(kind == "sliding_attention" for kind in layer_types)
    if layers is None:
        return None
    pattern = _int(text.get("sliding_window_pattern"))
    if window and pattern:
        return tuple((i + 1) % pattern != 0 for i in range(layers))
    # A window with no per-layer pattern slides everywhere (Mistral-style); none: full.
    return (bool(window),) * layers


def _folder_weight_type(config: dict[str, Any]) -> str | None:
    quantization = config.get("quantization") or config.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("bits"):
        group = quantization.get("group_size")
        return f"{quantization['bits']}-bit" + (f", group {group}" if group else "")
    dtype = config.get("torch_dtype") or config.get("dtype")
    names = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
    return names.get(str(dtype), None if dtype is None else str(dtype))


WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".npz")


def _weights_sha256(folder: Path) -> tuple[str | None, str]:
    """One sha256 over the folder's weight files in name order (each file's own hash, so
    the figure does not depend on how the files are read)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None, "no weight files"
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name} {file_sha256(path)}\n".encode())
    names = ", ".join(p.name for p in files[:3]) + (" ..." if len(files) > 3 else "")
    return digest.hexdigest(), f"{len(files)} weight file{'s' * (len(files) > 1)} ({names})"


# Shared


def _sliding_layers(swa: tuple[bool, ...] | None) -> str | None:
    if swa is None:
        return None
    if not any(swa):
        return "none"
    full = [str(i) for i, slides in enumerate(swa) if not slides]
    return f"{sum(swa)} of {len(swa)}" + (f" (full: {', '.join(full)})" if full else "")


def _template_hash(template: Any) -> str | None:
    if isinstance(template, list):  # tokenizer_config may list named templates
        template = json.dumps(template, sort_keys=True)
    if not isinstance(template, str) or not template:
        return None
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:12]


def _head_size(k: int | None, v: int | None) -> int | str | None:
    if k is None:
        return None
    return k if v in (None, k) else f"k {k} / v {v}"


def _scaling(kind: Any, factor: Any) -> str:
    return f"{kind} x{factor:g}" if isinstance(factor, int | float) else str(kind)


def _token_content(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _first_int(*values: Any) -> int | None:
    return next((v for v in map(_int, values) if v is not None), None)
