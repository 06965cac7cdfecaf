"""A model's KV-cache architecture, from a GGUF file, a Hugging Face ``config.json`` or a
model folder, read without weights or an engine."""

from __future__ import annotations

import json
from pathlib import Path

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.model_folder import config_swa_layers, text_config
from pytest_kvguard.inputs.models import ModelArch, read_arch


def arch_from_config(path: Path) -> ModelArch:
    """The figures of a Hugging Face ``config.json`` (text config nested under ``text_config``;
    which layers slide as ``model_folder.config_swa_layers`` reads it)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvguardError(f"cannot read {path}: {exc}", fix="give a config.json") from None
    if not isinstance(config, dict):
        raise KvguardError(f"{path} is not a JSON object", fix="give a config.json")
    config = text_config(config)
    try:
        n_layers = int(config["num_hidden_layers"])
        n_heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // n_heads)
        n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    except KeyError as exc:
        raise KvguardError(
            f"{path} lacks {exc}", fix="give a decoder model's config.json"
        ) from None
    except (TypeError, ValueError) as exc:
        raise KvguardError(
            f"{path}: a layer or head figure is not a number ({exc})",
            fix="give a decoder model's config.json",
        ) from None
    window = config.get("sliding_window")
    swa_layers = config_swa_layers(config)
    model_type = str(config.get("model_type", "unknown"))
    if swa_layers is None:
        raise KvguardError(
            f"{path}: which layers of this {model_type} model slide (window {window}) is "
            "unknown: no layer_types or sliding_window_pattern",
            fix="give the model's GGUF file, or add layer_types to config.json",
        )
    return ModelArch(
        architecture=model_type,
        n_layers=n_layers,
        n_kv_heads=n_kv_heads,
        head_dim_k=head_dim,
        head_dim_v=head_dim,
        context_length=int(config.get("max_position_embeddings", 0)),
        sliding_window=int(window) if window and any(swa_layers) else None,
        swa_layers=swa_layers,
    )


def load_arch(path: Path) -> ModelArch:
    """A GGUF file's, a config.json's, or a model folder's (its config.json) architecture."""
    if path.is_dir():
        return arch_from_config(path / "config.json")
    if path.suffix == ".json":
        return arch_from_config(path)
    return read_arch(path)
