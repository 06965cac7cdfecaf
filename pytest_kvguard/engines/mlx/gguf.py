"""Load a GGUF file into mlx-lm's own model classes (``llama``, ``gemma3_text``).

Weights come from ``mx.load`` where mlx reads the quantization natively (Q4_0, Q4_1, Q8_0) and
from the ``gguf`` package otherwise (K-quants); either way they are dequantized to float32,
which decodes far faster than quantized matmul on CPU. Two GGUF conventions are undone here:
llama.cpp's converter permutes Llama Q/K rows for interleaved RoPE (so the model runs with
``rope_traditional=True``), and stores Gemma's RMSNorm weights as ``1 + w`` (mlx-lm adds the 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.gguf_header import read_gguf_header

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_LAYER_NAMES = {**LAYER_NAMES, "ffn_norm": "post_attention_layernorm"}
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def mlx_tensor_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    """mlx-lm's name for a GGUF tensor (``blk.3.attn_q``: ``model.layers.3.self_attn.q_proj``)."""
    base = gguf_name.removesuffix(".weight")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.weight"
    return f"{GLOBAL_NAMES[base]}.weight"


def _read_weights(path: Path) -> tuple[dict[str, mx.array], dict[str, Any], str]:
    """All tensors as float32 mlx arrays, the metadata, and which reader was used."""
    raw: dict[str, Any]
    metadata: dict[str, Any]
    try:
        raw, metadata = mx.load(str(path), return_metadata=True)  # type: ignore[assignment]
    except (RuntimeError, ValueError):
        return (*_read_with_gguf_package(path), "gguf package (dequantized)")
    weights = {}
    for key, value in raw.items():
        if key.endswith((".scales", ".biases")):
            continue
        base = key.removesuffix(".weight")
        scales = raw.get(base + ".scales")
        if scales is not None:
            # mx.load keeps Q4_0/Q4_1/Q8_0 as mlx affine quantization, groups of 32 values.
            bits = value.shape[-1] * 32 // (scales.shape[-1] * 32)
            value = mx.dequantize(value, scales, raw[base + ".biases"], group_size=32, bits=bits)
        weights[base] = value.astype(mx.float32)
    meta = {
        k: (v.item() if isinstance(v, mx.array) and v.size == 1 else v) for k, v in metadata.items()
    }
    return weights, meta, "mx.load (dequantized)"


def _read_with_gguf_package(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    header = read_gguf_header(path)
    weights = {}
    for tensor in header.tensors:
        array = dequantize(header.tensor_bytes(tensor), GGMLQuantizationType(tensor.ggml_type))
        shape = tuple(reversed(tensor.shape))  # GGUF lists dims innermost first
        weights[tensor.name.removesuffix(".weight")] = mx.array(
            array.reshape(shape), dtype=mx.float32
        )
    meta = {k: v for k, v in header.metadata.items() if not k.startswith("tokenizer.ggml")}
    return weights, meta


OPTIONAL_ARGS = frozenset({"max_position_embeddings"})
"""Model arguments that only describe the model: left out where an older mlx-lm lacks them."""


def _model_args(args_class: Any, **values: Any) -> Any:
    """``args_class(**values)`` without the optional arguments this mlx-lm release lacks."""
    fields = args_class.__dataclass_fields__
    return args_class(**{k: v for k, v in values.items() if k in fields or k not in OPTIONAL_ARGS})


def load_gguf_model(path: Path) -> tuple[nn.Module, dict[str, str]]:
    """An mlx-lm model with the GGUF's config and weights, and facts for the report."""
    weights, meta, reader = _read_weights(path)
    arch = str(meta.get("general.architecture"))

    def num(key: str, default: float | None = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise KvguardError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    if arch == "llama":
        from mlx_lm.models import llama

        model: nn.Module = llama.Model(
            _model_args(
                llama.ModelArgs,
                model_type="llama",
                hidden_size=int(num("embedding_length")),
                num_hidden_layers=int(num("block_count")),
                intermediate_size=int(num("feed_forward_length")),
                num_attention_heads=int(num("attention.head_count")),
                num_key_value_heads=int(num("attention.head_count_kv")),
                rms_norm_eps=float(num("attention.layer_norm_rms_epsilon")),
                vocab_size=int(weights["token_embd"].shape[0]),
                rope_theta=float(num("rope.freq_base", 10000.0)),
                max_position_embeddings=int(num("context_length")),
                rope_traditional=True,  # GGUF Q/K rows are permuted for interleaved RoPE
                tie_word_embeddings="output" not in weights,
            )
        )
        layer_names, norm_shift = LLAMA_LAYER_NAMES, 0.0
    elif arch == "gemma3":
        from mlx_lm.models import gemma3_text

        head_dim = int(num("attention.key_length"))
        # mlx-lm before 0.29 names the global layers' RoPE base rope_global_base_freq.
        fields = gemma3_text.ModelArgs.__dataclass_fields__
        global_rope_key = "rope_theta" if "rope_theta" in fields else "rope_global_base_freq"
        model = gemma3_text.Model(
            _model_args(
                gemma3_text.ModelArgs,
                model_type="gemma3_text",
                hidden_size=int(num("embedding_length")),
                num_hidden_layers=int(num("block_count")),
                intermediate_size=int(num("feed_forward_length")),
                num_attention_heads=int(num("attention.head_count")),
                num_key_value_heads=int(num("attention.head_count_kv")),
                head_dim=head_dim,
                rms_norm_eps=float(num("attention.layer_norm_rms_epsilon")),
                vocab_size=int(weights["token_embd"].shape[0]),
                **{global_rope_key: float(num("rope.freq_base", 1_000_000.0))},
                query_pre_attn_scalar=head_dim,  # what llama.cpp uses for Gemma 3 below 27B
                sliding_window=int(num("attention.sliding_window")),
                max_position_embeddings=int(num("context_length")),
            )
        )
        # llama.cpp's converter stores Gemma norms as 1 + w; mlx-lm's RMSNorm adds the 1 itself.
        layer_names, norm_shift = GEMMA3_LAYER_NAMES, 1.0
    else:
        raise KvguardError(
            f"the mlx engine cannot load GGUF architecture '{arch}' from {path}",
            fix="use a bundled model, or an mlx-lm model folder or hub id",
        )
    named = []
    for base, value in weights.items():
        name = mlx_tensor_name(base, layer_names)
        if norm_shift and name.endswith("norm.weight"):
            value = value - norm_shift
        named.append((name, value))
    if arch == "gemma3":
        model.sanitize(dict(named))  # ties lm_head to the embeddings when the file has no output
    model.load_weights(named)
    mx.eval(model.parameters())
    return model, {"weights": f"float32 via {reader}", "architecture": arch}
