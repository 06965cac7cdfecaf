"""The model facts diff on GGUF files and model folders made here, on the bundled models' real
metadata, and kvguard-model-facts' output and exit codes (no weights loaded, no engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_kvguard.cli.model_facts import main
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.model_facts import (
    IDENTICAL,
    diff_facts,
    diff_lines,
    read_model_facts,
)

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"


def write_model(path: Path, arch: str = "llama", **changes: Any) -> Path:
    """A small GGUF model header (eight tokens, one tiny tensor) with ``changes`` applied."""
    from gguf import GGUFWriter

    facts: dict[str, Any] = {
        "layers": 6, "heads": 4, "kv_heads": 2, "embedding": 64, "context": 2048,
        "rope_base": 10000.0, "file_type": 7, "add_bos": True, "bos": 1, "eos": 2,
        "template": TEMPLATE, "window": None, "pattern": None, "rope_scaling": None,
        "key_length": None,
    } | changes  # fmt: skip
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(facts["layers"])
    writer.add_head_count(facts["heads"])
    writer.add_head_count_kv(facts["kv_heads"])
    writer.add_embedding_length(facts["embedding"])
    writer.add_context_length(facts["context"])
    writer.add_rope_freq_base(facts["rope_base"])
    writer.add_file_type(facts["file_type"])
    writer.add_token_list(["<unk>", "<s>", "</s>", "<|im_start|>", "a", "b", "c", "d"])
    writer.add_add_bos_token(facts["add_bos"])
    writer.add_bos_token_id(facts["bos"])
    writer.add_eos_token_id(facts["eos"])
    if facts["template"] is not None:
        writer.add_chat_template(facts["template"])
    if facts["window"] is not None:
        writer.add_sliding_window(facts["window"])
    if facts["pattern"] is not None:
        writer.add_sliding_window_pattern(facts["pattern"])
    if facts["rope_scaling"] is not None:
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType(facts["rope_scaling"][0]))
        writer.add_rope_scaling_factor(facts["rope_scaling"][1])
    if facts["key_length"] is not None:  # keys wider than values (as DeepSeek's MLA has)
        writer.add_key_length(facts["key_length"])
        writer.add_value_length(16)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_files_facts(tmp_path: Path) -> None:
    facts = read_model_facts(write_model(tmp_path / "m.gguf"))
    assert (facts.architecture, facts.layers, facts.attention_heads, facts.kv_heads) == (
        "llama", 6, 4, 2,
    )  # fmt: skip
    assert facts.head_size == 16  # embedding 64 / 4 heads, no key_length
    assert (facts.adds_bos, facts.adds_eos, facts.bos_id, facts.bos_text) == (True, None, 1, "<s>")
    assert (facts.eos_id, facts.eos_text) == ("2", "</s>")
    assert facts.weight_type == "Q8_0"  # general.file_type 7
    assert (facts.sliding_window, facts.sliding_layers) == ("none", "none")
    assert facts.chat_template is not None and len(facts.chat_template) == 12
    assert facts.rope_base == 10000.0 and facts.context_length == 2048
    assert facts.sha256 is not None and len(facts.sha256) == 64


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"add_bos": False}, "tokenizer adds BOS: true -> false"),
        ({"bos": 3}, "BOS id: 1 -> 3"),
        ({"kv_heads": 1}, "KV heads: 2 -> 1"),
        ({"heads": 8}, "attention heads: 4 -> 8"),
        ({"template": None}, "chat template sha256: {template} -> none"),
        ({"file_type": 1}, "weight type: Q8_0 -> F16"),
        ({"rope_base": 500000.0}, "rope base: 10000 -> 500000"),
        ({"rope_scaling": ("yarn", 4.0)}, "rope scaling: none -> yarn x4"),
        ({"key_length": 24}, "head size: 16 -> k 24 / v 16"),
        ({"context": 8192}, "context length: 2048 -> 8192"),
    ],
    ids=[
        "add-bos",
        "bos-id",
        "kv-heads",
        "heads",
        "template",
        "weight-type",
        "rope-base",
        "rope-scaling",
        "head-size",
        "context",
    ],  # fmt: skip
)
def test_each_difference_is_one_line(tmp_path: Path, change: dict[str, Any], line: str) -> None:
    before = read_model_facts(write_model(tmp_path / "before.gguf"))
    after = read_model_facts(write_model(tmp_path / "after.gguf", **change))
    lines = diff_lines(diff_facts(before, after))
    assert lines[0] == line.format(template=before.chat_template)
    if "bos" in change:
        assert "BOS text: <s> -> <|im_start|>" in lines
    if "heads" in change:  # the head size follows: 64 / 8
        assert "head size: 16 -> 8" in lines
    # Beyond the changed fact (and what follows from it) only the file's hash differs.
    assert lines[-1].startswith("sha256: ") and len(lines) <= 3


def test_the_sliding_layer_pattern(tmp_path: Path) -> None:
    full = read_model_facts(write_model(tmp_path / "full.gguf", "gemma3", layers=12))
    # No pattern key: llama.cpp's own Gemma 3 pattern, every 6th layer global.
    gemma = read_model_facts(write_model(tmp_path / "g.gguf", "gemma3", layers=12, window=512))
    assert gemma.sliding_layers == "10 of 12 (full: 5, 11)"
    # An explicit pattern key wins: every 2nd layer global; then one flag per layer.
    every2 = write_model(tmp_path / "p.gguf", "gemma3", layers=4, window=128, pattern=2)
    flags = write_model(tmp_path / "f.gguf", "llama", layers=3, window=64,
                        pattern=[True, False, True])  # fmt: skip
    assert read_model_facts(every2).sliding_layers == "2 of 4 (full: 1, 3)"
    assert read_model_facts(flags).sliding_layers == "2 of 3 (full: 1)"
    lines = diff_lines(diff_facts(full, gemma))
    assert lines[:2] == [
        "sliding window: none -> 512",
        "sliding layers: none -> 10 of 12 (full: 5, 11)",
    ]
    # A GGUF without a template says so (each engine falls back to another one).
    assert read_model_facts(write_model(tmp_path / "t.gguf", "gemma3", template=None)
                            ).chat_template == "none"  # fmt: skip


def test_identical_models_say_so(tmp_path: Path) -> None:
    one = read_model_facts(write_model(tmp_path / "one.gguf"))
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(one.path.read_bytes())
    assert diff_facts(one, read_model_facts(copy)) == []
    assert diff_lines([]) == [IDENTICAL] == ["no cache-relevant fact differs"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"PK\x03\x04 a zip, not a model", "not the GGUF magic"),
        (None, "the header runs past the end of the file (truncated?)"),
    ],
    ids=["wrong-magic", "truncated"],
)
def test_a_file_that_is_no_model_is_one_line(
    tmp_path: Path, content: bytes | None, why: str
) -> None:
    bad = tmp_path / "bad.gguf"
    whole = write_model(tmp_path / "whole.gguf").read_bytes()
    bad.write_bytes(content if content is not None else whole[:120])
    with pytest.raises(KvguardError) as refused:
        read_model_facts(bad)
    message = str(refused.value)
    assert f"{bad} is not a readable GGUF file" in message and why in message
    assert "(fix: " in message and "\n" not in message


def test_a_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(KvguardError, match=r"missing: no such file or folder \(fix: give a"):
        read_model_facts(tmp_path / "missing")


def write_folder(folder: Path, config: dict[str, Any], tokenizer: dict[str, Any] | None) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (folder / "model.safetensors").write_bytes(b"not real weights")
    return folder


MLX_CONFIG = {
    "model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640, "sliding_window": 512,
    "sliding_window_pattern": 6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "quantization": {"group_size": 64, "bits": 4}, "bos_token_id": 2, "eos_token_id": [1, 106],
}  # fmt: skip
MLX_TOKENIZER = {
    "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>",
    "eos_token": {"content": "<eos>"}, "chat_template": "{{ bos_token }}{{ messages }}",
    "added_tokens_decoder": {"2": {"content": "<bos>"}, "1": {"content": "<eos>"}},
}  # fmt: skip


def test_an_mlx_folders_facts(tmp_path: Path) -> None:
    facts = read_model_facts(write_folder(tmp_path / "mlx", MLX_CONFIG, MLX_TOKENIZER))
    assert (facts.architecture, facts.layers, facts.kv_heads, facts.head_size) == (
        "gemma3_text", 6, 1, 256,
    )  # fmt: skip
    assert (facts.adds_bos, facts.adds_eos, facts.bos_id, facts.bos_text) == (
        True,
        False,
        2,
        "<bos>",
    )
    # The EOS text's own id (tokenizer_config maps <eos> to 1), not config.json's list.
    assert (facts.eos_id, facts.eos_text) == ("1", "<eos>")
    assert (facts.sliding_window, facts.sliding_layers) == (512, "5 of 6 (full: 5)")
    assert (facts.rope_base, facts.rope_scaling, facts.context_length) == (1e6, "linear x8", 32768)
    assert facts.weight_type == "4-bit, group 64"
    assert facts.sha256_of == "1 weight file (model.safetensors)"
    assert facts.chat_template is not None and len(facts.chat_template) == 12


def test_a_folder_against_a_changed_conversion(tmp_path: Path) -> None:
    before = read_model_facts(write_folder(tmp_path / "a", MLX_CONFIG, MLX_TOKENIZER))
    config = MLX_CONFIG | {"quantization": None, "torch_dtype": "bfloat16", "sliding_window": 1024}
    after = read_model_facts(
        write_folder(tmp_path / "b", config, MLX_TOKENIZER | {"add_bos_token": False})
    )
    assert diff_lines(diff_facts(before, after)) == [
        "tokenizer adds BOS: true -> false",
        "sliding window: 512 -> 1024",
        "weight type: 4-bit, group 64 -> bf16",
    ]  # the weight files are the same bytes, so the hash is too


def test_tokenizer_json_alone_gives_bos_through_its_post_processor(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path / "llama3", {"model_type": "llama", "num_hidden_layers": 2}, None
    )
    (folder / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": 128000, "content": "<|begin_of_text|>"}],
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel"},
            {"type": "TemplateProcessing", "single": [
                {"SpecialToken": {"id": "<|begin_of_text|>"}}, {"Sequence": {"id": "A"}}]},
        ]},
    }))  # fmt: skip
    facts = read_model_facts(folder)
    assert facts.adds_bos is True and facts.bos_text is None and facts.kv_heads is None


@pytest.mark.parametrize(
    ("config", "tokenizer", "why"),
    [
        (None, MLX_TOKENIZER, "mlx: no config.json in the model folder (fix: give the folder"),
        (
            MLX_CONFIG,
            None,
            "mlx: the model folder has neither tokenizer_config.json nor tokenizer.json",
        ),
    ],
    ids=["no-config", "no-tokenizer"],
)
def test_an_incomplete_folder_is_one_line(
    tmp_path: Path, config: dict[str, Any] | None, tokenizer: dict[str, Any] | None, why: str
) -> None:
    folder = write_folder(tmp_path / "mlx", config or {}, tokenizer)
    if config is None:
        (folder / "config.json").unlink()
    with pytest.raises(KvguardError) as refused:
        read_model_facts(folder)
    assert why in str(refused.value) and "(fix: " in str(refused.value)


def test_the_bundled_models_real_facts() -> None:
    from pytest_kvguard.cli.model_facts import model_path

    smol = read_model_facts(model_path("smollm2-135m"))
    gemma = read_model_facts(model_path("gemma3-270m"))
    # DOMAIN.md: SmolLM2-135M 30 layers, 3 KV heads, head_dim 64; Gemma-3-270M 18 layers,
    # 1 KV head, head_dim 256, window 512 on 5 of every 6 layers.
    assert (smol.layers, smol.attention_heads, smol.kv_heads, smol.head_size) == (30, 9, 3, 64)
    assert (smol.adds_bos, smol.bos_text, smol.eos_text) == (False, "<|im_start|>", "<|im_end|>")
    assert (smol.weight_type, smol.sliding_window, smol.context_length) == ("Q4_1", "none", 8192)
    assert (gemma.layers, gemma.attention_heads, gemma.kv_heads, gemma.head_size) == (18, 4, 1, 256)
    assert (gemma.adds_bos, gemma.bos_id, gemma.bos_text) == (True, 2, "<bos>")
    assert (gemma.sliding_window, gemma.sliding_layers) == (512, "15 of 18 (full: 5, 11, 17)")
    assert (gemma.weight_type, gemma.rope_base) == ("Q4_K_M", 1e6)


def test_command_line_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before, after = write_model(tmp_path / "a.gguf"), write_model(tmp_path / "b.gguf", kv_heads=1)
    assert main([str(before), str(after)]) == 0
    out = capsys.readouterr().out
    table, diff = out.split("\n\n")
    assert table.splitlines()[0].split() == ["fact", str(before), str(after)]
    assert any(row.split() == ["KV", "heads", "2", "1"] for row in table.splitlines())
    assert diff.splitlines()[0] == "KV heads: 2 -> 1"
    assert main([str(before), str(before), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["differences"] == [] and report["model"]["kv_heads"] == 2
    assert main([str(before)]) == 0
    assert "no cache-relevant" not in capsys.readouterr().out  # one model: no diff


@pytest.mark.llama_cpp
def test_files_llama_cpp_cannot_tokenize_leave_the_chat_out_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = write_model(tmp_path / "a.gguf"), write_model(tmp_path / "b.gguf", kv_heads=1)
    assert main([str(before), str(after)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("tutor chat, first 200 tokens of the chat call: not compared")


def test_a_llama_cpp_that_does_not_load_is_said_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    from pytest_kvguard.cli.model_facts import chat_token_line

    def broken(name: str) -> None:
        raise RuntimeError("Failed to load shared library 'libllama.so'")

    vocab = types.ModuleType("pytest_kvguard.engines.gguf_vocab")
    vocab.__getattr__ = broken  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "pytest_kvguard.engines.gguf_vocab", vocab)
    a = read_model_facts(write_model(tmp_path / "a.gguf"))
    line = chat_token_line(a, a)
    assert line is not None and "not compared (llama-cpp-python does not load: " in line


@pytest.mark.parametrize("bad", ["missing.gguf", "not-a-model.txt", "org/model"])
def test_command_line_bad_input_is_one_line_and_exit_2(tmp_path: Path, bad: str) -> None:
    (tmp_path / "not-a-model.txt").write_text("hello")
    done = subprocess.run(
        [sys.executable, "-m", "pytest_kvguard.cli.model_facts", bad],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: ")
    assert bad in done.stderr and "(fix: " in done.stderr


@pytest.mark.llama_cpp
def test_the_bundled_chat_rendered_by_each_bundled_model() -> None:
    from pytest_kvguard.cli.model_facts import chat_token_line, model_path

    smol = read_model_facts(model_path("smollm2-135m"))
    gemma = read_model_facts(model_path("gemma3-270m"))
    label = "tutor chat, first 200 tokens of the chat call"
    assert chat_token_line(smol, smol) == f"{label}: the same"
    # The Gemma 3 base GGUF carries no chat template: there is no one chat to compare.
    line = chat_token_line(smol, gemma, 50)
    assert line == ("tutor chat, first 50 tokens of the chat call: not compared "
                    "(gemma-3-270m-q4_k_m.gguf carries no chat template)")  # fmt: skip
    assert chat_token_line(smol, gemma, 0) is None


def test_files_of_an_unexpected_shape_are_facts_unknown_or_one_line(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    odd = {"text_config": "oops", "rope_scaling": [8], "num_hidden_layers": "six"}
    folder = write_folder(tmp_path / "odd", odd, {"added_tokens_decoder": [], "chat_template": 5})
    facts = read_model_facts(folder)
    assert (facts.layers, facts.rope_scaling, facts.chat_template) == (None, "none", "none")
    writer = GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    writer.add_string("llama.block_count", "six")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(KvguardError, match=r"odd.gguf: GGUF metadata llama.block_count is 'six'"):
        read_model_facts(tmp_path / "odd.gguf")


def test_pattern_0_slides_every_layer_and_a_negative_one_is_one_line(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    # llama.cpp: a period of 0 means every layer slides (no global layer).
    zero = read_model_facts(write_model(tmp_path / "z.gguf", "gemma3", layers=4, window=64,
                                        pattern=0))  # fmt: skip
    assert (zero.sliding_window, zero.sliding_layers) == (64, "4 of 4")
    writer = GGUFWriter(str(tmp_path / "neg.gguf"), "gemma3")
    writer.add_block_count(4)
    writer.add_head_count(4)
    writer.add_embedding_length(64)
    writer.add_sliding_window(64)
    writer.add_int32("gemma3.attention.sliding_window_pattern", -2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(KvguardError, match=r"neg.gguf: GGUF metadata gemma3.attention.slid"
                       r"ing_window_pattern is -2, not a layer period") as raised:  # fmt: skip
        read_model_facts(tmp_path / "neg.gguf")
    assert "\n" not in str(raised.value)


def test_a_token_that_is_not_utf8_is_one_line_naming_the_file(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "bytes.gguf"), "llama")
    writer.add_block_count(2)
    writer.add_head_count(2)
    writer.add_embedding_length(32)
    writer.add_token_list([b"<unk>", b"\xff\xfe", b"</s>"])
    writer.add_bos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(
        KvguardError, match=r"bytes.gguf: .*tokenizer.ggml.tokens\[1\] is not UTF-8"
    ):
        read_model_facts(tmp_path / "bytes.gguf")


def test_gguf_facts_and_read_arch_read_one_sliding_pattern(tmp_path: Path) -> None:
    from pytest_kvguard.inputs.models import read_arch

    for arch, layers, full in [("gemma3", 12, [5, 11]), ("gemma2", 4, [1, 3]),
                               ("cohere2", 8, [3, 7])]:  # fmt: skip
        path = write_model(tmp_path / f"{arch}.gguf", arch, layers=layers, window=128)
        swa = read_arch(path).swa_layers
        assert [i for i, slides in enumerate(swa) if not slides] == full
        assert read_model_facts(path).sliding_layers == (
            f"{layers - len(full)} of {layers} (full: {', '.join(map(str, full))})"
        )
    # The file's own pattern key wins over the architecture's period, in both.
    keyed = write_model(tmp_path / "keyed.gguf", "gemma3", layers=4, window=128, pattern=2)
    assert read_arch(keyed).swa_layers == (True, False, True, False)
    assert read_model_facts(keyed).sliding_layers == "2 of 4 (full: 1, 3)"
    # A pattern of 1: every layer global, so no window either.
    ones = write_model(tmp_path / "ones.gguf", "gemma3", layers=4, window=128, pattern=1)
    assert (read_arch(ones).sliding_window, read_arch(ones).swa_layers) == (None, (False,) * 4)
    facts = read_model_facts(ones)
    assert (facts.sliding_window, facts.sliding_layers) == ("none", "none")


def test_the_bundled_models_read_arch_is_unchanged() -> None:
    """read_arch drives the gate's memory predictions: the bundled models' layouts."""
    from pytest_kvguard.cli.model_facts import model_path
    from pytest_kvguard.inputs.models import read_arch

    smol, gemma = read_arch(model_path("smollm2-135m")), read_arch(model_path("gemma3-270m"))
    assert (smol.sliding_window, smol.swa_layers) == (None, (False,) * 30)
    assert gemma.sliding_window == 512 and len(gemma.swa_layers) == 18
    assert [i for i, slides in enumerate(gemma.swa_layers) if not slides] == [5, 11, 17]


BASE = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64}


@pytest.mark.parametrize(
    ("config", "window", "layers"),
    [
        # layer_types wins, whatever the rest says.
        ({"model_type": "qwen2", "sliding_window": 64, "layer_types": ["full_attention",
          "sliding_attention", "sliding_attention", "full_attention"]}, 64, "2 of 4 (full: 0, 3)"),
        # Qwen2: use_sliding_window false (or left out) slides nothing; true, from
        # max_window_layers on.
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False,
          "max_window_layers": 2}, "none", "none"),
        ({"model_type": "qwen2", "sliding_window": 64, "max_window_layers": 2}, "none", "none"),
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
          "max_window_layers": 2}, 64, "2 of 4 (full: 0, 1)"),
        # transformers' periods where the config names none.
        ({"model_type": "gemma2", "sliding_window": 64}, 64, "2 of 4 (full: 1, 3)"),
        ({"model_type": "cohere2", "sliding_window": 64}, 64, "3 of 4 (full: 3)"),
        ({"model_type": "gemma3_text", "sliding_window": 64}, 64, "4 of 4"),
        ({"model_type": "mistral", "sliding_window": 64}, 64, "4 of 4"),
        # A window and nothing that says which layers slide: unknown, not "all".
        ({"model_type": "llama", "sliding_window": 64}, 64, "unknown"),
        # Layers that slide with no window given: the window unknown, not "none".
        ({"model_type": "llama", "layer_types": ["sliding_attention", "full_attention"]},
         None, "1 of 2 (full: 1)"),
    ],
)  # fmt: skip
def test_which_folder_layers_slide(
    tmp_path: Path, config: dict[str, Any], window: Any, layers: str
) -> None:
    facts = read_model_facts(write_folder(tmp_path / "m", BASE | config, MLX_TOKENIZER))
    assert (facts.sliding_window, facts.sliding_layers) == (window, layers)


def test_a_gemma3_multimodal_folder_takes_gemma3_text_defaults(tmp_path: Path) -> None:
    # google/gemma-3-4b-it's config.json: text_config lists only what differs from
    # transformers' Gemma3TextConfig (8 heads, 4 KV heads, head_dim 256, every 6th layer
    # global, rope_theta 1e6).
    config = {"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "num_hidden_layers": 34, "sliding_window": 1024,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}}  # fmt: skip
    facts = read_model_facts(write_folder(tmp_path / "g", config, MLX_TOKENIZER))
    assert (facts.architecture, facts.attention_heads, facts.kv_heads, facts.head_size) == (
        "gemma3_text", 8, 4, 256,
    )  # fmt: skip
    assert (facts.sliding_window, facts.rope_base) == (1024, 1e6)
    assert facts.sliding_layers == "29 of 34 (full: 5, 11, 17, 23, 29)"
    # transformers is a test dependency (the test extra), so this comparison always runs.
    from transformers import Gemma3TextConfig  # the defaults kvguard copied, still these

    defaults = Gemma3TextConfig()
    assert (defaults.num_attention_heads, defaults.num_key_value_heads, defaults.head_dim) == (
        8, 4, 256,
    )  # fmt: skip


def test_the_eos_id_is_the_eos_texts_own(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", BASE | {"eos_token_id": 106}, MLX_TOKENIZER)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [106, 1]}))
    facts = read_model_facts(folder)
    assert (facts.eos_id, facts.eos_text) == ("1", "<eos>")
