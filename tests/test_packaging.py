"""Ready for a package index: the sdist and the wheel built from it carry the license and
py.typed, and the wheel, installed into a fresh environment outside the checkout, runs a real
check from a budgets file there.

Nothing is downloaded for the environment: it sees this environment's packages (pytest, numpy,
the engine, the bundled models) through a .pth file, so only the build backend comes from pip's
index and cache, as any ``pip wheel`` of the project does. This environment's own
pytest-kvguard is an editable install whose finder a .pth file does not load: the fresh
environment imports the wheel's copy (checked).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = """\
version: 1
checks:
  - name: kv-bytes-as-predicted
    scenario: memory
    engine: llama_cpp
    model: smollm2-135m
    policy: full
    params: {lengths: [64]}
    budgets: {max_kv_deviation_pct: 1}
"""

pytestmark = [pytest.mark.packaging, pytest.mark.llama_cpp]


def run(args: list[str | Path], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_wheel_runs_a_check_in_a_fresh_environment(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    # The project as an sdist would carry it, copied out of the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "pytest_kvguard",
        source / "pytest_kvguard",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )

    fresh = tmp_path / "venv"
    run([sys.executable, "-m", "venv", fresh], tmp_path, env)
    python = fresh / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    tmp_path, env).strip())  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "kvguard_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    # The sdist needs a setuptools with PEP 639 license fields (this environment's may be older).
    run([python, "-m", "pip", "install", "--quiet", "setuptools>=77"], tmp_path, env)
    dist = tmp_path / "dist"
    run([python, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(dist)!r})"],
        source, env)  # fmt: skip
    (sdist,) = dist.glob("pytest_kvguard-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {Path(n).relative_to(Path(n).parts[0]).as_posix() for n in archive.getnames()}
    assert {"LICENSE", "pytest_kvguard/py.typed", "README.md"} <= names

    # The wheel, built from the sdist as a package index's users get it.
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", dist, sdist],
        tmp_path, env)  # fmt: skip
    (wheel,) = dist.glob("pytest_kvguard-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "pytest_kvguard/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert "pytest_kvguard/data/report.schema.json" in names

    run([python, "-m", "pip", "install", "--quiet", "--no-deps", wheel], tmp_path, env)
    gate = tmp_path / "gate"
    gate.mkdir()
    where = run([python, "-c", "import pytest_kvguard; print(pytest_kvguard.__file__)"], gate, env)
    assert Path(where.strip()).is_relative_to(fresh), where
    (gate / "budgets.yaml").write_text(BUDGETS)
    output = run(
        [python, "-m", "pytest", "--kvguard", "budgets.yaml", "--kvguard-json", "report.json",
         "-p", "no:randomly", "-p", "no:cacheprovider"],
        gate, env,
    )  # fmt: skip
    assert "kv-bytes-as-predicted" in output
    report = json.loads((gate / "report.json").read_text())
    assert report["verdict"] == "pass" and report["complete"] is True
    assert [(c["name"], c["verdict"]) for c in report["checks"]] == [
        ("kv-bytes-as-predicted", "PASS")
    ]
