"""Re-quantize a GGUF model with llama.cpp's own quantizer: a candidate for the model preview.

    kvguard quantize MODEL TYPE OUTPUT        e.g. kvguard quantize smollm2-135m Q8_0 q8.gguf

MODEL is a bundled model name or a .gguf file; TYPE one of llama.cpp's file types (``Q8_0``,
``Q4_K_M``, ``F16``, ...). It runs ``llama_model_quantize`` from llama-cpp-python (requantizing
an already quantized file is allowed, as llama.cpp's ``llama-quantize --allow-requantize``).
Then ``pytest --kvguard BUDGETS --kvguard-against-model MODEL=OUTPUT`` previews the swap.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_kvguard.cli.model_facts import model_path
from pytest_kvguard.core.args import OneLineParser
from pytest_kvguard.core.errors import KvguardError

PREFIX = "LLAMA_FTYPE_MOSTLY_"


def file_types(lc: Any) -> dict[str, int]:
    """llama.cpp's quantized file types by their short names (``Q8_0``: 7)."""
    found = {name.removeprefix(PREFIX): getattr(lc, name) for name in dir(lc)
             if name.startswith(PREFIX)}  # fmt: skip
    found["F32"] = lc.LLAMA_FTYPE_ALL_F32
    return found


def quantize(source: Path, kind: str, output: Path) -> float:
    """Write ``output``, ``source`` re-quantized to ``kind``; the seconds it took."""
    try:
        import llama_cpp as lc
    except ImportError:
        raise KvguardError(
            "kvguard quantize runs llama.cpp's quantizer, and llama-cpp-python is not installed",
            fix='pip install "pytest-kvguard[llama]"',
        ) from None
    from pytest_kvguard.engines.llama_log import init_backend

    init_backend()  # llama.cpp's log kept quietly, not a page of tensor lines on stderr
    types = file_types(lc)
    if kind.upper() not in types:
        raise KvguardError(
            f"unknown file type {kind!r}", fix="use one of: " + ", ".join(sorted(types))
        )
    if output.resolve() == source.resolve():
        raise KvguardError(f"{output} is the model itself", fix="write the candidate elsewhere")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvguardError(
            f"cannot create {output.parent}: {exc.strerror}", fix="write OUTPUT somewhere writable"
        ) from None
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = types[kind.upper()], True
    if output.is_dir():
        raise KvguardError(f"{output} is a folder", fix="give the .gguf file to write")
    # Written under a temporary name of its own and renamed when whole: a failed or interrupted
    # run leaves no half-written .gguf that looks like a candidate, and two runs never share it.
    handle, name = tempfile.mkstemp(prefix=output.name + ".", suffix=".partial", dir=output.parent)
    os.close(handle)
    partial = Path(name)
    started = time.monotonic()
    try:
        if lc.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
            raise KvguardError(
                f"llama.cpp could not quantize {source} to {kind}",
                fix="check that the file loads (kvguard model-facts FILE) and that there is "
                f"room for {output}",
            )
        partial.replace(output)
    except OSError as exc:
        raise KvguardError(f"cannot write {output}: {exc.strerror}", fix=None) from None
    finally:
        partial.unlink(missing_ok=True)
    return time.monotonic() - started


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
