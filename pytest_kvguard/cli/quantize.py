"""Re-quantize a GGUF model with llama.cpp's own quantizer: a candidate for the model preview.

    kvguard quantize MODEL TYPE OUTPUT        e.g. kvguard quantize smollm2-135m Q8_0 q8.gguf

MODEL is a bundled model name or a .gguf file; TYPE one of llama.cpp's file types (``Q8_0``,
``Q4_K_M``, ``F16``, ...). It runs ``llama_model_quantize`` from llama-cpp-python (requantizing
an already quantized file is allowed, as llama.cpp's ``llama-quantize --allow-requantize``).
Then ``pytest --kvguard BUDGETS --kvguard-against-model MODEL=OUTPUT`` previews the swap.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pytest_kvguard.cli.model_facts import model_path
from pytest_kvguard.core.args import OneLineParser
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines.gguf_quantize import quantize


def main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-quantize") -> int:
    parser = OneLineParser(
        prog=prog,
        description="Re-quantize a GGUF model with llama.cpp's own quantizer "
        "(llama-cpp-python's llama_model_quantize): a candidate for --kvguard-against-model.",
    )
    parser.add_argument("model", help="a bundled model name or a .gguf file")
    parser.add_argument("type", help="llama.cpp file type: Q8_0, Q4_K_M, Q4_0, F16, ...")
    parser.add_argument("output", type=Path, help="the .gguf file to write")
    args = parser.parse_args(argv)
    try:
        seconds = quantize(model_path(args.model), args.type, args.output)
    except KvguardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.output} ({args.type.upper()}, {seconds:.1f} s); preview it with: "
        f"pytest --kvguard BUDGETS --kvguard-against-model {args.model}={args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
