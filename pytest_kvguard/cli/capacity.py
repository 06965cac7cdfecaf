"""KV-cache capacity calculator: what each policy costs at each context length, without weights.

Reads the architecture from a GGUF file or a Hugging Face ``config.json`` (``layer_types``,
``sliding_window``, ``num_key_value_heads``, ``head_dim``) and predicts KV bytes per policy as
llama.cpp holds them (``engines.llama_cpp.kv_size``). Each engine's prediction of a stream's
KV bytes (the memory scenario's) lives in its own package; ``predict_engine_kv_bytes`` picks it.

    python -m pytest_kvguard.cli.capacity MODEL.gguf|config.json [--contexts 512,1024] [--cap 256]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from tabulate import tabulate

from pytest_kvguard.engines.kv_size import layer_bytes
from pytest_kvguard.engines.llama_cpp import kv_size as llama_cpp_kv_size
from pytest_kvguard.engines.llama_cpp.kv_size import cache_type_bytes, predict_kv_bytes
from pytest_kvguard.engines.mlx import kv_size as mlx_kv_size
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.gate.policies import LLAMA_CACHE_TYPES, Policy
from pytest_kvguard.inputs.model_folder import config_swa_layers, text_config
from pytest_kvguard.inputs.models import ModelArch, read_arch
from pytest_kvguard.units import mib

DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192)


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


KV_SIZES: dict[str, ModuleType] = {"llama_cpp": llama_cpp_kv_size, "mlx": mlx_kv_size}
"""Each engine's own KV-size prediction (its package's ``kv_size``), by engine name."""


def rotating_capacity(engine: str, policy: Policy, arch: ModelArch) -> int | None:
    """Entries a rotating cache of this policy holds on ``engine``: the cap, or where the
    engine's sliding layers rotate (mlx-lm's swa) the model's window; None where nothing
    rotates."""
    module = KV_SIZES.get(engine)
    return policy.cap if module is None else module.rotating_capacity(policy, arch)


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
    """KV bytes an engine should report after ``n_tokens`` fed as the stream scenario feeds
    them, the last call ``last_call`` tokens: the engine's own prediction (its package's
    ``kv_size``); on another engine, a capped policy's ``min(n, cap)`` entries per layer."""
    module = KV_SIZES.get(engine)
    if module is not None:
        prediction: float = module.predict_stream_kv_bytes(
            arch, n_tokens, policy, element_bytes=element_bytes, n_ubatch=n_ubatch,
            last_call=last_call,
        )  # fmt: skip
        return prediction
    if policy.cap is None:
        raise KvguardError(f"no KV prediction for engine '{engine}'")
    return arch.n_layers * min(n_tokens, policy.cap) * layer_bytes(arch, element_bytes)


def capacity_table(
    arch: ModelArch,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    *,
    cap: int = 256,
    bytes_per_element: float = 2.0,
    n_ubatch: int = 512,
    n_seq: int = 1,
    v_bytes_per_element: float | None = None,
) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: context -> full, window/sink (cap), swa, swa_full, full/swa saving."""
    headers = ["context", "full", f"window/sink {cap}", "swa", "swa_full", "full / swa"]
    rows = []
    k, v = bytes_per_element, v_bytes_per_element
    for n in contexts:
        full = predict_kv_bytes(arch, n, "full", bytes_per_element=k, v_bytes_per_element=v)
        capped = predict_kv_bytes(
            arch, n, "sink", cap=cap, bytes_per_element=k, v_bytes_per_element=v
        )
        swa = predict_kv_bytes(
            arch, n, "swa", bytes_per_element=k, v_bytes_per_element=v, n_ubatch=n_ubatch,
            n_seq=n_seq,
        )  # fmt: skip
        rows.append(
            [str(n), mib(full, 2), mib(capped, 2), mib(swa, 2), mib(full, 2), f"{full / swa:.2f}x"]
        )
    return headers, rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_kvguard.cli.capacity",
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
    parser.add_argument(
        "--cache-type-k",
        choices=list(LLAMA_CACHE_TYPES),
        help="llama.cpp's K cache type (q8_0: 34 bytes per 32 elements, ...); overrides --bytes",
    )
    parser.add_argument(
        "--cache-type-v", choices=list(LLAMA_CACHE_TYPES), help="llama.cpp's V cache type"
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
    k_bytes = cache_type_bytes(args.cache_type_k) if args.cache_type_k else args.bytes
    v_bytes = cache_type_bytes(args.cache_type_v) if args.cache_type_v else args.bytes
    if args.cache_type_k or args.cache_type_v:
        print(f"K {args.cache_type_k or args.bytes}, V {args.cache_type_v or args.bytes}: "
              f"{arch.n_layers * layer_bytes(arch, k_bytes, v_bytes):,.0f} B/token")  # fmt: skip
    headers, rows = capacity_table(
        arch, contexts, cap=args.cap, bytes_per_element=k_bytes, n_ubatch=args.ubatch,
        n_seq=args.slots, v_bytes_per_element=v_bytes,
    )  # fmt: skip
    print(tabulate(rows, headers=headers, disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
