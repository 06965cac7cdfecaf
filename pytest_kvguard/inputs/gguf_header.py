"""A GGUF file's metadata and tensor index, read fast.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every element of every array in
the header: opening the bundled Gemma 3 GGUF (262,144 tokenizer strings) took 8.0 s of its
14 s under cProfile here, and kvguard opened it in every process that read the architecture,
loaded the model into mlx or started llama-server. This reads the same header with ``struct``
and ``numpy.frombuffer``, stepping over string arrays (the tokenizer's vocabulary) without
decoding them, in a fraction of a second. Tensor data stays on disk: ``tensor_bytes`` is a
memory-mapped view that ``gguf.quants.dequantize`` takes as it is.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.paths import cached_per_file

MAGIC = b"GGUF"
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip
"""GGUF value types with a fixed size, as struct formats (8 is a string, 9 an array)."""
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class SkippedStrings:
    """A string array whose contents were not decoded (a tokenizer's vocabulary)."""

    count: int
    offset: int = 0
    """Byte offset of its first string in the file, for ``GgufHeader.string_at``."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """Dimensions as GGUF lists them: innermost first."""
    ggml_type: int
    offset: int
    """Byte offset of the data from the start of the file."""


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    """Every key: scalars and strings as Python values, numeric arrays as lists, string
    arrays as ``SkippedStrings``."""
    tensors: tuple[TensorInfo, ...]

    def field(self, key: str) -> Any:
        """The value of ``key``, or None where the file lacks it."""
        return self.metadata.get(key)

    def string_at(self, key: str, index: int) -> str | None:
        """String ``index`` of the skipped string array ``key`` (one token's text), decoded
        alone; None where the key is no string array or the index is out of range."""
        strings = self.field(key)
        if not isinstance(strings, SkippedStrings) or not 0 <= index < strings.count:
            return None
        with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cursor = _Cursor(buf)
            cursor.at = strings.offset
            for _ in range(index):
                cursor.skip(cursor.unpack("<Q"))
            try:
                return cursor.string()
            except UnicodeDecodeError as exc:
                raise KvguardError(
                    f"GGUF metadata {key}[{index}] is not UTF-8 text ({exc.reason})",
                    path=self.path,
                    fix="re-export the model with llama.cpp's convert_hf_to_gguf.py",
                ) from None

    def tensor_bytes(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes, memory-mapped (flat uint8)."""
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        return data[tensor.offset : tensor.offset + _data_bytes(tensor)]


TRUNCATED = "the header runs past the end of the file (truncated?)"


class _Cursor:
    """Little-endian reads from a buffer, advancing an offset."""

    def __init__(self, buffer: Any) -> None:
        self.buffer, self.at = buffer, 0

    def unpack(self, fmt: str) -> Any:
        self.skip(struct.calcsize(fmt))
        (value,) = struct.unpack_from(fmt, self.buffer, self.at - struct.calcsize(fmt))
        return value

    def skip(self, length: int) -> None:
        self.at += length
        if self.at > len(self.buffer):
            raise ValueError(TRUNCATED)

    def string(self) -> str:
        length = self.unpack("<Q")
        start = self.at
        self.skip(length)
        return bytes(self.buffer[start : self.at]).decode("utf-8")

    def value(self, kind: int, key: str, depth: int = 0) -> Any:
        if kind == STRING:
            return self.string()
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind != ARRAY:
            raise ValueError(f"key {key} has unknown value type {kind}")
        if depth > 4:
            raise ValueError(f"key {key} nests arrays more than 4 deep")
        item_kind, count = self.unpack("<I"), self.unpack("<Q")
        if item_kind == STRING:
            length, start = struct.Struct("<Q"), self.at
            for _ in range(count):  # step over each length-prefixed string (bounds first)
                self.skip(8)
                self.skip(length.unpack_from(self.buffer, self.at - 8)[0])
            return SkippedStrings(count, start)
        if item_kind == ARRAY:
            return [self.value(ARRAY, key, depth + 1) for _ in range(count)]
        if item_kind not in SCALARS:
            raise ValueError(f"key {key} is an array of unknown value type {item_kind}")
        dtype = np.dtype(SCALARS[item_kind])
        start = self.at
        self.skip(count * dtype.itemsize)
        return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=start).tolist()


@cached_per_file
def read_gguf_header(path: Path) -> GgufHeader:
    """The header of a GGUF file (version 2 or 3), or a one-line error naming what is wrong."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _parse(path, buffer)
    except (OSError, ValueError, struct.error, KeyError, IndexError, OverflowError) as exc:
        raise KvguardError(
            f"{path} is not a readable GGUF file: {exc}", fix="check the file or re-download it"
        ) from None


def _parse(path: Path, buffer: Any) -> GgufHeader:
    cursor = _Cursor(buffer)
    if bytes(buffer[:4]) != MAGIC:
        raise ValueError(f"it starts with {bytes(buffer[:4])!r}, not the GGUF magic")
    cursor.at = 4
    version = cursor.unpack("<I")
    if version in (2 << 24, 3 << 24):
        raise ValueError("a big-endian GGUF file (kvguard reads little-endian ones)")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (kvguard reads versions 2 and 3)")
    n_tensors, n_keys = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_keys):
        key = cursor.string()
        if key in metadata:
            raise ValueError(f"key {key} appears twice")
        metadata[key] = cursor.value(cursor.unpack("<I"), key)
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}, not a positive integer")
    data_start = -(-cursor.at // alignment) * alignment
    tensors = tuple(TensorInfo(n, d, t, data_start + o) for n, d, t, o in infos)
    for tensor in tensors:
        if tensor.offset + _data_bytes(tensor) > len(buffer):
            raise ValueError(f"tensor {tensor.name}'s data runs past the end of the file")
    return GgufHeader(path, version, metadata, tensors)


def _data_bytes(tensor: TensorInfo) -> int:
    """The size of a tensor's data, from its ggml type's block size."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
    return int(np.prod(tensor.shape, dtype=np.int64)) // block * size
