"""An mlx / Hugging Face model folder's cache-relevant facts, from config.json,
tokenizer_config.json, tokenizer.json, generation_config.json and chat_template.jinja, as
``model_facts.ModelFacts`` fields; weights are hashed, never loaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.models import file_sha256


def folder_facts(folder: Path) -> dict[str, Any]:
    """``ModelFacts`` fields (all but the path) from a folder's config and tokenizer files."""
    config = _json(
        folder / "config.json",
        required="give the folder mlx_lm.convert or save_pretrained wrote, with its config.json",
    )
    text = text_config(config)
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
    # The EOS text's own id where the tokenizer maps it, so id and text name one token.
    eos = _first(ids.get(eos_text or ""), generation.get("eos_token_id"),
                 text.get("eos_token_id"), config.get("eos_token_id"))  # fmt: skip
    layers, heads = _int(text.get("num_hidden_layers")), _int(text.get("num_attention_heads"))
    hidden = _int(text.get("hidden_size"))
    head = _int(text.get("head_dim")) or (hidden // heads if hidden and heads else None)
    window, sliding = sliding_facts(_int(text.get("sliding_window")), config_swa_layers(text))
    scaling = _dict(text.get("rope_scaling"))
    template = tokenizer_config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_bytes()
    sha256, sha256_of = _weights_sha256(folder)
    return dict(
        architecture=_str(text.get("model_type") or config.get("model_type")),
        adds_bos=_adds_bos(tokenizer_config, tokenizer),
        adds_eos=as_bool(tokenizer_config.get("add_eos_token")),
        bos_id=bos_id,
        bos_text=bos_text,
        eos_id=None
        if eos is None
        else ", ".join(map(str, eos if isinstance(eos, list) else [eos])),
        eos_text=eos_text,
        chat_template=template_hash(template) or "none",
        sliding_window=window,
        sliding_layers=sliding,
        layers=layers,
        attention_heads=heads,
        kv_heads=_int(text.get("num_key_value_heads")) or heads,
        head_size=head_size_text(head, head),
        rope_base=_float(text.get("rope_theta")),
        rope_scaling=rope_scaling_text(
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
    added = tokenizer.get("added_tokens")
    ids = {str(t.get("content")): t["id"] for t in added if isinstance(t, dict)
           and isinstance(t.get("id"), int)} if isinstance(added, list) else {}  # fmt: skip
    for key, token in _dict(tokenizer_config.get("added_tokens_decoder")).items():
        if isinstance(token, dict) and str(key).isdigit():
            ids[str(token.get("content"))] = int(key)
    return ids


def _adds_bos(tokenizer_config: dict[str, Any], tokenizer: dict[str, Any]) -> bool | None:
    """tokenizer_config's ``add_bos_token``, else whether tokenizer.json's post-processor
    template puts a special token first (how Llama 3 adds BOS)."""
    if isinstance(tokenizer_config.get("add_bos_token"), bool):
        return bool(tokenizer_config["add_bos_token"])
    processor = _dict(tokenizer.get("post_processor"))
    steps = processor.get("processors") if processor.get("type") == "Sequence" else [processor]
    for step in steps or []:
        if isinstance(step, dict) and step.get("type") == "TemplateProcessing":
            single = step.get("single")
            return isinstance(single, list) and bool(single) and "SpecialToken" in _dict(single[0])
    return None


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


# Shared with kvguard capacity (a config.json's text model and which of its layers slide)

GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "max_position_embeddings": 131_072,
}  # fmt: skip
"""transformers' ``Gemma3TextConfig`` defaults (5.x; the same in 4.5x), which a Gemma 3
multimodal config.json's ``text_config`` leaves out: it lists only values that differ."""
SLIDING_PERIODS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
"""Every how-many-th layer is global, by model_type, where a config has neither
``layer_types`` nor ``sliding_window_pattern`` (transformers' defaults for these)."""
EVERY_LAYER_SLIDES = {"mistral", "mixtral"}
"""model_types whose window applies to every layer."""
SLIDING_OFF_BY_DEFAULT = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
"""model_types whose ``use_sliding_window`` is false unless the config says otherwise."""


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings: a multimodal config's ``text_config`` (its model_type
    filled in, and for Gemma 3 transformers' defaults for the values it leaves out), else the
    config itself."""
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return config
    text = dict(nested)
    if "model_type" not in text and config.get("model_type") == "gemma3":
        text["model_type"] = "gemma3_text"
    if text.get("model_type") == "gemma3_text":
        text = GEMMA3_TEXT_DEFAULTS | text
    return text


def config_swa_layers(text: dict[str, Any]) -> tuple[bool, ...] | None:
    """Per layer of a (text) config: does it slide? None where the config does not say:
    a window with no ``layer_types``, pattern or known model_type, or no layer count."""
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list):
        return tuple(kind == "sliding_attention" for kind in layer_types)
    layers, window = _int(text.get("num_hidden_layers")), _int(text.get("sliding_window"))
    if layers is None:
        return None
    model_type = _str(text.get("model_type"))
    use = text.get("use_sliding_window", False if model_type in SLIDING_OFF_BY_DEFAULT else None)
    if not window or use is False:
        return (False,) * layers
    first = _int(text.get("max_window_layers"))
    if use is True and first is not None:  # Qwen2: layers from max_window_layers on slide
        return tuple(i >= first for i in range(layers))
    pattern = _int(text.get("sliding_window_pattern")) or SLIDING_PERIODS.get(model_type or "")
    if pattern and pattern > 0:  # every pattern-th layer is global
        return tuple((i + 1) % pattern != 0 for i in range(layers))
    if model_type in EVERY_LAYER_SLIDES:
        return (True,) * layers
    return None


# Shared with the GGUF reader


def sliding_facts(window: int | None, swa: tuple[bool, ...] | None) -> tuple[int | str | None, str]:
    """The sliding window and sliding layers as shown, consistent with each other: both
    ``none`` where no layer slides; ``unknown`` layers beside a window whose layers are not
    known; an unknown window (None) beside layers that slide with no window given."""
    if swa is None:
        return (window, "unknown") if window else ("none", "none")
    if not any(swa):
        return "none", "none"
    return window, sliding_layers_text(swa)


def sliding_layers_text(swa: tuple[bool, ...]) -> str:
    if not any(swa):
        return "none"
    full = [str(i) for i, slides in enumerate(swa) if not slides]
    return f"{sum(swa)} of {len(swa)}" + (f" (full: {', '.join(full)})" if full else "")


def template_hash(template: Any) -> str | None:
    if isinstance(template, list):  # tokenizer_config may list named templates
        template = json.dumps(template, sort_keys=True)
    if isinstance(template, str):
        template = template.encode("utf-8")
    if not isinstance(template, bytes) or not template:
        return None
    return hashlib.sha256(template).hexdigest()[:12]


def head_size_text(k: int | None, v: int | None) -> int | str | None:
    if k is None:
        return None
    return k if v in (None, k) else f"k {k} / v {v}"


def rope_scaling_text(kind: Any, factor: Any) -> str:
    return f"{kind} x{factor:g}" if isinstance(factor, int | float) else str(kind)


def _token_content(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def _dict(value: Any) -> dict[str, Any]:
    """``value`` where it is a JSON object, else {} (a file of an unexpected shape reads as
    facts unknown, not as a traceback)."""
    return value if isinstance(value, dict) else {}


def as_bool(value: Any) -> bool | None:
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
