"""kvguard-compare: two reports figure by figure, whichever schema wrote them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_kvguard.cli.compare import main

OLD = {  # schema 1: samples and layer sizes at the top of the row
    "schema": 1,
    "checks": [{"name": "a", "verdict": "PASS", "tokens": 1500, "seconds": {"run": 9.0},
                "metrics": {"post_eviction_ppl": 12.1, "kv_bytes": 5902057.0},
                "samples": [{"tokens": 256, "held": 256}], "layer_sizes": [[1500, 256]]}],
}  # fmt: skip


def new(**changes: object) -> dict[str, object]:
    row = {
        "name": "a",
        "verdict": "PASS",
        "tokens": 1500,
        "seconds": {"run": 3.0},
        "metrics": {"post_eviction_ppl": 12.1, "kv_bytes": 5902057.0},
        "detail": {"samples": [{"tokens": 256, "held": 256}], "layer_sizes": [[1500, 256]]},
    }
    row.update(changes)  # fmt: skip
    return {"schema": 2, "checks": [row]}


def run(tmp_path: Path, second: object, *extra: str) -> int:
    (tmp_path / "a.json").write_text(json.dumps(OLD))
    (tmp_path / "b.json").write_text(json.dumps(second))
    return main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), *extra])


def test_same_figures_across_schemas_are_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(tmp_path, new()) == 0  # wall time differs; it is never compared
    assert "1 checks, 7 figures compared: identical" in capsys.readouterr().out


def test_one_figure_moved_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    moved = new(metrics={"post_eviction_ppl": 12.100001, "kv_bytes": 5902057.0})
    assert run(tmp_path, moved) == 1
    assert "a: metrics.post_eviction_ppl 12.1 -> 12.100001" in capsys.readouterr().out
    assert run(tmp_path, moved, "--ignore", "post_eviction_ppl") == 0


def test_a_tolerance_passes_small_moves_and_names_the_largest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = new(metrics={"post_eviction_ppl": 12.112, "kv_bytes": 5902057.0})  # +0.099%
    assert run(tmp_path, moved, "--tolerance", "0.1") == 0
    out = capsys.readouterr().out
    assert "largest relative change 0.09917%: a: metrics.post_eviction_ppl 12.1 -> 12.112" in out
    assert run(tmp_path, moved, "--tolerance", "0.09") == 1  # limit - 1: a difference
    assert "1 difference(s) beyond 0.09%" in capsys.readouterr().out
    # Counts and bytes are numbers like any other: a tolerance covers them too; a verdict never.
    assert run(tmp_path, new(verdict="FAIL"), "--tolerance", "50") == 1


def test_a_figure_that_becomes_nan_is_a_difference_at_any_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = new(metrics={"post_eviction_ppl": float("nan"), "kv_bytes": 5902057.0})
    assert run(tmp_path, broken, "--tolerance", "50") == 1
    assert "a: metrics.post_eviction_ppl 12.1 -> nan" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run(tmp_path, new(), "--tolerance", "-1")
    assert "below 0" in capsys.readouterr().err
    for bad in ("nan", "inf"):
        with pytest.raises(SystemExit):
            run(tmp_path, new(), "--tolerance", bad)
        assert "not a finite number" in capsys.readouterr().err
