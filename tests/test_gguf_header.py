"""kvguard's fast GGUF header reader against the gguf package's own reader, on a file the
gguf package writes: every key, every tensor's place and bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.gguf_header import SkippedStrings, read_gguf_header


def write_gguf(path: Path, alignment: int | None = None, big_endian: bool = False) -> Path:
    from gguf import GGUFEndian, GGUFWriter

    endian = GGUFEndian.BIG if big_endian else GGUFEndian.LITTLE
    writer = GGUFWriter(str(path), "llama", endianess=endian)
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(4)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_head_count_kv([2, 2, 1, 1])  # a per-layer array, as some models have
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("test.flag", True)
    writer.add_int64("test.big", -(2**40))
    writer.add_token_list([f"tok{i}" for i in range(500)])
    writer.add_token_scores([float(i) / 3 for i in range(500)])
    writer.add_chat_template("{{ messages }}")
    writer.add_tensor("a.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    writer.add_tensor("b.weight", np.linspace(-1, 1, 64, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64], ids=["default-alignment", "alignment-64"])
def test_the_header_is_what_the_gguf_package_reads(tmp_path: Path, alignment: int | None) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = write_gguf(tmp_path / "t.gguf", alignment)
    header = read_gguf_header(path)
    reader = GGUFReader(str(path))
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(header.metadata) == set(fields)
    for key, field in fields.items():
        mine, theirs = header.metadata[key], field.contents()
        if isinstance(mine, SkippedStrings):
            assert mine.count == len(theirs) == 500, key
        elif key == "test.nested":  # gguf flattens an array of arrays; kvguard keeps its shape
            assert [item for inner in mine for item in inner] == theirs
        else:
            assert mine == pytest.approx(theirs), key
    assert header.field("llama.attention.head_count_kv") == [2, 2, 1, 1]
    assert header.field("test.big") == -(2**40) and header.field("test.flag") is True
    assert header.field("no.such.key") is None
    assert header.field("test.nested") == [[1, 2], [3]]
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert mine.shape == tuple(int(n) for n in theirs.shape)
        assert mine.offset == theirs.data_offset
        values = dequantize(header.tensor_bytes(mine), theirs.tensor_type)
        assert np.array_equal(values.reshape(-1), dequantize(theirs.data, theirs.tensor_type)
                              .reshape(-1))  # fmt: skip


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"not a gguf at all", "not the GGUF magic"),
        (b"GGUF\x01\x00\x00\x00", "GGUF version 1 (kvguard reads versions 2 and 3)"),
        (b"GGUF\x03\x00\x00\x00\x01", "the header runs past the end of the file"),
    ],
    ids=["magic", "version", "truncated"],
)
def test_a_file_that_is_not_gguf_is_one_line(tmp_path: Path, content: bytes, why: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(KvguardError) as refused:
        read_gguf_header(bad)
    assert "bad.gguf is not a readable GGUF file: " in str(refused.value)
    assert why in str(refused.value)


def test_a_big_endian_file_is_named_as_such(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "be.gguf", big_endian=True)
    with pytest.raises(KvguardError, match="a big-endian GGUF file"):
        read_gguf_header(path)


def test_tensor_data_past_the_end_is_refused(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "t.gguf").read_bytes()
    cut = tmp_path / "short.gguf"
    cut.write_bytes(whole[:-8])  # the last tensor loses its last bytes
    with pytest.raises(KvguardError, match="tensor b.weight's data runs past the end"):
        read_gguf_header(cut)


def test_a_truncated_copy_of_a_real_header_is_refused(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "t.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:200])  # inside the token list
    with pytest.raises(KvguardError, match="cut.gguf is not a readable GGUF file"):
        read_gguf_header(cut)


def test_one_string_of_a_skipped_array_is_read_alone(tmp_path: Path) -> None:
    header = read_gguf_header(write_gguf(tmp_path / "t.gguf"))
    assert header.string_at("tokenizer.ggml.tokens", 0) == "tok0"
    assert header.string_at("tokenizer.ggml.tokens", 321) == "tok321"
    assert header.string_at("tokenizer.ggml.tokens", 499) == "tok499"
    assert header.string_at("tokenizer.ggml.tokens", 500) is None
    assert header.string_at("llama.block_count", 0) is None  # not a string array
