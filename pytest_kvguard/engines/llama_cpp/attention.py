"""llama.cpp's own attention probabilities, read through its graph evaluation callback.

A context made with flash attention off computes ``kq_soft_max-{layer}`` (the softmax of
``QK^T`` with the mask, shape ``[n_kv, n_tokens, n_head, 1]``) as a tensor of its graph;
``cb_eval`` lets the caller name tensors it wants to see and reads them once computed. The
context keeps every position (``swa_full``: the sliding layers' cells are not reused), and a
fresh context fills its cells in order, so cell ``j`` holds position ``j``.
"""

from __future__ import annotations

import ctypes
import functools
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llama_cpp as lc
import numpy as np

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.core.policies import UNQUANTIZED_CACHE_TYPES
from pytest_kvguard.engines.llama_cpp.context import GGML_TYPES, UBATCH
from pytest_kvguard.engines.llama_log import captured_log, log_excerpt
from pytest_kvguard.engines.protocols import AttentionRows

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine

SOFTMAX = "kq_soft_max"
"""llama.cpp's name for the attention probabilities (``build_attn_mha``), suffixed ``-{il}``."""


class _TensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` in the ggml that llama-cpp-python 0.3.x
    builds (since ggml dropped its ``backend`` field in 2024): the element type, its buffer and
    its extent per dimension."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


GGML_TYPE_F32 = 0


@functools.cache
def _ggml_base() -> Any:
    """ggml's tensor functions, looked up through llama-cpp-python's own loaded libllama (whose
    dependencies hold them): the same build, wherever and however it was installed."""
    lib = lc.llama_cpp._lib
    try:
        lib.ggml_get_name.restype = ctypes.c_char_p
        lib.ggml_get_name.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_get.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
        ]  # fmt: skip
        lib.ggml_is_contiguous.restype = ctypes.c_bool
        lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    except AttributeError as exc:
        raise EngineError(
            f"llama-cpp-python's library does not expose ggml's tensor functions ({exc}), so "
            "kvguard cannot read its attention"
        ) from None
    return lib


class _Reader:
    """The callback's state: which tensors to keep, where the current batch starts."""

    def __init__(self, prefixes: Sequence[str], rows: Sequence[int]) -> None:
        self.ggml = _ggml_base()
        self.names = re.compile("^(" + "|".join(map(re.escape, prefixes)) + r")-\d+$")
        """``Qcur-3``, not ``Qcur-3 (view)``: views of a tensor carry suffixes."""
        self.rows = sorted(rows)
        """Token positions whose rows are kept."""
        self.batch_start = 0
        self.batch: dict[str, np.ndarray] = {}
        """This batch's rows per tensor name: the last tensor of that name wins (llama.cpp
        names a layer's Q before and after RoPE alike)."""
        self.kept: dict[str, list[np.ndarray]] = {}
        self.error: str | None = None

    def __call__(self, tensor: int, ask: bool, _user: int) -> bool:
        try:
            name = (self.ggml.ggml_get_name(tensor) or b"").decode()
            wanted = self.names.match(name) is not None
            if ask or not wanted:
                return wanted
            self._keep(tensor, name)
        except Exception as exc:  # an exception must not cross into C
            self.error = f"{type(exc).__name__}: {exc}"
        return True

    def _keep(self, tensor: int, name: str) -> None:
        head = _TensorHead.from_address(tensor)
        if head.type != GGML_TYPE_F32 or not self.ggml.ggml_is_contiguous(tensor):
            raise EngineError(f"{name} is not a contiguous f32 tensor (type {head.type})")
        data = np.empty([int(n) for n in head.ne][::-1], dtype=np.float32)
        self.ggml.ggml_backend_tensor_get(tensor, data.ctypes.data, 0, data.nbytes)
        axis = token_axis(name)
        local = [
            r - self.batch_start for r in self.rows if 0 <= r - self.batch_start < data.shape[axis]
        ]
        kept = np.take(data, local, axis=axis)
        if name.startswith(SOFTMAX):
            # Key axis: cell j holds position j; cells past the rows' last position are masked
            # (probability 0), and llama.cpp pads the cells it attends over to a multiple of 256.
            width = self.rows[-1] + 1
            kept = kept[..., :width]
            kept = np.pad(kept, [(0, 0)] * (kept.ndim - 1) + [(0, width - kept.shape[-1])])
        self.batch[name] = kept

    def end_batch(self) -> None:
        for name, rows in self.batch.items():
            self.kept.setdefault(name, []).append(rows)
        self.batch = {}


def token_axis(name: str) -> int:
    """The token axis of a kept tensor, as numpy sees it (ggml's dimensions reversed):
    kq_soft_max (1, n_head, n_tokens, n_kv); Qcur / Kcur (1, n_tokens, n_head, head_dim)."""
    return 2 if name.startswith(SOFTMAX) else 1


def capture(
    engine: LlamaCppEngine, token_ids: Sequence[int], rows: Sequence[int],
    prefixes: Sequence[str] = (SOFTMAX,), type_k: str = "f16",
) -> dict[str, np.ndarray]:  # fmt: skip
    """Decode ``token_ids`` into a fresh full context with flash attention off (its K cache of
    ``type_k``), and return the tensors named ``{prefix}-{layer}`` at the token positions
    ``rows`` (in ascending order), the rows of all batches joined along the token axis."""
    reader = _Reader(prefixes, rows)
    callback = lc.ggml_backend_sched_eval_callback(reader)
    params = lc.llama_context_default_params()
    params.n_ctx = len(token_ids)
    params.n_batch = params.n_ubatch = UBATCH
    params.n_seq_max = 1
    params.n_threads = params.n_threads_batch = engine.options.n_threads
    # Flash attention off, else no kq_soft_max exists (releases before flash_attn_type: a bool).
    if hasattr(lc, "LLAMA_FLASH_ATTN_TYPE_DISABLED"):
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    else:
        params.flash_attn = False
    params.swa_full = True
    # The keys are written to the cache before KQ reads them back, so a quantized K type is
    # what every query's scores see, this batch's keys included.
    params.type_k = GGML_TYPES[type_k]
    params.no_perf = True
    params.cb_eval = callback
    with captured_log():
        ctx = lc.llama_init_from_model(engine.model, params)
    if not ctx:
        raise EngineError(f"llama.cpp could not create a context: {log_excerpt()}")
    batch = lc.llama_batch_init(UBATCH, 0, 1)
    try:
        last = max(rows)
        for start in range(0, last + 1, UBATCH):
            chunk = token_ids[start : min(start + UBATCH, last + 1)]
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 0
            # llama.cpp keeps only rows with logits after the last layer's attention, so
            # kq_soft_max still has every row; the output buffer holds one row, not 512.
            batch.logits[len(chunk) - 1] = 1
            reader.batch_start = start
            status = lc.llama_decode(ctx, batch)
            if reader.error:
                raise EngineError(f"reading llama.cpp's attention failed: {reader.error}")
            if status != 0:
                raise EngineError(f"llama_decode returned {status}: {log_excerpt()}")
            reader.end_batch()
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    return {name: np.concatenate(parts, axis=token_axis(name))
            for name, parts in reader.kept.items()}  # fmt: skip


def read_attention(
    engine: LlamaCppEngine, token_ids: Sequence[int], queries: Sequence[int],
    cache_types: tuple[str, str] = ("f16", "f16"),
) -> AttentionRows:  # fmt: skip
    """Every layer's ``kq_soft_max`` rows for the query positions, as (layer, head, query,
    key position), with the K cache of ``cache_types[0]``. A quantized V is refused: llama.cpp
    quantizes V only under flash attention, which computes no ``kq_soft_max``."""
    type_k, type_v = cache_types
    if type_v not in UNQUANTIZED_CACHE_TYPES:
        raise EngineError(
            f"a {type_v} V cache needs flash attention, and llama.cpp computes no {SOFTMAX} "
            "with it on, so its attention cannot be read",
            fix="quantize K only here (cache_type_v: f16)",
        )
    started = time.perf_counter()
    tensors = capture(engine, token_ids, queries, type_k=type_k)
    n_layers = lc.llama_model_n_layer(engine.model)
    missing = [i for i in range(n_layers) if f"{SOFTMAX}-{i}" not in tensors]
    if missing:
        raise EngineError(
            f"llama.cpp computed no {SOFTMAX} for layers {missing}: this build names its "
            "attention probabilities otherwise, so kvguard cannot read them"
        )
    probs = np.stack([tensors[f"{SOFTMAX}-{i}"][0] for i in range(n_layers)])
    return AttentionRows(
        probs,
        "llama.cpp kq_soft_max tensors via cb_eval, flash attention off"
        + (f", K cache {type_k}" if type_k != "f16" else ""),
        time.perf_counter() - started,
    )
