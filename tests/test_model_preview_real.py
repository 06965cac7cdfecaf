"""The model preview on the real bundled SmolLM2 and a Q8_0 re-quantization of it made here
with llama.cpp's own quantizer (``kvguard-quantize``, a few seconds): the facts diff, then each
check on both files through the real llama.cpp engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_kvguard.cli.quantize import main as quantize

# Both tests run llama.cpp: its quantizer (kvguard-quantize), and the preview's checks.
pytestmark = pytest.mark.llama_cpp

CHECKS = """\
version: 1
defaults: {engine: llama_cpp, model: smollm2-135m}
checks:
  - name: sink4-stream
    policy: sink
    params: {tokens: 300, cap: 128, sinks: 4}
    budgets: {max_ppl_increase_pct: 40}
  - name: sink4-memory
    scenario: memory
    policy: sink
    params: {cap: 128, sinks: 4, lengths: [128, 192]}
    budgets: {bounded: true}
"""


@pytest.fixture(scope="module")
def q8_candidate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("candidate") / "smollm2-135m-Q8_0.gguf"
    assert quantize(["smollm2-135m", "Q8_0", str(path)]) == 0
    return path


def test_a_requantized_smollm2_previewed_through_llama_cpp(
    pytester: pytest.Pytester, q8_candidate: Path
) -> None:
    pytester.makefile(".yaml", budgets=CHECKS)
    result = pytester.runpytest_subprocess(
        "--kvguard", "budgets.yaml", f"--kvguard-against-model=smollm2-135m={q8_candidate}",
        "--kvguard-json", "report.json",
    )  # fmt: skip
    result.stdout.fnmatch_lines([
        f"kvguard model preview: checks on smollm2-135m also run on {q8_candidate}",
        "  weight type: Q4_1 -> Q8_0",
        "  sha256: b179c9523d0e6a0f -> *",
        "  tutor chat, first 200 tokens of the chat call: the same",
    ])  # fmt: skip
    report = json.loads((pytester.path / "report.json").read_text())
    (diff,) = report["model_preview"]
    # Only the weights changed: every other cache-relevant fact is the same.
    assert [d["fact"] for d in diff["differences"]] == ["weight type", "sha256"]
    rows = {row["name"]: row for row in report["checks"]}
    for row in rows.values():
        assert row["model_path"] == str(q8_candidate)
        assert row["against"]["model"] == "smollm2-135m"
        assert row["model_sha256"] != row["against"]["model_sha256"]
    memory = rows["sink4-memory"]
    # The KV cache is f16 whatever the weights: the same bytes on both files.
    assert memory["metrics"]["kv_bytes"] == memory["against"]["metrics"]["kv_bytes"] > 0
    stream = rows["sink4-stream"]
    # Q8_0 from Q4_1 holds nearly the same weights: other perplexities, by little.
    now, then = (
        stream["metrics"]["post_eviction_ppl"],
        stream["against"]["metrics"]["post_eviction_ppl"],
    )
    assert now != then and abs(now - then) / then < 0.02
    assert {row["verdict"] for row in rows.values()} == {"PASS"} and result.ret == 0


def test_quantize_bad_input_is_one_line_and_leaves_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_gguf = tmp_path / "not-a-model.gguf"
    not_gguf.write_bytes(b"GGUF but nothing after the magic")
    output = tmp_path / "out.gguf"
    assert quantize([str(not_gguf), "Q8_0", str(output)]) == 2
    assert "error: llama.cpp could not quantize" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [not_gguf]  # no out.gguf, no out.gguf.partial
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert quantize(["smollm2-135m", "Q8_0", str(blocked / "out.gguf")]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot create {blocked}: ")
    assert quantize(["smollm2-135m", "Q8_0", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path} is a folder (fix: ")
    assert quantize(["smollm2-135m", "Q9_9", str(output)]) == 2
    assert "unknown file type 'Q9_9' (fix: use one of: " in capsys.readouterr().err
