"""KV-cache capacity calculator: what each policy costs at each context length, without weights.

Reads the architecture from a GGUF file or a Hugging Face ``config.json`` (``layer_types``,
``sliding_window``, ``num_key_value_heads``, ``head_dim``) and predicts KV bytes per policy as
llama.cpp holds them (``engines.llama_cpp.kv_size``). Each engine's prediction of a stream's
KV bytes (the memory scenario's) is its adapter's (``engines.kv_size.predict_engine_kv_bytes``).

    kvguard capacity MODEL.gguf|config.json [--contexts 512,1024] [--cap 256]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

from pytest_kvguard.core.args import OneLineParser, whole_number
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import LLAMA_CACHE_TYPES
from pytest_kvguard.core.units import mib
from pytest_kvguard.engines.kv_size import layer_bytes
from pytest_kvguard.engines.llama_cpp.kv_size import cache_type_bytes, predict_kv_bytes
from pytest_kvguard.inputs.architecture import load_arch
from pytest_kvguard.inputs.models import ModelArch

DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192)


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


def _contexts(text: str) -> list[int]:
    """An argparse type: comma-separated context lengths, each a whole number >= 1."""
    try:
        contexts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers, got {text!r}") from None
    if not contexts or min(contexts) < 1:
        raise argparse.ArgumentTypeError(f"must be lengths of 1 token or more, got {text!r}")
    return contexts


def _bytes(text: str) -> float:
    """An argparse type: bytes per cache element, a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a number above 0: write e.g. 2")
    return value


def main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-capacity") -> int:
    parser = OneLineParser(
        prog=prog,
        description="KV-cache bytes per policy and context length, from a GGUF or config.json.",
    )
    parser.add_argument("model", type=Path, help="a .gguf file or a Hugging Face config.json")
    parser.add_argument(
        "--contexts",
        type=_contexts,
        default=",".join(map(str, DEFAULT_CONTEXTS)),
        help="comma-separated context lengths (default: %(default)s)",
    )
    parser.add_argument(
        "--cap", type=whole_number(1), default=256, help="window/sink cap (default: 256)"
    )
    parser.add_argument(
        "--bytes", type=_bytes, default=2.0, help="bytes per cache element (default: 2, f16)"
    )
    parser.add_argument(
        "--cache-type-k",
        choices=list(LLAMA_CACHE_TYPES),
        help="llama.cpp's K cache type (q8_0: 34 bytes per 32 elements, ...); overrides --bytes",
    )
    parser.add_argument(
        "--cache-type-v", choices=list(LLAMA_CACHE_TYPES), help="llama.cpp's V cache type"
    )
    parser.add_argument(
        "--ubatch", type=whole_number(1), default=512, help="llama.cpp n_ubatch (default: 512)"
    )
    parser.add_argument(
        "--slots", type=whole_number(1), default=1, help="llama.cpp n_seq / slots (default: 1)"
    )
    args = parser.parse_args(argv)
    contexts = args.contexts
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
