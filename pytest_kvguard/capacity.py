"""KV-cache capacity calculator: what each policy costs at each context length, without weights.

Reads the architecture from a GGUF file or a Hugging Face ``config.json`` (``layer_types``,
``sliding_window``, ``num_key_value_heads``, ``head_dim``) and predicts KV bytes per policy.
llama.cpp's iSWA cache holds ``pad256(window x n_seq + n_ubatch)`` cells in each sliding layer.

    python -m pytest_kvguard.capacity MODEL.gguf|config.json [--contexts 512,1024] [--cap 256]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

from pytest_kvguard.errors import KvguardError
from pytest_kvguard.models import ModelArch, read_arch
from pytest_kvguard.policies import Policy
from pytest_kvguard.units import mib

DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192)


def arch_from_config(path: Path) -> ModelArch:
    """The figures of a Hugging Face ``config.json`` (text config nested under ``text_config``)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise KvguardError(f"cannot read {path}: {exc}", fix="give a config.json") from None
    config = config.get("text_config", config)
    try:
        n_layers = int(config["num_hidden_layers"])
        n_heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // n_heads)
        n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    except KeyError as exc:
        raise KvguardError(
            f"{path} lacks {exc}", fix="give a decoder model's config.json"
        ) from None
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types:
        swa_layers = tuple(kind == "sliding_attention" for kind in layer_types)
    elif window and config.get("sliding_window_pattern"):
        pattern = int(config["sliding_window_pattern"])
        swa_layers = tuple((i + 1) % pattern != 0 for i in range(n_layers))
    else:
        # A window with no per-layer pattern slides everywhere (Mistral-style); none: full.
        swa_layers = (bool(window),) * n_layers
    return ModelArch(
        architecture=str(config.get("model_type", "unknown")),
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


def pad256(n: int) -> int:
    return (n + 255) // 256 * 256


def layer_bytes(arch: ModelArch, bytes_per_element: float) -> float:
    """K and V of one token in one layer."""
    return arch.n_kv_heads * (arch.head_dim_k + arch.head_dim_v) * bytes_per_element


def swa_cells(arch: ModelArch, n_ubatch: int = 512, n_seq: int = 1) -> int:
    """Cells llama.cpp's iSWA cache gives each sliding layer."""
    assert arch.sliding_window is not None
    return pad256(arch.sliding_window * n_seq + n_ubatch)


def predict_kv_bytes(
    arch: ModelArch,
    n_tokens: int,
    policy: str,
    *,
    cap: int | None = None,
    bytes_per_element: float = 2.0,
    n_ubatch: int = 512,
    n_seq: int = 1,
) -> float:
    """KV bytes held after ``n_tokens`` under ``policy`` (full, window, sink, swa, swa_full).

    window and sink hold ``cap`` entries in every layer (the sinks count inside the cap); swa
    holds llama.cpp's iSWA cell count in sliding layers and everything in the others.
    """
    per_layer = layer_bytes(arch, bytes_per_element)
    if policy in ("full", "swa_full"):
        return arch.n_layers * n_tokens * per_layer
    if policy in ("window", "sink"):
        if cap is None:
            raise KvguardError(f"policy '{policy}' needs a cap", fix="pass --cap")
        return arch.n_layers * min(n_tokens, cap) * per_layer
    if policy == "swa":
        if arch.sliding_window is None:
            return arch.n_layers * n_tokens * per_layer
        sliding = sum(arch.swa_layers)
        held = min(n_tokens, swa_cells(arch, n_ubatch, n_seq))
        return (sliding * held + (arch.n_layers - sliding) * n_tokens) * per_layer
    raise KvguardError(f"no prediction for policy '{policy}'", fix="use full, window, sink, swa")


MLX_STEP = 256
"""mlx-lm's KVCache grows its buffers in steps of this many tokens."""


def predict_engine_kv_bytes(
    engine: str,
    arch: ModelArch,
    n_tokens: int,
    policy: Policy,
    *,
    element_bytes: float,
    n_ubatch: int = 512,
    last_call: int = 1,
) -> float:
    """KV bytes an engine should report after ``n_tokens`` fed as the stream scenario feeds them.

    llama.cpp (the context's state: cells in use): window/sink hold ``min(n, cap)`` cells in
    every layer; full and swa let an iSWA model's sliding layers hold at most
    ``pad256(window + n_ubatch)`` cells; swa_full holds everything.
    mlx-lm (the caches' buffers): ``KVCache`` allocates in steps of 256 tokens;
    ``RotatingKVCache`` (window, sink, a model's sliding layers) holds ``min(n, max_size)``
    exactly when filled in chunks that fit, and ``max_size - 1 + last_call`` right after a
    call of ``last_call`` > 1 tokens on a full cache (its chunked path appends the whole chunk
    to the ``max_size - 1`` newest keys). engine_default is predicted as the cap applied, so an
    engine that ignores the cap shows up as a deviation.
    """

    def rotating(max_size: int) -> int:
        if engine == "mlx" and last_call > 1 and n_tokens - last_call >= max_size:
            return max_size - 1 + last_call
        return min(n_tokens, max_size)

    per_layer = layer_bytes(arch, element_bytes)
    sliding = arch.swa_layers if arch.sliding_window else (False,) * arch.n_layers
    if policy.cap is not None:  # window, sink, engine_default
        held = [rotating(policy.cap)] * arch.n_layers
    elif engine == "llama_cpp":
        limit = n_tokens
        if arch.sliding_window and policy.kind != "swa_full":
            limit = min(n_tokens, swa_cells(arch, n_ubatch))
        held = [limit if slides else n_tokens for slides in sliding]
    elif engine == "mlx":
        stepped = -(-n_tokens // MLX_STEP) * MLX_STEP
        window = arch.sliding_window or 0
        if policy.kind == "swa":
            held = [rotating(window) if slides else stepped for slides in sliding]
        else:
            held = [stepped] * arch.n_layers
    else:
        raise KvguardError(f"no KV prediction for engine '{engine}'")
    return sum(held) * per_layer


def capacity_table(
    arch: ModelArch,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    *,
    cap: int = 256,
    bytes_per_element: float = 2.0,
    n_ubatch: int = 512,
    n_seq: int = 1,
) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: context -> full, window/sink (cap), swa, swa_full, full/swa saving."""
    headers = ["context", "full", f"window/sink {cap}", "swa", "swa_full", "full / swa"]
    rows = []
    for n in contexts:
        full = predict_kv_bytes(arch, n, "full", bytes_per_element=bytes_per_element)
        capped = predict_kv_bytes(arch, n, "sink", cap=cap, bytes_per_element=bytes_per_element)
        swa = predict_kv_bytes(
            arch, n, "swa", bytes_per_element=bytes_per_element, n_ubatch=n_ubatch, n_seq=n_seq
        )
        rows.append(
            [str(n), mib(full, 2), mib(capped, 2), mib(swa, 2), mib(full, 2), f"{full / swa:.2f}x"]
        )
    return headers, rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_kvguard.capacity",
        description="KV-cache bytes per policy and context length, from a GGUF or config.json.",
    )
    parser.add_argument("model", type=Path, help="a .gguf file or a Hugging Face config.json")
    parser.add_argument(
        "--contexts",
        default=",".join(map(str, DEFAULT_CONTEXTS)),
        help="comma-separated context lengths (default: %(default)s)",
    )
    parser.add_argument("--cap", type=int, default=256, help="window/sink cap (default: 256)")
    parser.add_argument(
        "--bytes", type=float, default=2.0, help="bytes per cache element (default: 2, f16)"
    )
    parser.add_argument("--ubatch", type=int, default=512, help="llama.cpp n_ubatch (default: 512)")
    parser.add_argument("--slots", type=int, default=1, help="llama.cpp n_seq / slots (default: 1)")
    args = parser.parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--contexts must be integers, got {args.contexts!r}")
    try:
        arch = load_arch(args.model)
    except KvguardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    window = (
        f", sliding window {arch.sliding_window} on {sum(arch.swa_layers)} of"
        if arch.sliding_window
        else " of"
    )
    print(
        f"{args.model.name}: {arch.architecture}{window} {arch.n_layers} layers, "
        f"{arch.n_kv_heads} KV heads, head dim {arch.head_dim_k}, "
        f"{arch.kv_bytes_per_token(args.bytes):,.0f} B/token"
    )
    headers, rows = capacity_table(
        arch, contexts, cap=args.cap, bytes_per_element=args.bytes, n_ubatch=args.ubatch,
        n_seq=args.slots,
    )  # fmt: skip
    print(tabulate(rows, headers=headers, disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
