"""llama.cpp's log: kept quietly (its tail quotes into engine errors) and captured to read.

Imported by the llama.cpp adapter only: importing it imports llama_cpp.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp as lc

_log_tail: deque[str] = deque(maxlen=40)
_log_capture: list[str] | None = None
"""While set, every log fragment is appended here too (to read buffer sizes off the log)."""


@lc.llama_log_callback  # type: ignore[untyped-decorator]
def _keep_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp is chatty on stderr; keep the tail so an engine error can quote it.
    fragment = text.decode("utf-8", "replace")
    _log_tail.append(fragment)
    if _log_capture is not None:
        _log_capture.append(fragment)
    if _ECHO_LOG:
        sys.stderr.write(fragment)


_ECHO_LOG = bool(os.environ.get("KVGUARD_LLAMA_LOG"))


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """The log llama.cpp writes inside the block, as one list of fragments."""
    global _log_capture
    captured: list[str] = []
    _log_capture = captured
    try:
        yield captured
    finally:
        _log_capture = None


def log_excerpt() -> str:
    lines = "".join(_log_tail).strip().splitlines()
    return " | ".join(line.strip() for line in lines[-3:])


_backend_ready = False


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        lc.llama_log_set(_keep_log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True
