from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.models import ModelRef, env_var_for, parse_model, read_arch


def test_arch_from_gguf_metadata(tiny_gguf: Path) -> None:
    arch = read_arch(tiny_gguf)
    assert (arch.n_layers, arch.n_kv_heads, arch.head_dim_k, arch.context_length) == (
        4,
        2,
        32,
        2048,
    )
    assert arch.sliding_window is None and not any(arch.swa_layers)
    assert arch.kv_bytes_per_token() == 4 * 2 * 2 * 32 * 2  # layers x K,V x heads x dim x f16


def test_unknown_name_lists_the_bundled_models(tmp_path: Path) -> None:
    with pytest.raises(KvguardError, match="use one of smollm2-135m, gemma3-270m"):
        parse_model("mistral", tmp_path)


def test_relative_path_is_taken_from_the_budgets_file_folder(tiny_gguf: Path) -> None:
    assert parse_model("tiny.gguf", tiny_gguf.parent).path == tiny_gguf


def test_env_var_points_a_bundled_name_elsewhere(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env_var_for("smollm2-135m"), str(tiny_gguf))
    assert env_var_for("smollm2-135m") == "KVGUARD_MODEL_SMOLLM2_135M"
    assert ModelRef("smollm2-135m").resolve() == tiny_gguf


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(KvguardError, match="not a readable GGUF"):
        read_arch(bad)


def test_model_folder_and_hub_id_forms(tmp_path: Path) -> None:
    (tmp_path / "my-mlx-model").mkdir()
    folder = parse_model("my-mlx-model", tmp_path)
    assert (folder.form, folder.path) == ("folder", tmp_path / "my-mlx-model")
    hub = parse_model("mlx-community/SmolLM2-135M-Instruct", tmp_path)
    assert hub.form == "hub" and str(hub.resolve()) == "mlx-community/SmolLM2-135M-Instruct"


def test_llama_cpp_refuses_a_model_folder(tmp_path: Path) -> None:
    from pytest_kvguard.gate.budgets_file import load_budgets_file

    (tmp_path / "folder").mkdir()
    budgets = tmp_path / "b.yaml"
    budgets.write_text(
        "version: 1\nchecks:\n  - name: a\n    engine: llama_cpp\n    model: folder\n"
        "    policy: sink\n    params: {cap: 64, tokens: 400}\n    budgets: {max_kv_entries: 64}\n"
    )
    with pytest.raises(
        KvguardError, match="b.yaml:5: engine 'llama_cpp' cannot load a model folder"
    ):
        load_budgets_file(budgets)
