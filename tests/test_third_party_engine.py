"""An engine shipped as its own distribution: found by its ``pytest_kvguard.engines`` entry
point, run through a budgets file, with no kvguard file touched (the toy engine's mechanics;
it proves nothing about real caches)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines.registry import ENTRY_POINT_GROUP, EngineInfo, _entry_point_adapters

TESTS = Path(__file__).parent

TOY_MODULE = '''
"""toy-kv-engine: kvguard's test toy under another name, as a third party would ship it."""
from dataclasses import replace

import kvguard_fake_engine


class ToyEngine(kvguard_fake_engine.FakeEngine):
    name = "toy"


def load(model_path, options) -> ToyEngine:
    return ToyEngine(ignores_cap="nocap" in model_path.name)


ADAPTER = replace(
    kvguard_fake_engine.INFO,
    name="toy",
    module=__name__,
    import_name=__name__,
    distribution="toy-kv-engine",
    install="pip install toy-kv-engine",
)
'''


def install_toy_distribution(site: Path, entry: str = "toy_kv_engine:ADAPTER") -> Path:
    """A folder holding the toy module and its distribution's metadata (what pip would
    install into site-packages), with an entry point in kvguard's group."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "toy_kv_engine.py").write_text(TOY_MODULE)
    meta = site / "toy_kv_engine-0.1.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-kv-engine\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = {entry}\n")
    return site


def on_path(monkeypatch: pytest.MonkeyPatch, site: Path) -> None:
    """The distribution's folder on sys.path, here and in every process pytest starts."""
    monkeypatch.syspath_prepend(str(site))
    paths = [str(site), str(TESTS), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


def test_an_engine_from_its_own_distribution_runs_a_gate(
    pytester: pytest.Pytester, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(monkeypatch, install_toy_distribution(tmp_path / "site"))
    (pytester.path / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    pytester.makefile(
        ".yaml",
        budgets="""
version: 1
defaults: {engine: toy, model: tiny.gguf, params: {cap: 64, tokens: 400}}
checks:
  - name: toy-sink
    policy: sink
    params: {sinks: 1}
    budgets: {max_ppl_increase_pct: 20, max_kv_entries: 64}
  - name: toy-window
    policy: window
    budgets: {max_ppl_increase_pct: 5}
    expect: violation
    reason: the toy forgets once its sink is gone
""",
    )
    # A new pytest process: the registry is read from the entry points there, as a user's
    # run reads it, and the check runs in an engine worker that gets that registry.
    result = pytester.runpytest_subprocess("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    assert result.ret == 0, result.stdout.str()
    report = json.loads((pytester.path / "r.json").read_text())
    rows = {c["name"]: c for c in report["checks"]}
    assert {r["engine"] for r in rows.values()} == {"toy"}
    assert {n: r["verdict"] for n, r in rows.items()} == {
        "toy-sink": "PASS", "toy-window": "CAUGHT"
    }  # fmt: skip
    assert rows["toy-sink"]["metrics"]["kv_entries"] == 64


def test_every_adapter_comes_from_an_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(monkeypatch, install_toy_distribution(tmp_path / "site"))
    adapters = _entry_point_adapters()
    assert list(adapters)[:4] == ["llama_cpp", "llama_server", "mlx", "openai"]
    assert adapters["toy"].distribution == "toy-kv-engine"


def test_a_broken_entry_point_is_one_line_naming_its_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(monkeypatch, install_toy_distribution(tmp_path / "site", "toy_kv_engine:NOPE"))
    with pytest.raises(KvguardError) as caught:
        _entry_point_adapters()
    assert str(caught.value).startswith(
        f"entry point {ENTRY_POINT_GROUP}:toy = toy_kv_engine:NOPE does not load: AttributeError"
    )
    assert caught.value.fix == "fix or uninstall toy-kv-engine"


def test_an_entry_point_that_is_not_an_adapter_of_its_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = install_toy_distribution(tmp_path / "site", "toy_kv_engine:load")
    on_path(monkeypatch, site)
    with pytest.raises(KvguardError, match="is not the EngineInfo of an engine named 'toy'"):
        _entry_point_adapters()


def test_what_an_environment_installs_with_an_engine_is_its_adapters_word() -> None:
    from pytest_kvguard.isolation.environments import environment_requirements

    with_mlx = environment_requirements(["mlx-lm==0.28.0"])
    assert with_mlx[0] == "mlx-lm==0.28.0"
    assert ("mlx[cpu]" in with_mlx) == (sys.platform == "linux")
    assert any(r.startswith("llama-cpp-python") for r in with_mlx)  # GGUF tokens
    alone = environment_requirements(["llama-cpp-python==0.3.35"])
    assert not any(r.startswith(("mlx", "llama-cpp-python==0.3.36")) for r in alone)


def test_a_broken_adapter_stops_pytest_with_one_line(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(monkeypatch, install_toy_distribution(tmp_path / "site", "toy_kv_engine:NOPE"))
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: entry point pytest_kvguard.engines:toy = toy_kv_engine:NOPE does not load: "
         "AttributeError* (fix: fix or uninstall toy-kv-engine)"]
    )  # fmt: skip
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


def test_two_adapters_of_one_name_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = install_toy_distribution(tmp_path / "site")
    (site / "toy_two.py").write_text("from toy_kv_engine import ADAPTER\n")
    other = site / "toy_two-0.1.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-two\nVersion: 0.1\n")
    (other / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = toy_two:ADAPTER\n")
    on_path(monkeypatch, site)
    with pytest.raises(KvguardError, match="two adapters register engine 'toy'"):
        _entry_point_adapters()


def test_an_engine_worker_adopts_the_registry_it_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker in an environment ``kvguard env`` made has no kvguard distribution whose
    entry points it could read: it takes the pytest process's registry as it is."""
    from pytest_kvguard.engines import registry

    def no_distribution() -> dict[str, EngineInfo]:
        raise AssertionError("the worker read entry points")

    monkeypatch.setattr(registry, "_entry_point_adapters", no_distribution)
    adopted = registry.EngineRegistry()
    adopted.adopt({"llama_cpp": registry.ENGINES["llama_cpp"]})
    assert list(adopted) == ["llama_cpp"] and adopted["llama_cpp"].name == "llama_cpp"
