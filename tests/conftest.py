from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


def write_tiny_gguf(path: Path) -> Path:
    """A real GGUF file with Llama metadata and no tensors: enough for read_arch and sha256."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(4)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_embedding_length(256)
    writer.add_context_length(2048)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")
