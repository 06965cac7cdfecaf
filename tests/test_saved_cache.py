"""kvguard-saved-cache: a cache saved by one engine release, read by another (mlx-lm prompt-cache
files; llama-cpp-python's pickled Llama states).

The engine tests write and read in this environment (one release both sides), as the command
runs them: the entry points in a subprocess with this pytest_kvguard on its path.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.cli.saved_cache import SAVED_ENGINES, Tolerance, judge, main, run_entry, table
from pytest_kvguard.inputs.models import ModelRef

TOLERANCE = Tolerance()
SHORT = ["--kind", "plain", "--messages", "3"]
"""The chat's first 3 messages, a few seconds to prefill."""
MLX = SAVED_ENGINES["mlx"].entry
LLAMA = SAVED_ENGINES["llama_cpp"].entry


def row(read: dict[str, Any]) -> dict[str, Any]:
    verdict, reason = judge(read, TOLERANCE)
    return {"writer": "0.1", "reader": "0.2", "kind": "plain", "model": "m.gguf", "read": read,
            "verdict": verdict, "reason": reason}  # fmt: skip


def test_verdicts_at_the_tolerance_edges() -> None:
    at = {"loads": True, "mean_abs_nll_diff": TOLERANCE.mean_abs_nll_diff, "max_abs_nll_diff": 0.0}
    assert judge(at, TOLERANCE) == ("PASS", "")
    over = {**at, "mean_abs_nll_diff": TOLERANCE.mean_abs_nll_diff * 1.01}
    assert judge(over, TOLERANCE)[0] == "FAIL"
    worst = {**at, "max_abs_nll_diff": TOLERANCE.max_abs_nll_diff * 1.01}
    assert judge(worst, TOLERANCE)[0] == "FAIL"
    assert judge({**at, "mean_abs_nll_diff": float("nan")}, TOLERANCE)[0] == "FAIL"


def test_each_failure_is_one_line_quoting_the_engine() -> None:
    cases = {
        "does not load: KeyError: ''": {"loads": False, "error": "KeyError: ''"},
        "loads, then fails on use: ValueError: x": {"loads": True, "replay_error": "ValueError: x"},
        "loads, misread: ids lost": {"loads": True, "metadata_error": "ids lost"},
        "reader failed: python exited": {"error": "python exited"},
    }  # fmt: skip
    for reason, read in cases.items():
        verdict, found = judge(read, TOLERANCE)
        assert verdict in ("FAIL", "ERROR") and found == reason
        lines = table([row(read)]).splitlines()
        assert len(lines) == 3 and reason in lines[2]


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nowhere" / "python")
    assert main(["--writer", missing, "--reader", sys.executable]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvguard-saved-cache: --writer") and "no Python interpreter" in err
    assert "\n" not in err
    with pytest.raises(SystemExit) as stopped:
        main(["--writer", sys.executable, "--reader", sys.executable, "--kind", "paged"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "invalid choice: 'paged'" in err
    assert main(["--writer", sys.executable, "--reader", sys.executable, "--engine",
                 "llama_cpp", "--kind", "plain"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err == ("kvguard-saved-cache: --kind plain is not a kind of --engine llama_cpp (its "
                   "kinds: full, swa, swa_full)")  # fmt: skip
    assert main(["--writer", sys.executable, "--reader", sys.executable, "--kind", "rotating",
                 "--cap", "4", "--sinks", "4"]) == 2  # fmt: skip
    assert capsys.readouterr().err.count("\n") == 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict[str, Any]]:
    """A plain cache of SmolLM2 saved by this environment's mlx-lm."""
    model = ModelRef("smollm2-135m").resolve()
    file = tmp_path_factory.mktemp("saved") / "plain.safetensors"
    base = ["--model", str(model), *SHORT]
    written = run_entry(sys.executable, MLX, ["write", *base, "--out", str(file)], 300)
    assert "error" not in written, written["error"]
    return file, base, written


@pytest.mark.mlx
def test_a_release_reads_its_own_file_back_exactly(
    saved: tuple[Path, list[str], dict[str, Any]],
) -> None:
    file, base, written = saved
    # The first request's ids up to where the appended turn parts from it (its generation
    # prompt): what an app's cache of it can give the next request.
    assert written["tokens"] == 392 and written["caches"] == {"KVCache": 30}
    read = run_entry(sys.executable, MLX,
                     ["read", *base, "--file", str(file), "--reply-tokens", "32"], 300)  # fmt: skip
    assert judge(read, TOLERANCE) == ("PASS", ""), read
    assert read["loads"] and read["tokens_in_file"] == 392 and read["scored_tokens"] == 32
    assert read["mean_abs_nll_diff"] <= TOLERANCE.mean_abs_nll_diff
    assert read["max_abs_nll_diff"] <= TOLERANCE.max_abs_nll_diff


@pytest.mark.mlx
def test_a_truncated_file_fails_in_one_line(
    saved: tuple[Path, list[str], dict[str, Any]], tmp_path: Path
) -> None:
    file, base, _ = saved
    truncated = tmp_path / "truncated.safetensors"
    # The header and part of the first layer's keys, as an interrupted copy leaves a file.
    truncated.write_bytes(file.read_bytes()[: 1 << 20])
    read = run_entry(sys.executable, MLX, ["read", *base, "--file", str(truncated)], 300)
    verdict, reason = judge(read, TOLERANCE)
    assert verdict == "FAIL" and reason.startswith("does not load: RuntimeError: ")
    assert "exceeding the size of the file" in reason
    assert "\n" not in reason and "Traceback" not in reason


def test_llama_cpp_rows_are_judged_against_its_own_floor() -> None:
    """llama.cpp is not exact on every model: its rows pass on the excess over its floor."""
    at = {"loads": True, "mean_abs_nll_diff": 0.2, "max_abs_nll_diff": 1.0,
          "reuse_floor": 0.1, "reuse_excess": TOLERANCE.reuse_excess}  # fmt: skip
    assert judge(at, TOLERANCE) == ("PASS", "")
    over = {**at, "reuse_excess": TOLERANCE.reuse_excess * 1.01}
    verdict, reason = judge(over, TOLERANCE)
    assert verdict == "FAIL" and "beyond llama.cpp's own floor (0.1)" in reason


@pytest.mark.llama_cpp
@pytest.mark.parametrize(("model", "kind"), [("smollm2-135m", "full"), ("gemma3-270m", "swa")])
def test_a_llama_cpp_python_release_loads_its_own_pickled_state(
    tmp_path: Path, model: str, kind: str
) -> None:
    """save_state() pickled, unpickled and loaded into a new Llama by the same release: the
    appended turn reuses the whole first request's prefix, and scores within llama.cpp's own
    floor (0 on SmolLM2; Gemma 3's restored iSWA state within its floor)."""
    file = tmp_path / "state.pickle"
    base = ["--model", model, "--kind", kind, "--messages", "3"]
    if model == "gemma3-270m":
        base += ["--chat-template", "gemma3-it"]
    written = run_entry(sys.executable, LLAMA, ["write", *base, "--out", str(file)], 300)
    assert "error" not in written, written["error"]
    read = run_entry(sys.executable, LLAMA,
                     ["read", *base, "--file", str(file), "--reply-tokens", "64"], 300)  # fmt: skip
    assert judge(read, TOLERANCE) == ("PASS", ""), read
    assert read["loads"] and read["writer_in_file"] == written["llama_cpp_python"]
    assert 0 < read["kept"] < written["tokens"]  # up to the first request's generation prompt
    if model == "smollm2-135m":
        assert read["mean_abs_nll_diff"] == read["reuse_floor"] == 0
