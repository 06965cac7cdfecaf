"""llama.cpp's own quantizer on a GGUF file (llama-cpp-python's ``llama_model_quantize``):
``kvguard quantize`` writes a candidate model with it, and the speculative scenario a draft
model (the target re-quantized). Imports llama-cpp-python only when called."""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

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


GGUF_DRAFT_TYPES = {"gguf_q3_k": "Q3_K_M", "gguf_q4_0": "Q4_0"}
"""The speculative scenario's drafts that are the target's GGUF re-quantized by llama.cpp, and
the file type each is."""

_DRAFT_DIR: Path | None = None
_REQUANTIZED: dict[tuple[Path, str], Path] = {}


def requantized(source: Path, kind: str) -> Path:
    """``source`` re-quantized to ``kind`` in a folder of this process's (removed when it
    exits), written once per process."""
    global _DRAFT_DIR
    key = (source.resolve(), kind.upper())
    if key not in _REQUANTIZED:
        if _DRAFT_DIR is None:
            _DRAFT_DIR = Path(tempfile.mkdtemp(prefix="kvguard-drafts-"))
            atexit.register(shutil.rmtree, _DRAFT_DIR, True)
        # Two models may share a file name: the folder's hash keeps their drafts apart.
        where = hashlib.sha256(str(key[0]).encode()).hexdigest()[:12]
        output = _DRAFT_DIR / f"{source.stem}-{where}.{kind.upper()}.gguf"
        quantize(source, kind, output)
        _REQUANTIZED[key] = output
    return _REQUANTIZED[key]
