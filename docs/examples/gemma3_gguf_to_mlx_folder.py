#!/usr/bin/env python3
"""Make an mlx-lm model folder (config.json, model.safetensors, tokenizer files) from a
Gemma 3 (text) GGUF file, offline.

    python docs/examples/gemma3_gguf_to_mlx_folder.py GGUF OUT_DIR
        [--dtype float32|bfloat16|float16] [--chat-template FILE]

Weights: every tensor dequantized with the `gguf` package (numpy), renamed to mlx-lm's
gemma3_text names, Gemma's RMSNorm weights shifted back by -1 (llama.cpp stores 1 + w, mlx-lm
adds the 1), saved in one model.safetensors (float32 by default: the dequantized values exactly).
The GGUF has no output tensor, so lm_head stays tied to the embeddings (mlx-lm's sanitize).

Config: from the GGUF metadata; what a Gemma 3 GGUF does not store is what llama.cpp hardcodes
for gemma3: every 6th layer global (sliding_window_pattern 6), local RoPE base 10000,
query_pre_attn_scalar = head_dim (llama.cpp's rule below 27B).

Tokenizer: transformers' own GGUF-tokenizer converter (gguf_tokenizer_mapping, Gemma builder:
BPE with byte fallback, merges rebuilt from token order, control tokens special, user-defined
tokens added) fed from the `gguf` package's reader, because transformers' GGUF reader imports
torch. Special tokens and add_bos/add_eos from the GGUF; tokenizer.chat_template if the file has
one (else none, unless --chat-template gives a file).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from pytest_kvguard.engines.mlx.gguf import GEMMA3_LAYER_NAMES, mlx_tensor_name

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SLIDING_WINDOW_PATTERN = 6  # llama.cpp: LLM_ARCH_GEMMA3 uses swa pattern 6 when the file has none
ROPE_LOCAL_BASE = 10_000.0  # llama.cpp: rope_freq_base_train_swa for gemma3


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def write_weights(reader, out: Path, dtype: str) -> dict[str, tuple[int, ...]]:
    import mlx.core as mx
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    mx_dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[dtype]
    weights, shapes = {}, {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        array = dequantize(np.asarray(t.data), qtype).astype(np.float32)
        array = array.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGUF dims innermost first
        name = mlx_tensor_name(t.name, GEMMA3_LAYER_NAMES)
        if name.endswith("norm.weight"):
            array = array - 1.0  # llama.cpp stores Gemma norms as 1 + w
        weights[name] = mx.array(array).astype(mx_dtype)
        shapes[name] = array.shape
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return shapes


def write_config(reader, out: Path, dtype: str, vocab_size: int, tied: bool) -> dict:
    arch = field(reader, "general.architecture")
    if arch != "gemma3":
        raise SystemExit(f"expected a gemma3 GGUF, got architecture {arch!r}")

    def num(key, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise SystemExit(f"GGUF metadata lacks {arch}.{key}")
        return value

    layers = int(num("block_count"))
    head_dim = int(num("attention.key_length"))
    pattern = num("attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # newer exports: one flag per layer
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or (i + 1) % int(pattern) != 0 for i in range(layers)]
    if sliding != [(i + 1) % SLIDING_WINDOW_PATTERN != 0 for i in range(layers)]:
        raise SystemExit(
            f"layer pattern {pattern!r} is not mlx-lm's gemma3_text (every 6th global)"
        )
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(num("embedding_length")),
        "intermediate_size": int(num("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": int(num("attention.head_count")),
        "num_key_value_heads": int(num("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": float(num("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(num("context_length")),
        "rope_theta": float(num("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "rope_scaling": None,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(num("attention.sliding_window")),
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": tied,
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def write_tokenizer(reader, out: Path, chat_template_file: Path | None) -> str:
    from transformers import GemmaTokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokens = field(reader, "tokenizer.ggml.tokens")
    tokenizer_dict = {
        "tokenizer_type": field(reader, "tokenizer.ggml.model"),
        "pre_tokenizer_type": field(reader, "tokenizer.ggml.pre"),
        "tokens": tokens,
        "scores": field(reader, "tokenizer.ggml.scores"),
        "token_type": field(reader, "tokenizer.ggml.token_type"),
        "add_prefix_space": field(reader, "tokenizer.ggml.add_space_prefix"),
    }
    if field(reader, "tokenizer.ggml.merges") is not None:
        tokenizer_dict["merges"] = field(reader, "tokenizer.ggml.merges")
    backend, _ = convert_gguf_tokenizer("gemma3", tokenizer_dict)

    def token(key):
        index = field(reader, f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    template = field(reader, "tokenizer.chat_template")
    source = "GGUF tokenizer.chat_template"
    if template is None and chat_template_file is not None:
        template, source = chat_template_file.read_text(), str(chat_template_file)
    elif template is None:
        source = "none (the GGUF has no tokenizer.chat_template)"
    add_bos = field(reader, "tokenizer.ggml.add_bos_token")
    kwargs = dict(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=True if add_bos is None else bool(add_bos),  # llama.cpp's SPM default
        add_eos_token=bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        model_max_length=int(field(reader, "gemma3.context_length")),
        clean_up_tokenization_spaces=False,
        spaces_between_special_tokens=False,
    )
    if template is not None:
        kwargs["chat_template"] = template
    tokenizer = GemmaTokenizer(**kwargs)
    tokenizer.save_pretrained(str(out))
    # Make add_bos_token/add_eos_token explicit in tokenizer_config.json whatever this
    # transformers release writes, and drop a chat_template.jinja duplicate if both exist.
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["add_bos_token"] = kwargs["add_bos_token"]
    cfg["add_eos_token"] = kwargs["add_eos_token"]
    cfg["tokenizer_class"] = "GemmaTokenizer"
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--chat-template", type=Path, default=None)
    args = parser.parse_args()

    from gguf import GGUFReader

    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(args.gguf))
    shapes = write_weights(reader, args.out, args.dtype)
    t_weights = time.perf_counter() - start
    vocab_size = shapes["model.embed_tokens.weight"][0]
    config = write_config(reader, args.out, args.dtype, vocab_size, "lm_head.weight" not in shapes)
    (args.out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": config["eos_token_id"],
                "pad_token_id": config["pad_token_id"],
            },
            indent=2,
        )
        + "\n"
    )
    template = write_tokenizer(reader, args.out, args.chat_template)
    total = time.perf_counter() - start
    size = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(
        f"wrote {args.out}: {len(shapes)} tensors ({args.dtype}), "
        f"{size / 1e6:.1f} MB, chat template: {template}"
    )
    print(f"time: weights {t_weights:.1f} s, total {total:.1f} s")


if __name__ == "__main__":
    main()
