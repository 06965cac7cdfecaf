"""llama.cpp's buffer sizes as its log prints them (in-process through its log callback, or
llama-server's stderr)."""

from __future__ import annotations

import re
from collections.abc import Sequence

_BUFFER_LINE = re.compile(r"(\S+) (model|KV|compute) buffer size =\s*([\d.]+) MiB")


def buffer_mib(log: Sequence[str]) -> dict[str, float]:
    """llama.cpp's own buffer sizes, in bytes, summed per kind over devices: model, KV, compute.

    llama.cpp prints them to two decimals of a MiB, so each is exact to +-5 KiB.
    """
    sizes = {"model": 0.0, "KV": 0.0, "compute": 0.0}
    for _device, kind, mib in _BUFFER_LINE.findall("".join(log)):
        sizes[kind] += float(mib) * 2**20
    return sizes
