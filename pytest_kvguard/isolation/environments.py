"""Engine environments: which Python runs each engine, and the upgrade preview's other one.

``--kvguard-engine-python mlx=PATH`` (budgets file ``engine_python:``) runs an engine in the
virtual environment whose interpreter is PATH; ``--kvguard-against mlx=PATH`` (``against:``)
runs every check of that engine a second time there and judges this run against it. PATH is a
virtual environment's python with the engine installed; ``kvguard env`` creates and caches one
per engine requirement (``kvguard env "mlx-lm==0.28.0"`` prints its python).

The environment needs the engine and kvguard's run-time dependencies, not pytest-kvguard
itself: the worker always runs this copy of pytest_kvguard (see ``workers``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from functools import cache
from pathlib import Path

from pytest_kvguard.core.args import OneLineParser
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.paths import user_cache_home
from pytest_kvguard.engines import ENGINES, engine_info, installed_version
from pytest_kvguard.engines.registry import adapter_function


def version_in(python: str, engine: str) -> str | None:
    """The engine's version in that interpreter's environment (read there, nothing imported)."""
    if python == sys.executable:
        return installed_version(engine)
    return _version_in(python, engine_info(engine).distribution)


@cache
def _version_in(python: str, distribution: str) -> str | None:
    code = (
        "import importlib.metadata as m, sys\n"
        "try: print(m.version(sys.argv[1]))\n"
        "except m.PackageNotFoundError: pass\n"
    )
    try:
        done = subprocess.run(
            [python, "-c", code, distribution], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


# kvguard env: create and cache an environment for an engine requirement.


NOT_IN_WORKERS = ("pytest", "packaging")
"""Dependencies of the pytest process only (packaging: kvguard bisect sorts releases); left
out of an engine environment, whose folder name hashes what is installed there."""


def runtime_requirements() -> list[str]:
    """pytest-kvguard's own dependencies but ``NOT_IN_WORKERS``: what a worker imports besides
    the engine (pytest_kvguard itself comes from the pytest process, on PYTHONPATH)."""
    declared = importlib.metadata.requires("pytest-kvguard") or []
    return [r for r in declared if "extra ==" not in r and _name_of(r) not in NOT_IN_WORKERS]


X86_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
"""llama.cpp build flags on x86-64: a native build can die with SIGILL (see README)."""
MARKER = "kvguard-env.json"


def _name_of(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else requirement


def environment_requirements(requested: Sequence[str]) -> list[str]:
    """What gets installed: the requested engine versions, what a worker needs with them, and
    what each requested engine's adapter says comes with it (``EngineInfo.companions``)."""
    names = {_name_of(r) for r in requested}
    extra = runtime_requirements()
    for info in ENGINES.values():
        if info.companions is not None and _name_of(info.distribution) in names:
            extra += adapter_function(info.companions)(names)
    return [*requested, *extra]


def environment_dir(requirements: Sequence[str], root: Path) -> Path:
    """One folder per requirement set, interpreter version and platform."""
    # Not platform.platform(): it names the kernel release, which a CI runner's update changes.
    machine = [platform.system(), platform.machine(), *platform.libc_ver()]
    identity = "\n".join([*sorted(requirements), sys.version, *machine])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", "-".join(requirements[:2])).strip("-")[:48]
    return root / f"{slug}-{digest}"


def default_root() -> Path:
    override = os.environ.get("KVGUARD_ENV_DIR")
    if override:
        return Path(override)
    return user_cache_home() / "pytest-kvguard" / "envs"


def python_of(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def create_environment(
    requested: Sequence[str], root: Path, log: Path | None = None, *, prog: str = "kvguard env"
) -> Path:
    """The python of a cached environment with these requirements, made now if need be
    (``prog``: the command its progress line names)."""
    requirements = environment_requirements(requested)
    env_dir = environment_dir(requirements, root)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    # One creator at a time (parallel CI jobs, xdist workers): the others wait, then reuse it.
    with open(env_dir.with_name(env_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _create(requested, requirements, env_dir, prog)


def _create(
    requested: Sequence[str], requirements: list[str], env_dir: Path, prog: str = "kvguard env"
) -> Path:
    python = python_of(env_dir)
    if (env_dir / MARKER).is_file() and python.exists():
        return python
    if env_dir.exists():
        shutil.rmtree(env_dir)  # a half-made environment from an interrupted run
    uv = shutil.which("uv")
    environ = dict(os.environ)
    if platform.machine() == "x86_64":
        environ.setdefault("CMAKE_ARGS", X86_CMAKE_ARGS)
    tool = "uv" if uv else "pip"
    print(f"{prog}: creating {env_dir} with {tool}: {' '.join(requirements)}", file=sys.stderr)
    if uv:
        commands = [
            [uv, "venv", "--quiet", "--python", sys.executable, str(env_dir)],
            [uv, "pip", "install", "--quiet", "--python", str(python), *requirements],
        ]
    else:
        commands = [
            [sys.executable, "-m", "venv", str(env_dir)],
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             *requirements],
        ]  # fmt: skip
    for command in commands:
        done = subprocess.run(command, env=environ, stdout=sys.stderr, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
        if done.returncode != 0:
            shutil.rmtree(env_dir, ignore_errors=True)
            raise KvguardError(
                f"{' '.join(command[:3])} ... failed (exit {done.returncode}):\n"
                + "\n".join(done.stderr.strip().splitlines()[-12:]),
                fix="check the requirement's name and version, and the package index",
            )
    freeze_command = (
        [uv, "pip", "freeze", "--python", str(python)] if uv
        else [str(python), "-m", "pip", "freeze"]
    )  # fmt: skip
    done = subprocess.run(freeze_command, capture_output=True, text=True, env=environ)
    packages = done.stdout.split()
    (env_dir / MARKER).write_text(
        json.dumps(
            {
                "requested": list(requested),
                "installed": requirements,
                "packages": packages,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "kvguard": importlib.metadata.version("pytest-kvguard"),
            },
            indent=2,
        )
        + "\n"
    )
    return python


def main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-env") -> int:
    parser = OneLineParser(
        prog=prog,
        description="Create (once) and cache a virtual environment with an engine version, for "
        "--kvguard-engine-python and --kvguard-against. Prints its python on stdout; progress "
        "goes to stderr. Uses uv where installed, else venv and pip.",
    )
    parser.add_argument(
        "requirements", nargs="+", metavar="REQUIREMENT",
        help='an engine requirement, e.g. "mlx-lm==0.28.0" (several may be given)',
    )  # fmt: skip
    parser.add_argument(
        "--dir", type=Path, default=None,
        help="where environments are cached (default: $KVGUARD_ENV_DIR, else "
        "~/.cache/pytest-kvguard/envs); cache this folder in CI",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        python = create_environment(args.requirements, args.dir or default_root(), prog=prog)
    except KvguardError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # --dir a file, or a folder this user cannot write
        where = f"{exc.filename}: " if exc.filename else ""
        folder = isinstance(exc, (FileExistsError, NotADirectoryError))
        reason = "not a folder" if folder else exc.strerror or str(exc)
        print(f"{prog}: {where}{reason} (fix: give --dir a folder you can write)", file=sys.stderr)
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
