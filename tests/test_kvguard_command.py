"""``kvguard SUBCOMMAND``: one command for every tool, each subcommand imported only when chosen,
its help and errors naming it as typed; the old ``kvguard-NAME`` scripts kept as aliases; bad
input one line, never a traceback. No engine needed."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from pytest_kvguard.cli import compare
from pytest_kvguard.cli.main import SUBCOMMANDS, main
from pytest_kvguard.isolation import environments

ROOT = Path(__file__).parent.parent
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
NAMES = ["capacity", "compare", "scenarios", "docs", "model-facts", "quantize", "env", "bisect",
         "saved-cache", "build-llama-server"]  # fmt: skip
"""The ten subcommands, each once a script of its own (``kvguard-NAME``)."""
ENGINES = ("llama_cpp", "mlx", "mlx_lm", "torch", "vllm")


def kvguard(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script (``.venv/bin/kvguard``), as a user runs it; where it is
    not installed beside this Python, the same function run with ``python -c``."""
    script = Path(sys.executable).parent / "kvguard"
    command = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "import sys; from pytest_kvguard.cli.main import main; "
              "sys.exit(main())"]
    )  # fmt: skip
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def test_help_lists_every_subcommand_with_a_line() -> None:
    done = kvguard("--help")
    assert done.returncode == 0, done.stderr
    assert list(SUBCOMMANDS) == NAMES or sorted(SUBCOMMANDS) == sorted(NAMES)
    for name in NAMES:
        (line,) = [ln for ln in done.stdout.splitlines() if ln.split()[:1] == [name]]
        assert len(line.split()) > 3, f"no description for {name}: {line!r}"
    assert "aliases" in done.stdout and "one release" in done.stdout


def test_bare_kvguard_lists_the_subcommands_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert all(f"  {name} " in err for name in NAMES)


def test_help_imports_no_engine_and_no_subcommand() -> None:
    code = (
        "import sys\n"
        "from pytest_kvguard.cli.main import main\n"
        "assert main(['--help']) == 0\n"
        f"loaded = [m for m in sys.modules if m.split('.')[0] in {ENGINES!r}\n"
        "          or m.startswith(('pytest_kvguard.engines', 'pytest_kvguard.cli.capacity'))]\n"
        "print('LOADED', loaded, file=sys.stderr)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_compare_on_a_file_without_checks_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"schema": 2, "tests": []}))
    done = kvguard("compare", "a.json", "a.json", cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("kvguard compare: a.json: ") and "'checks'" in line, line
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("report", "says"),
    [
        ("[1, 2]", "a JSON list, not a kvguard report"),
        ('{"checks": {}}', "'checks' is not a list"),
        ('{"checks": [{"verdict": "PASS"}]}', "checks[0] is not a check"),
        ('{"checks": [{"name": "a", "verdict": "PASS", "metrics": [1]}]}', "'metrics' is not"),
        ("{bad", "not JSON"),
    ],
)
def test_compare_names_what_a_report_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], report: str, says: str
) -> None:
    path = tmp_path / "r.json"
    path.write_text(report)
    assert compare.main([str(path), str(path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvguard-compare: {path}: ") and says in line, line


def test_an_unknown_subcommand_is_one_line_with_a_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["comapre", "a.json"]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert out == ""
    assert "unknown subcommand 'comapre'" in line and "did you mean 'compare'?" in line
    assert all(name in line for name in NAMES)
    assert main(["zzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize("name", NAMES)
def test_each_subcommands_help_names_it_as_typed(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvguard {name} "), out.splitlines()[0]


def test_capacity_help_through_the_console_script() -> None:
    done = kvguard("capacity", "--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: kvguard capacity ")
    assert "python -m" not in done.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["capacity", "missing.json"], "error: cannot read missing.json"),
        (["capacity", "config.json", "--contexts", "0"], "argument --contexts: must be lengths"),
        (["compare", "missing.json", "missing.json"], "kvguard compare: missing.json: cannot read"),
        (["docs", "--check", "missing.md"], "kvguard docs: missing.md: No such file"),
        (["scenarios", "--nope"], "kvguard scenarios: error: unrecognized arguments: --nope"),
        (["model-facts", "missing.gguf"], "error: model file 'missing.gguf' not found"),
        (["quantize", "missing.gguf", "Q8_0", "out.gguf"], "model file 'missing.gguf' not found"),
        (["env", "--dir", "config.json", "mlx-lm==0.28.0"], "config.json: not a folder"),
        (["bisect", "missing.yaml", "--engine", "mlx", "--good", "1", "--bad", "2"],
         "error: missing.yaml: no budgets file there"),
        (["build-llama-server", "--only-for", "bad.yaml"], "malformed YAML"),
        (["saved-cache", "--writer", "missing", "--reader", "missing"],
         "kvguard saved-cache: --writer: no Python interpreter"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_without_a_traceback(
    argv: list[str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVGUARD_ENV_DIR", str(tmp_path / "envs"))
    monkeypatch.setattr(environments, "_create", _never)  # no environment is ever built here
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "bad.yaml").write_text("checks: [\n  - a: : b\n")
    assert main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and says in lines[0], err


BAD_OPTIONS: dict[str, tuple[list[str], str]] = {
    "capacity": (["x.gguf", "--cap", "0"], "argument --cap: 0 is below 1"),
    "compare": (["a.json", "b.json", "--tolerance", "lots"], "argument --tolerance: "),
    "scenarios": (["--schema", "--nope"], "unrecognized arguments: --nope"),
    "docs": (["--nope"], "unrecognized arguments: --nope"),
    "model-facts": (["smollm2-135m", "--chat-tokens", "x"], "argument --chat-tokens: invalid int"),
    "quantize": (["in.gguf", "Q8_0", "out.gguf", "--nope"], "unrecognized arguments: --nope"),
    "env": (["mlx-lm==0.28.0", "--dir"], "argument --dir: expected one argument"),
    "bisect": (["b.yaml", "--engine", "mlx", "--good", "1", "--bad", "2", "--max-builds", "x"],
               "argument --max-builds: "),
    "saved-cache": (["--writer", "py", "--reader", "py", "--kind", "paged"],
                    "argument --kind: invalid choice: 'paged'"),
    "build-llama-server": (["--only-for"], "argument --only-for: expected one argument"),
}  # fmt: skip
"""Per subcommand: arguments with a bad option value (or an unknown option, for a subcommand
without one that takes a value), and what its one line says."""


def test_every_subcommand_has_a_bad_option_case() -> None:
    assert sorted(BAD_OPTIONS) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_option_value_is_one_line_and_exit_2(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVGUARD_ENV_DIR", str(tmp_path / "envs"))
    monkeypatch.setattr(environments, "_create", _never)  # no environment is ever built here
    args, says = BAD_OPTIONS[name]
    assert main([name, *args]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "usage:" not in err and out == ""
    (line,) = err.splitlines()
    prog = f"kvguard {name}"
    assert line.startswith(f"{prog}: error: ") and says in line, line
    assert line.endswith(f" (fix: see {prog} --help)"), line


def test_a_bad_option_value_through_the_console_script_is_one_line() -> None:
    done = kvguard("capacity", "x.gguf", "--cap", "0")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "kvguard capacity: error: argument --cap: 0 is below 1 (fix: see kvguard capacity --help)\n"
    )


def _never(*args: object, **kwargs: object) -> Path:
    raise AssertionError("a bad-input test reached the environment build")


def test_every_script_points_at_a_function_that_exists() -> None:
    assert SCRIPTS["kvguard"] == "pytest_kvguard.cli.main:main"
    assert {f"kvguard-{name}" for name in NAMES} <= SCRIPTS.keys()
    for script, target in SCRIPTS.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), script


@pytest.mark.parametrize("name", NAMES)
def test_each_old_alias_runs_what_the_subcommand_runs(name: str) -> None:
    sub = SUBCOMMANDS[name]
    assert SCRIPTS[f"kvguard-{name}"] == f"{sub.module}:{sub.function}"


def test_the_docs_page_lists_every_subcommand_and_every_alias() -> None:
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    missing = [n for n in NAMES if f"| `kvguard {n}` |" not in page or f"`kvguard-{n}`" not in page]
    assert not missing, f"docs/cli.md does not list: {missing}"


def test_an_old_alias_still_runs_and_names_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        compare.main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvguard-compare ")
    script = Path(sys.executable).parent / "kvguard-capacity"
    if script.exists():  # the installed alias, as a user runs it
        done = subprocess.run([str(script), "x.gguf", "--cap", "0"], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2
        assert done.stderr.startswith("kvguard-capacity: error: argument --cap: "), done.stderr


class _Stop(Exception):
    """Raised by a fake ``subprocess.run``: the environment build stops before its first step."""


def _stop(*args: object, **kwargs: object) -> None:
    raise _Stop


@pytest.mark.parametrize("prog", ["kvguard env", "kvguard-env"])
def test_envs_progress_line_names_the_command_as_typed(
    prog: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(environments.subprocess, "run", _stop)
    argv = ["mlx-lm==0.28.0", "--dir", str(tmp_path)]
    with pytest.raises(_Stop):
        if prog == "kvguard env":
            main(["env", *argv])
        else:
            environments.main(argv)  # the old alias's entry point, its default prog
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{prog}: creating {tmp_path}/"), line
