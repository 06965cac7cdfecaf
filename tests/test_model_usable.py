"""A model that is not usable is one line at parse time, naming the check's line and the file.

GGUF headers are made here; llama.cpp's own refusal of an architecture is asked of the
installed llama-cpp-python (a vocabulary-only load, no weights).
"""

from __future__ import annotations

import pytest
from test_model_facts import write_model

pytestmark = pytest.mark.usefixtures("fake_engine")

CHECK = """\
version: 1
checks:
  - name: the-check
    engine: {engine}
    model: {model}
    policy: sink
    params: {{tokens: 300, cap: 64, sinks: 4}}
    budgets: {{max_kv_entries: 64}}
"""


def usage_error(pytester: pytest.Pytester, engine: str, model: str) -> str:
    pytester.makefile(".yaml", budgets=CHECK.format(engine=engine, model=model))
    result = pytester.runpytest("--kvguard", "budgets.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    assert "Traceback" not in result.stderr.str()
    (line,) = [line for line in result.stderr.lines if line.startswith("ERROR:")]
    return line


def test_a_file_with_another_magic(pytester: pytest.Pytester) -> None:
    (pytester.path / "model.gguf").write_bytes(b"\x89PNG\r\n\x1a\n not a model")
    line = usage_error(pytester, "fake", "model.gguf")
    assert line.startswith("ERROR: budgets.yaml:3: model ")
    assert (
        "model.gguf is not a readable GGUF file: it starts with b'\\x89PNG', not the GGUF " in line
    )


def test_a_truncated_file(pytester: pytest.Pytester) -> None:
    whole = write_model(pytester.path / "whole.gguf").read_bytes()
    (pytester.path / "cut.gguf").write_bytes(whole[:-16])
    line = usage_error(pytester, "fake", "cut.gguf")
    assert (
        "cut.gguf is not a readable GGUF file: tensor token_embd.weight's data runs past " in line
    )


@pytest.mark.mlx  # the parser asks for mlx-lm installed before it reads the model
def test_a_folder_without_a_tokenizer(pytester: pytest.Pytester) -> None:
    folder = pytester.path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    line = usage_error(pytester, "mlx", "converted")
    assert line.startswith("ERROR: budgets.yaml:3: model ")
    assert (
        "converted: the model folder has neither tokenizer_config.json nor tokenizer.json" in line
    )


@pytest.mark.mlx  # the parser asks for mlx-lm installed before it reads the model
def test_an_architecture_the_mlx_adapter_does_not_map(pytester: pytest.Pytester) -> None:
    write_model(pytester.path / "qwen.gguf", arch="qwen2")
    line = usage_error(pytester, "mlx", "qwen.gguf")
    assert (
        "qwen.gguf: engine mlx cannot load GGUF architecture 'qwen2' (it loads llama, gemma3)"
        in line
    )


@pytest.mark.llama_cpp  # llama.cpp itself is asked
def test_an_architecture_llama_cpp_does_not_know(pytester: pytest.Pytester) -> None:
    write_model(pytester.path / "foo.gguf", arch="foo")
    line = usage_error(pytester, "llama_cpp", "foo.gguf")
    assert line.startswith("ERROR: budgets.yaml:3: model ")
    assert "foo.gguf: llama-cpp-python 0." in line
    assert (
        "cannot load it: unknown model architecture: 'foo' (fix: upgrade llama-cpp-python" in line
    )


@pytest.mark.llama_cpp  # llama.cpp itself is asked
def test_a_known_architecture_is_not_refused_for_its_missing_vocabulary(
    pytester: pytest.Pytester,
) -> None:
    # A file llama.cpp refuses for another reason is left to the run, which says so itself.
    write_model(pytester.path / "qwen.gguf", arch="qwen2")
    pytester.makefile(".yaml", budgets=CHECK.format(engine="llama_cpp", model="qwen.gguf"))
    result = pytester.runpytest("--kvguard", "budgets.yaml", "--collect-only")
    assert result.ret == pytest.ExitCode.OK
