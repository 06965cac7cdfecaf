"""``kvguard build-llama-server``: llama-server from the llama.cpp the installed llama-cpp-python
vendors, so engine ``llama_server`` and engine ``llama_cpp`` run the same llama.cpp.

pip installs llama-cpp-python, not llama.cpp's server. This command downloads the same
llama-cpp-python release as source, builds its vendored llama.cpp's ``llama-server`` target
with ``$CMAKE_ARGS`` (as llama-cpp-python's own build reads them; on x86-64, where they are
unset, the instruction-set pins ``.ci/install`` uses, since a native build can die with SIGILL),
caches the binary per release and flags, and installs it next to this environment's Python,
where engine ``llama_server`` looks first:

    ${KVGUARD_CACHE:-${XDG_CACHE_HOME:-~/.cache}/kvguard}/llama-server-VERSION-FLAGSHASH/llama-server

The first build took 5 min 39 s here (2 cores); later calls copy the cached binary.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pytest_kvguard.core.args import OneLineParser
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.paths import user_cache_home
from pytest_kvguard.engines import installed_version

CACHE_ENV = "KVGUARD_CACHE"
X86_64_FLAGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
"""CMAKE_ARGS on x86-64 where none are set: a native build can die with SIGILL in the AMX
matmul on some CPUs (README, Two commands)."""
SERVER_OPTIONS = (
    # After the user's flags, so they win: no web UI (it would be fetched from the network), no
    # HTTPS, one static binary that needs no library beside it.
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)  # fmt: skip
Say = Callable[[str], None]
"""Where progress lines go."""
PERCENT = re.compile(r"^\[\s*(\d+)%\]")
"""The progress prefix of a make-driven cmake build's lines."""


def cache_root() -> Path:
    """Where built binaries are kept: $KVGUARD_CACHE, else $XDG_CACHE_HOME/kvguard."""
    explicit = os.environ.get(CACHE_ENV)
    return Path(explicit).expanduser() if explicit else user_cache_home() / "kvguard"


def build_flags() -> str:
    """The CMAKE_ARGS the build uses: the environment's, else the x86-64 pins there."""
    flags = os.environ.get("CMAKE_ARGS")
    if flags is None and platform.machine() in ("x86_64", "AMD64"):
        return X86_64_FLAGS
    return flags or ""


def cached_binary(version: str, cmake_args: str, root: Path | None = None) -> Path:
    """The cache path of llama-server for a llama-cpp-python release and build flags."""
    flags_hash = hashlib.sha256(cmake_args.encode()).hexdigest()[:12]
    return (root or cache_root()) / f"llama-server-{version}-{flags_hash}" / "llama-server"


def llama_cpp_python_version() -> str:
    """The llama-cpp-python release installed here, or a one-line error."""
    version = installed_version("llama_cpp")
    if version is None:
        raise KvguardError(
            "llama-cpp-python is not installed in this environment "
            f"({sys.executable}): there is no llama.cpp to build llama-server from",
            fix='pip install "pytest-kvguard[llama]" first',
        )
    return version


def _run(command: Sequence[str], log: Path, say: Say, what: str) -> None:
    """Run one build step, its output in ``log``; progress lines now and then; the log's tail
    in the error when it fails."""
    started = time.monotonic()
    shown = -10
    with log.open("w", encoding="utf-8") as out:
        try:
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                errors="replace",
            )  # fmt: skip
        except OSError as exc:
            raise KvguardError(f"{what}: cannot run {command[0]}: {exc.strerror}") from None
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            match = PERCENT.match(line)
            if match and int(match.group(1)) >= shown + 10:
                shown = int(match.group(1))
                say(f"{what}: {shown}% ({time.monotonic() - started:.0f} s)")
        code = process.wait()
    if code != 0:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(True)[-15:])
        raise KvguardError(f"{what} failed (exit {code}); the end of its log:\n{tail}")


def _cmake(work: Path, say: Say) -> str:
    """cmake from PATH or next to this Python, else from PyPI into ``work`` (as
    llama-cpp-python's own build gets it)."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found:
        return found
    say("installing cmake from PyPI")
    target = work / "cmake-pypi"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), "cmake"]
    _run(pip, work / "pip-cmake.log", say, "pip install cmake")
    # The wheel's bin/cmake wrapper imports the cmake module, which --target leaves off
    # sys.path: run the binary it wraps.
    binary = next(target.glob("cmake/data/bin/cmake"), None)
    if binary is None:
        raise KvguardError("the cmake wheel from PyPI has no cmake/data/bin/cmake")
    return str(binary)


def _extract(archive: Path, into: Path) -> None:
    with tarfile.open(archive) as sdist:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+: no paths outside
            sdist.extractall(into, filter="data")
        else:
            sdist.extractall(into)  # an older Python: pip fetched it from the index


def build(version: str, cmake_args: str, target: Path, say: Say) -> None:
    """Download llama-cpp-python ``version`` as source and build its llama-server into
    ``target`` (written whole or not at all)."""
    with tempfile.TemporaryDirectory(prefix="kvguard-llama-server-") as tmp:
        work = Path(tmp)
        cmake = _cmake(work, say)
        say(f"downloading llama-cpp-python {version}'s source")
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
              ":all:", "--dest", str(work), f"llama-cpp-python=={version}"],
             work / "pip-download.log", say, "pip download")  # fmt: skip
        sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise KvguardError(f"pip downloaded no llama-cpp-python {version} source archive")
        _extract(sdists[0], work)
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        if source is None:
            raise KvguardError(f"llama-cpp-python {version}'s source has no vendor/llama.cpp")
        say(f"configuring llama.cpp (CMAKE_ARGS: {cmake_args or 'none'})")
        _run([cmake, "-S", str(source), "-B", str(work / "build"), *shlex.split(cmake_args),
              *SERVER_OPTIONS], work / "cmake.log", say, "cmake configure")  # fmt: skip
        jobs = str(os.cpu_count() or 1)
        say(f"building llama-server with {jobs} jobs (5 min 39 s on 2 cores here)")
        _run([cmake, "--build", str(work / "build"), "--target", "llama-server", "-j", jobs],
             work / "build.log", say, "build")  # fmt: skip
        built = work / "build" / "bin" / "llama-server"
        server_version(built)  # a binary that does not run is not cached
        target.parent.mkdir(parents=True, exist_ok=True)
        # A name of its own, so two builds at once never write one file; the rename is atomic.
        handle, name = tempfile.mkstemp(dir=target.parent, prefix=".llama-server-")
        os.close(handle)
        partial = Path(name)
        shutil.copy2(built, partial)
        partial.replace(target)


def server_version(binary: Path) -> str:
    """``llama-server --version``'s version line; a one-line error where it does not run."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KvguardError(f"{binary} does not run: {exc}") from None
    output = done.stdout + done.stderr
    line = next((ln.strip() for ln in output.splitlines() if "version" in ln), None)
    if done.returncode != 0 or line is None:
        raise KvguardError(
            f"{binary} --version exited {done.returncode}: {output.strip()[-200:] or 'no output'}",
            fix="rebuild it with --rebuild",
        )
    return line


def ensure_llama_server(dest: Path, *, rebuild: bool = False, say: Say = print) -> Path:
    """llama-server for the installed llama-cpp-python in ``dest`` (built or from the cache)."""
    version = llama_cpp_python_version()
    cmake_args = build_flags()
    cached = cached_binary(version, cmake_args)
    if rebuild or not (cached.is_file() and os.access(cached, os.X_OK)):
        build(version, cmake_args, cached, say)
    else:
        say(f"cached: {cached} ({server_version(cached)})")  # one that no longer runs stops here
    dest.mkdir(parents=True, exist_ok=True)
    installed = dest / "llama-server"
    shutil.copy2(cached, installed)
    return installed


def needs_llama_server(budgets_path: Path) -> bool:
    """Whether a budgets file has a check that starts llama-server (engine llama_server with a
    model file, not a running server's URL)."""
    from pytest_kvguard.gate.budgets_file import load_budgets_file
    from pytest_kvguard.inputs.models import is_url

    checks = load_budgets_file(budgets_path).checks
    return any("llama_server" in c.engines and not is_url(c.model.name) for c in checks)


def main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-build-llama-server") -> int:
    parser = OneLineParser(
        prog=prog,
        description="Build llama-server from the installed llama-cpp-python's own llama.cpp "
        "(with $CMAKE_ARGS; on x86-64 without them, the instruction-set pins), cache it, and "
        "install it next to this Python.",
    )
    parser.add_argument(
        "--dest", type=Path, default=Path(sys.executable).parent,
        help="folder to install llama-server into (default: this Python's, where engine "
        "llama_server looks first)",
    )  # fmt: skip
    parser.add_argument("--rebuild", action="store_true", help="build even when cached")
    parser.add_argument(
        "--only-for", metavar="BUDGETS", type=Path,
        help="build only if this budgets file has a check on engine llama_server",
    )  # fmt: skip
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)

    try:
        if args.only_for is not None and not needs_llama_server(args.only_for):
            say(f"not needed: {args.only_for} has no check on engine llama_server")
            return 0
        installed = ensure_llama_server(args.dest, rebuild=args.rebuild, say=say)
        say(f"installed {installed} ({server_version(installed)})")
    except KvguardError as exc:
        say(f"error: {exc}")
        return 1
    except (OSError, tarfile.TarError) as exc:
        where = getattr(exc, "filename", None)
        say(f"error: {where + ': ' if where else ''}{getattr(exc, 'strerror', None) or exc}")
        return 1
    print(installed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
