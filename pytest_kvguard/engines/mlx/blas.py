"""Route mlx's CPU BLAS calls to OpenBLAS on Linux (it must happen before mlx is loaded).

The mlx CPU wheel links a reference BLAS; fp32 matmul is ~18x faster through OpenBLAS. Loading
Debian's libopenblas with RTLD_GLOBAL first makes mlx's BLAS symbols resolve to it. The plugin
does this at configure time, so a test module that imports mlx still gets the fast path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_path: str | None = None


def preload_openblas() -> str:
    """Preload once; returns the BLAS path in use, in words, for the report header."""
    global _path
    if _path is None:
        _path = _choose()
    return _path


def _choose() -> str:
    if sys.platform != "linux":
        return "platform default (Accelerate / Metal)"
    if os.environ.get("KVGUARD_MLX_BLAS") == "bundled":
        return "mlx's bundled reference BLAS (KVGUARD_MLX_BLAS=bundled)"
    if "mlx.core" in sys.modules:
        return "mlx's bundled reference BLAS (mlx was loaded before kvguard could preload OpenBLAS)"
    library = ctypes.util.find_library("openblas")
    if library is None:
        return "mlx's bundled reference BLAS (slow: apt install libopenblas0-pthread)"
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    return f"OpenBLAS ({library}), preloaded"


def prepare() -> str:
    """The mlx adapter's ``prepare``: OpenBLAS preloaded before mlx can be imported, and the
    session header's words for it."""
    return f"BLAS: {preload_openblas()}"
