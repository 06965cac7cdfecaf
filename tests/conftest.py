from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import kvguard_fake_engine
import pytest

from pytest_kvguard.engines import ENGINES, EngineInfo, installed_version

pytest_plugins = ["pytester"]


GATE_REPORT = pytest.StashKey[dict[str, Any]]()
"""The JSON report tests/check_gate_report.py checks (--gate-report)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gate-report",
        metavar="PATH",
        help="tests/check_gate_report.py: the gate run's JSON report to check",
    )
    parser.addoption(
        "--require-engines",
        action="store_true",
        help=f"a test that needs an engine this machine lacks fails instead of skipping (also "
        f"{REQUIRE_ENGINES_ENV}=1; .ci/run sets it)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """check_gate_report.py needs --gate-report: without it, or with a file that is not a
    kvguard report, the run ends here with one line (exit 4); so does a value of
    $KVGUARD_REQUIRE_ENGINES that is neither on nor off."""
    engines_required(config)
    path = config.getoption("gate_report")
    if path is None:
        if any(Path(arg.split("::")[0]).name == "check_gate_report.py" for arg in config.args):
            raise pytest.UsageError(
                "tests/check_gate_report.py checks a gate run's JSON report "
                "(fix: add --gate-report PATH)"
            )
        return
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        missing = [k for k in ("checks", "budgets_file", "machine") if k not in report]
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        raise pytest.UsageError(f"--gate-report {path}: {exc}") from None
    if missing:
        raise pytest.UsageError(
            f"--gate-report {path} is not a kvguard JSON report (it lacks {', '.join(missing)})"
        )
    config.stash[GATE_REPORT] = report


ENGINE_MARKERS = ("llama_cpp", "mlx", "llama_server")
"""Markers named after the engine a test needs (registered in pyproject.toml). A test with one
is also an ``engine`` test, and is skipped, with the reason, only where that engine is not
installed (with --require-engines or $KVGUARD_REQUIRE_ENGINES=1 it fails instead, with the same
reason); a missing model or a broken engine still fails it."""

REQUIRE_ENGINES_ENV = "KVGUARD_REQUIRE_ENGINES"
"""1: a missing engine fails the tests that need it instead of skipping them (.ci/run sets it,
so a broken llama-server build or a missing mlx-lm cannot land as a green run of skips)."""

MISSING_ENGINES = pytest.StashKey[str]()
"""On an engine test under --require-engines: why it cannot run here (its setup fails)."""


def engines_required(config: pytest.Config) -> bool:
    """Whether a missing engine fails its tests: --require-engines or $KVGUARD_REQUIRE_ENGINES
    (1, true, yes or on; 0, false, no, off or empty turn it off; anything else is a usage
    error, so a typo cannot turn the rule off unseen)."""
    if config.getoption("require_engines", default=False):
        return True
    value = os.environ.get(REQUIRE_ENGINES_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise pytest.UsageError(
        f"{REQUIRE_ENGINES_ENV}={os.environ[REQUIRE_ENGINES_ENV]!r} is neither on nor off "
        f"(fix: set it to 1 or 0)"
    )


def skip_or_fail(config: pytest.Config, reason: str) -> None:
    """For a test that finds, as it runs, that something it needs is not installed: skipped
    with the reason, or failed with it where engines are required."""
    if engines_required(config):
        pytest.fail(required_but_missing(reason), pytrace=False)
    pytest.skip(reason)


def required_but_missing(reason: str) -> str:
    """The one line a test fails with where engines are required: the reason it would have been
    skipped for, and the setting that refused the skip."""
    return f"{reason} (required here: {REQUIRE_ENGINES_ENV}=1 or --require-engines)"


@cache
def engine_not_installed(name: str) -> str | None:
    """Why the engine cannot run here, or None where it is installed."""
    info = ENGINES[name]
    if info.binary:  # a program kvguard starts: the binary it would start must answer
        found = installed_version(name) is not None
    else:
        found = importlib.util.find_spec(info.import_name) is not None
    return None if found else f"engine {name} is not installed ({info.install})"


@pytest.hookimpl(tryfirst=True)  # before -m reads the engine marker it adds
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    required = engines_required(config)
    for item in items:
        needed = sorted({m.name for m in item.iter_markers() if m.name in ENGINE_MARKERS})
        if not needed:
            continue
        if item.get_closest_marker("engine") is None:
            item.add_marker(pytest.mark.engine)  # -m "not engine" deselects it
        reasons = [r for r in map(engine_not_installed, needed) if r is not None]
        if reasons and required:
            item.stash[MISSING_ENGINES] = "; ".join(reasons)  # its setup fails with it
        elif reasons:
            item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """An engine test says which engines it needs, so that it is skipped only for want of one;
    where engines are required, the want of one fails it, with the reason it would be skipped
    for."""
    if item.get_closest_marker("engine") is None:
        return
    if not any(item.get_closest_marker(name) for name in ENGINE_MARKERS):
        pytest.fail(
            f"{item.nodeid} is marked engine but names no engine "
            f"(fix: add one of @pytest.mark.{', @pytest.mark.'.join(ENGINE_MARKERS)})",
            pytrace=False,
        )
    missing = item.stash.get(MISSING_ENGINES, None)
    if missing is not None:
        pytest.fail(required_but_missing(missing), pytrace=False)


@pytest.fixture(autouse=True)
def inner_runs_in_file_order(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest-randomly shuffles this suite, not the runs a test starts with pytester: those
    judge the plugin's output for one budgets file or test file, row by row in its order."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS as it starts
        given = os.environ.get("PYTEST_ADDOPTS", "")
        monkeypatch.setenv("PYTEST_ADDOPTS", f"{given} -p no:randomly".strip())


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


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy engine as ``fake`` and ``fake2`` (installed) and ``ghost`` (not installed)."""
    monkeypatch.setitem(ENGINES, "fake", kvguard_fake_engine.INFO)
    monkeypatch.setitem(ENGINES, "fake2", replace(kvguard_fake_engine.INFO, name="fake2"))
    monkeypatch.setitem(
        ENGINES,
        "ghost",
        EngineInfo("ghost", "x", "no_such_engine_mod", "ghost", "pip install ghost"),
    )
    monkeypatch.delenv("KVGUARD_FAKE_FAIL", raising=False)


@pytest.fixture
def gate(pytester: pytest.Pytester, tiny_gguf: Path, fake_engine: None) -> pytest.Pytester:
    """A pytester folder with the tiny GGUF, for budgets files on the toy engine."""
    (pytester.path / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    return pytester


@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[object]:
    """A llama-server kvguard starts on the bundled SmolLM2-135M, stopped after the module."""
    from pytest_kvguard.engines import EngineOptions, load_engine
    from pytest_kvguard.engines.served.llama_server import LlamaServerEngine
    from pytest_kvguard.inputs.models import ModelRef

    engine = load_engine(
        "llama_server", ModelRef("smollm2-135m").resolve(), EngineOptions.from_env()
    )
    assert isinstance(engine, LlamaServerEngine)
    yield engine
    engine.close()
