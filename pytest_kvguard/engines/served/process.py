"""llama-server as a process and an HTTP peer: finding and building its command line,
starting it, waiting until it is healthy, reading its log, and JSON requests under a time limit
whose failures become one-line errors. The engine adapter (``llama_server``) uses this; only
the Python standard library is needed here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import http.client
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pytest_kvguard.core.errors import EngineError, KvguardError
from pytest_kvguard.engines.options import EngineOptions

BINARY_ENV = "KVGUARD_LLAMA_SERVER"
"""Path to the llama-server binary (default: next to the running Python, then PATH)."""
START_TIMEOUT_ENV = "KVGUARD_SERVER_START_TIMEOUT"
REQUEST_TIMEOUT_ENV = "KVGUARD_SERVER_TIMEOUT"
DEFAULT_START_TIMEOUT = 120.0
"""Seconds a started server gets to load its model and answer /health."""
DEFAULT_REQUEST_TIMEOUT = 600.0
"""Seconds one request may take (a forced generation of a few thousand tokens is well under)."""
UBATCH = 512
"""The in-process llama_cpp adapter's batch and ubatch: the same here, so the sliding layers
hold the same cells and reuse can be compared token for token."""


def seconds_from_env(var: str, default: float) -> float:
    raw = os.environ.get(var)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise KvguardError(
            f"${var}={raw!r} is not a positive number of seconds", fix=f"unset {var}"
        )
    return value


def find_binary() -> Path:
    """The llama-server to start: $KVGUARD_LLAMA_SERVER, the one kvguard build-llama-server
    installs next to the environment's Python, or one on PATH."""
    raw = os.environ.get(BINARY_ENV)
    if raw:
        path = Path(raw)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise KvguardError(
                f"${BINARY_ENV}={raw} is not an executable file",
                fix="point it at a llama-server binary, or unset it",
            )
        return path
    beside = Path(sys.executable).parent / "llama-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    raise KvguardError(
        "engine 'llama_server' needs a llama-server binary, and none was found",
        fix="run `kvguard build-llama-server` (it builds one from the installed "
        f"llama-cpp-python's llama.cpp, next to this Python), set ${BINARY_ENV}, or give the "
        "check a running server as model: http://HOST:PORT",
    )


@dataclass(frozen=True)
class ServerSettings:
    """The command-line settings of a server kvguard starts: one server per distinct value."""

    n_ctx: int
    swa_full: bool = False
    ctx_checkpoints: int = 0
    checkpoint_min_step: int = 0
    context_shift: bool = False
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    """The K and V cache types (``--cache-type-k`` / ``--cache-type-v``). A quantized V needs
    flash attention: llama-server's default (auto) turns it on where the backend has it, and
    the server refuses to start otherwise, which the check reports as its error."""
    chat_template: Path | None = None
    """A Jinja chat template file the server applies (``--chat-template-file``), as an app's
    deployment passes one; None: the model's own."""

    def args(self) -> list[str]:
        args = ["--ctx-size", str(self.n_ctx), "--parallel", "1"]
        args += ["--batch-size", str(UBATCH), "--ubatch-size", str(UBATCH)]
        args += ["--ctx-checkpoints", str(self.ctx_checkpoints)]
        args += ["--checkpoint-min-step", str(self.checkpoint_min_step)]
        args += ["--context-shift" if self.context_shift else "--no-context-shift"]
        if self.swa_full:
            args.append("--swa-full")
        if (self.cache_type_k, self.cache_type_v) != ("f16", "f16"):
            args += ["--cache-type-k", self.cache_type_k, "--cache-type-v", self.cache_type_v]
        if self.chat_template is not None:
            args += ["--jinja", "--chat-template-file", str(self.chat_template)]
        return args


class Http:
    """JSON over HTTP to one server, every request under a timeout; failures become one line."""

    def __init__(
        self, url: str, timeout: float, alive: Any = None, server: str = "llama-server"
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.server = server
        """What errors call the server (engine openai: "the OpenAI-compatible server")."""
        self.alive = alive
        """Called on a failed request: raises if the server process has died (its exit and log
        tail say more than a refused connection)."""

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self._request("GET", path, None, timeout)

    def post(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> Any:
        return self._request("POST", path, body, timeout)

    def _request(
        self, method: str, path: str, body: Mapping[str, Any] | None, timeout: float | None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )  # fmt: skip
        where = f"{self.server} at {self.url}: {method} {path}"
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            raise EngineError(f"{where} answered HTTP {exc.code}: {_error_text(text)}") from None
        except (http.client.HTTPException, ValueError) as exc:
            # Bytes that are not HTTP (BadStatusLine, IncompleteRead), or a URL urllib refuses.
            if self.alive is not None:
                self.alive()
            raise EngineError(
                f"{where} answered something that is not HTTP: {type(exc).__name__} {exc}"[:300],
                fix=f"check that the URL is a {self.server}",
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            if self.alive is not None:
                self.alive()
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
                raise EngineError(
                    f"{where} gave no answer within {timeout or self.timeout:.0f} s",
                    fix=f"raise ${REQUEST_TIMEOUT_ENV}, or check the server",
                ) from None
            raise EngineError(
                f"{where} failed: {reason}", fix="check that the server runs"
            ) from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            excerpt = raw[:120].decode("utf-8", "replace")
            raise EngineError(
                f"{where} answered something that is not JSON: {excerpt!r}",
                fix=f"check that the URL is a {self.server}",
            ) from None


def _error_text(text: str) -> str:
    """The server's own error message out of its JSON error body, else the body's start."""
    with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError, KeyError):
        error = json.loads(text)["error"]
        return str(error.get("message", error))
    return text[:200]


def field(answer: Any, *keys: str, where: str) -> Any:
    """``answer[k1][k2]...``, or an error naming what the server left out."""
    value = answer
    for key in keys:
        if not isinstance(value, Mapping) or key not in value:
            raise EngineError(
                f"llama-server's {where} answer has no '{'.'.join(keys)}': {str(answer)[:160]}",
                fix="use a llama-server from llama.cpp b6000 or later",
            )
        value = value[key]
    return value


class ServerProcess:
    """A llama-server kvguard started: health-checked, its log kept, stopped on close."""

    def __init__(
        self, binary: Path, model_path: Path, settings: ServerSettings, options: EngineOptions
    ) -> None:
        self.settings = settings
        # Everything that can refuse is read before the process exists, so nothing leaks.
        timeout = seconds_from_env(REQUEST_TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT)
        start_timeout = seconds_from_env(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT)
        # Kept open while the server runs: its log is read for sizes and quoted in errors.
        self.log: IO[bytes] = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="kvguard-llama-server-", suffix=".log"
        )
        # Slots can be erased (and saved) only with a save path.
        self.slot_dir = tempfile.TemporaryDirectory(prefix="kvguard-llama-server-slots-")
        port = _free_port()
        # --cache-ram 0: no host-memory prompt cache, so a slot reuses only what it holds.
        # --log-verbosity 4: llama.cpp's buffer sizes and the checkpoints reach the log.
        command = [str(binary), "--model", str(model_path), "--host", "127.0.0.1",
                   "--port", str(port), "--threads", str(options.n_threads),
                   "--n-gpu-layers", str(options.n_gpu_layers), "--cache-ram", "0",
                   "--metrics", "--slots", "--no-webui", "--no-warmup",
                   "--no-prefill-assistant", "--slot-save-path", self.slot_dir.name,
                   "--log-verbosity", "4",
                   *settings.args()]  # fmt: skip
        self.command = command
        try:
            self.process = _spawn(command, self.log)
        except OSError as exc:
            self.log.close()
            self.slot_dir.cleanup()
            raise cannot_start(binary, exc.strerror or str(exc)) from None
        self.http = Http(
            f"http://127.0.0.1:{port}", timeout, alive=lambda: self.check_alive(grace=2.0)
        )
        try:
            self._wait_healthy(start_timeout)
            self._check_it_is_ours(model_path)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.http.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"  # 503 while the model loads
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                last = str(getattr(exc, "reason", exc))
            time.sleep(0.1)
        raise EngineError(
            f"llama-server did not become healthy within {timeout:.0f} s (last: {last}); "
            f"its log ends: {self.log_tail()}",
            fix=f"raise ${START_TIMEOUT_ENV}, or run the command by hand: {' '.join(self.command)}",
        )

    def _check_it_is_ours(self, model_path: Path) -> None:
        """The port was free when chosen, yet another server could have taken it since: make
        sure the one answering is this process, serving this model."""
        self.check_alive(grace=0.3)
        props = self.http.get("/props", timeout=30)
        served = props.get("model_path") if isinstance(props, dict) else None
        if served != str(model_path):
            raise EngineError(
                f"another server answered on {self.http.url} (serving {served!r}), not the "
                "llama-server kvguard started",
                fix="run the check again (the port is chosen anew each time)",
            )

    def check_alive(self, grace: float = 0.0) -> None:
        """Raise, quoting the log, if the server has exited (waiting up to ``grace`` seconds
        for an exit a dropped connection suggests)."""
        code = self.process.poll()
        if code is None and grace:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.process.wait(timeout=grace)
        if code is not None:
            how = f"signal {-code}" if code < 0 else f"code {code}"
            raise EngineError(
                f"llama-server (pid {self.process.pid}) exited with {how}; its log ends: "
                f"{self.log_tail()}",
                fix="see the log above; the server's command was: " + " ".join(self.command),
            )

    def log_text(self) -> str:
        with open(self.log.name, "rb") as log:
            return log.read().decode("utf-8", "replace")

    def log_tail(self, lines: int = 3) -> str:
        tail = [line.strip() for line in self.log_text().strip().splitlines()[-lines:]]
        return " | ".join(tail) or "(empty)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        self.slot_dir.cleanup()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None
"""Looked up before any fork: the child of a threaded process should not load libraries."""


_SETPRIV = shutil.which("setpriv") if _PRCTL is not None else None


def cannot_start(binary: object, reason: str) -> KvguardError:
    return KvguardError(
        f"llama-server {binary} could not be started: {reason}",
        fix=f"build it with `bash .ci/install`, or point ${BINARY_ENV} at a working one",
    )


"""util-linux's setpriv, which sets the parent-death signal and execs the server."""


_PROGRAM_MAGIC = (b"\x7fELF", b"#!", b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe")
"""How an executable starts: ELF, a script, Mach-O (64-bit, universal)."""


def _check_executable(path: str) -> None:
    """Raise the OSError exec would: setpriv execs the server with execvp, which runs a file
    that is not a program through /bin/sh instead of failing, so the error is found here."""
    with open(path, "rb") as program:  # a missing file: FileNotFoundError, as exec says
        start = program.read(4)
    if not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    if not start.startswith(_PROGRAM_MAGIC):
        raise OSError(errno.ENOEXEC, os.strerror(errno.ENOEXEC), path)


def _spawn(command: list[str], log: Any) -> subprocess.Popen[bytes]:
    """Start the server, to get SIGTERM when the process that started it dies (Linux).

    Through ``setpriv --pdeathsig`` where it exists: then Python starts it without a plain
    fork, so no fork handlers run. An engine worker that ran mlx has OpenBLAS's handler
    registered, and forking there hung in it twice in a quick-gate run (inside ``fork()``, in
    ``libopenblasp``), before the server was ever started. Elsewhere, a fork with
    ``_die_with_parent`` (or a plain start where there is no prctl, as on macOS).
    """
    streams: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": log,
                               "stderr": subprocess.STDOUT}  # fmt: skip
    if _SETPRIV is not None:
        _check_executable(command[0])
        # No preexec_fn: subprocess starts it with vfork (CPython 3.10+ on Linux), which runs
        # no fork handlers; close_fds keeps the worker's pipes to pytest out of the server.
        return subprocess.Popen([_SETPRIV, "--pdeathsig", "TERM", *command], **streams)
    return subprocess.Popen(
        command, preexec_fn=_die_with_parent if _PRCTL is not None else None, **streams
    )


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the process that started it dies (a crashed engine
    worker leaves no server behind)."""
    pr_set_pdeathsig = 1
    assert _PRCTL is not None
    _PRCTL(pr_set_pdeathsig, signal.SIGTERM)


@functools.cache
def binary_version() -> str | None:
    """``llama-server --version`` of the binary kvguard would start; None where there is none."""
    try:
        binary = find_binary()
        done = subprocess.run([str(binary), "--version"], capture_output=True, timeout=10,
                              check=False)  # fmt: skip
    except (KvguardError, OSError, subprocess.TimeoutExpired):
        return None
    output = (done.stdout + done.stderr).decode("utf-8", "replace")
    found = re.search(r"version: ([^\n]+)", output)
    return found.group(1) if found else "unknown"


def chat_ids_of(http: Http, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """A llama-server's own chat path for ``messages``: ``/apply-template`` (its template, the
    generation prompt added) and ``/tokenize`` with special tokens parsed and BOS as the
    vocabulary says, as ``/v1/chat/completions`` tokenizes the prompt it renders."""
    body: dict[str, Any] = {"messages": list(messages), "add_generation_prompt": True}
    prompt = field(http.post("/apply-template", body), "prompt", where="/apply-template")
    body = {"content": str(prompt), "add_special": True, "parse_special": True}
    tokens = field(http.post("/tokenize", body), "tokens", where="/tokenize")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise EngineError(f"llama-server's /tokenize gave no list of ids: {str(tokens)[:120]}")
    return tokens


def own_template(url: str) -> KvguardError:
    """A chat template given for a llama-server kvguard did not start."""
    return KvguardError(
        f"the llama-server at {url} applies the chat template it was started with; kvguard "
        "cannot hand it another",
        fix="start it with --jinja --chat-template-file FILE and drop params.chat_template",
        key="params.chat_template",
    )
