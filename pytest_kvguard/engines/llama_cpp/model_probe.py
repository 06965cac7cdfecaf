"""The llama.cpp adapter's ``architecture_probe``: whether this llama-cpp-python loads a user's
GGUF file's architecture, asked of a vocabulary-only load (no weights) before any run."""

from __future__ import annotations

from pathlib import Path

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.core.paths import cached_per_file

UNKNOWN_ARCHITECTURE = "unknown model architecture"
"""What llama.cpp's loader logs for an architecture it does not implement."""


@cached_per_file
def llama_cpp_refusal(path: Path) -> str | None:
    """llama.cpp's refusal of the file's architecture, or None (it knows it, or the loader
    failed for another reason, which the check's run reports with the engine's own words)."""
    try:
        from pytest_kvguard.engines.gguf_vocab import GgufVocab
    except (ImportError, RuntimeError, OSError):
        return None  # not installed here, or its library does not load: the run says so
    try:
        GgufVocab(path)
    except EngineError as exc:
        message = str(exc)
        if UNKNOWN_ARCHITECTURE in message:
            return message[message.index(UNKNOWN_ARCHITECTURE) :]
    return None
