"""Engine workers: every engine runs in a process kvguard starts, never in the pytest process.

One worker per engine environment (a Python interpreter) and side (the run judged, or the
other run of an upgrade preview), reused across checks so models stay loaded and runs shared
by several checks are computed once. A worker that dies (SIGILL, SIGSEGV, an abort) or runs
past a check's time limit costs that one check: it becomes an ERROR row that names the cause,
the worker is started again for the next check, and the run goes on.

Worker and pytest process talk over two pipes (``multiprocessing.connection`` framing and
pickles); the engine's own stdout and stderr go to a file whose tail a death message quotes.
The worker always runs this very copy of pytest_kvguard (a link to it goes first on PYTHONPATH):
another environment supplies the engine and its dependencies, not kvguard's protocol.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import ENGINES, EngineInfo, EngineOptions
from pytest_kvguard.gate.outcome import Outcome
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import Check

PACKAGE = Path(__file__).resolve().parents[1]
START_SECONDS = 300.0
"""How long a worker may take to import kvguard and read its setup before it counts as broken."""
WORKER_MAIN = (
    "import sys; del sys.path[0]; "  # not the current folder: it may hold another pytest_kvguard
    "from pytest_kvguard.isolation.engine_worker import main; main()"
)
STDERR_TAIL_LINES = 8


class WorkerError(KvguardError):
    """A check's engine worker failed it in a way only the worker can tell: ``detail`` (a
    traceback, the engine's last words) belongs in the failure, not in the report's row."""

    def __init__(self, message: str, *, fix: str | None = None, detail: str = "") -> None:
        super().__init__(message, fix=fix)
        self.detail = detail


class WorkerLost(WorkerError):
    """The worker running a check died or was killed: the check is lost, the run goes on."""


def failure_text(error: KvguardError, headline: str | None = None) -> str:
    """The error (or ``headline`` in its place), and below it a worker's detail: a traceback,
    the engine's last words."""
    detail = error.detail if isinstance(error, WorkerError) else ""
    first = str(error) if headline is None else headline
    return f"{first}\n{detail}" if detail else first


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs before its first check, sent once when it starts."""

    options: EngineOptions
    fault: str | None = None
    """A fault from ``gate.faults`` to run every check under (--kvguard-inject-fault)."""
    engines: dict[str, EngineInfo] = field(default_factory=lambda: dict(ENGINES))
    scenarios: dict[str, Any] = field(default_factory=lambda: dict(SCENARIOS))
    """The registries as this pytest process has them (a test may register a toy engine)."""


@cache
def package_path() -> str:
    """A folder holding only this pytest_kvguard (a link to it): first on every worker's
    PYTHONPATH. Not the folder it sits in, which may be this environment's site-packages: another
    environment's worker would import this one's engine from there."""
    folder = tempfile.mkdtemp(prefix="kvguard-package-")
    os.symlink(PACKAGE, os.path.join(folder, "pytest_kvguard"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def own_import_path() -> list[str]:
    """``sys.path`` entries pytest and the project added (rootdir, a tests folder with a toy
    engine), outside this interpreter's installation. Another environment must not see this
    one's packages, editable ones included."""
    installed = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(),
                 site.getusersitepackages()}  # fmt: skip
    roots = [str(Path(p).resolve()) for p in installed if p]

    def inside(entry: str) -> bool:
        resolved = str(Path(entry).resolve())
        return any(resolved == r or resolved.startswith(r + os.sep) for r in roots)

    added_by_site = _pth_entries()
    return [p for p in sys.path
            if p and os.path.exists(p)  # not a path hook's name
            and str(Path(p).resolve()) not in added_by_site and not inside(p)]  # fmt: skip


@cache
def _pth_entries() -> frozenset[str]:
    """Folders this environment's ``.pth`` files add (editable installs): its own packages."""
    entries = set()
    for folder in [*site.getsitepackages(), site.getusersitepackages()]:
        for pth in Path(folder).glob("*.pth") if os.path.isdir(folder) else []:
            for line in pth.read_text(errors="replace").splitlines():
                if line.strip() and not line.startswith(("#", "import")):
                    entries.add(str((Path(folder) / line.strip()).resolve()))
    return frozenset(entries)


def describe_exit(returncode: int) -> str:
    """``SIGILL (illegal instruction)``, ``SIGKILL (killed; out of memory?)``, ``exit code 3``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        number = signal.Signals(-returncode)
    except ValueError:
        return f"signal {-returncode}"
    text = (signal.strsignal(number) or "").lower()
    if number == signal.SIGKILL:
        text = "killed; out of memory?"
    return f"{number.name} ({text})" if text else number.name


def _tail(log: IO[bytes]) -> str:
    log.flush()
    log.seek(0)
    lines = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
    log.seek(0, os.SEEK_END)
    return "\n".join(lines[-STDERR_TAIL_LINES:])


class EngineWorker:
    """One worker process on one interpreter; started on first use and after a loss."""

    def __init__(self, python: str, setup: WorkerSetup, say: Callable[[str, bool], None]) -> None:
        self.python = python
        self.setup = setup
        self._say = say
        self._process: subprocess.Popen[bytes] | None = None
        self._send: Connection | None = None
        self._receive: Connection | None = None
        self._log: IO[bytes] | None = None
        self._busy = False
        self._grouped = False
        """Whether the check in flight decoded with other checks' policies."""
        self.plan: list[Check[Any]] | None = None
        """The session's checks this worker will be sent, told to it after each start; None:
        not known yet."""
        self._extra: list[Check[Any]] = []
        """Checks added with ``add_plan``, told to it after each start too."""
        self._unsent: list[Check[Any]] = []
        """Checks added while it runs, told to it before the next check."""

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def add_plan(self, checks: list[Check[Any]]) -> None:
        """Tell the worker of more checks it will be sent, so their runs can decode together:
        before the next check it runs (and after every start)."""
        self._extra.extend(checks)
        self._unsent.extend(checks)

    def _start(self) -> None:
        to_worker_read, to_worker_write = os.pipe()
        from_worker_read, from_worker_write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_path(), env.get("PYTHONPATH")) if p)
        # Closed in _stop(), when the worker is gone: its tail explains a death.
        self._log = tempfile.TemporaryFile(prefix="kvguard-worker-")  # noqa: SIM115
        try:
            self._process = subprocess.Popen(
                [self.python, "-c", WORKER_MAIN, str(to_worker_read), str(from_worker_write)],
                pass_fds=(to_worker_read, from_worker_write),
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=env,
            )  # fmt: skip
        except OSError as exc:
            for fd in (to_worker_read, to_worker_write, from_worker_read, from_worker_write):
                os.close(fd)
            raise KvguardError(
                f"cannot start an engine worker with {self.python}: {exc.strerror}",
                fix="pass the python of a virtual environment (kvguard env prints one)",
            ) from None
        os.close(to_worker_read)
        os.close(from_worker_write)
        self._send = Connection(to_worker_write, readable=False)
        self._receive = Connection(from_worker_read, writable=False)
        try:
            self._send.send(own_import_path())
            self._send.send(self.setup)
            ready = self._receive.poll(START_SECONDS) and self._receive.recv() == ("ready",)
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._kill()
            last_words = self._last_words()
            self._stop()
            last_line = last_words.rstrip().rpartition("\n")[2]
            raise WorkerError(
                f"the engine worker could not start with {self.python}"
                + (f": {last_line}" if last_line else ""),
                fix="check that environment has the engine and numpy, gguf, pyyaml, tabulate "
                "(kvguard env installs them)",
                detail=last_words,
            )

    def run(self, check: Check[Any], timeout: float | None) -> Outcome:
        """The check's outcome from this worker; ``WorkerLost`` when the worker does not live
        to give it, ``KvguardError`` for what the check itself got wrong.

        A worker lost while it decoded this check's policy together with other checks'
        policies (it said ``("grouped",)``) may have died of one of theirs: it is restarted
        without the plan and the check runs again alone, so a crash costs the check that
        causes it and no other.
        """
        try:
            return self._run_once(check, timeout)
        except WorkerLost:
            if not self._grouped:
                raise
            self.plan, self._extra = [], []
            return self._run_once(check, timeout)

    def _run_once(self, check: Check[Any], timeout: float | None) -> Outcome:
        if not self.alive:
            self._stop()
            self._start()
            self._unsent = [*(self.plan or []), *self._extra]
        if self._unsent:
            with contextlib.suppress(OSError):  # a dead worker: the run below says so
                self._send.send(("plan", self._unsent))  # type: ignore[union-attr]
            self._unsent = []
        assert self._send is not None and self._receive is not None
        what = f"{check.name} on {' and '.join(check.engines)}"
        self._busy = True
        self._grouped = False
        try:
            return self._exchange(check, what, timeout)
        finally:
            self._busy = False

    def _exchange(self, check: Check[Any], what: str, timeout: float | None) -> Outcome:
        assert self._send is not None and self._receive is not None
        try:
            self._send.send(("run", check))
        except OSError:
            raise self._lost(what) from None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._receive.poll(wait):
                self._kill()
                raise WorkerLost(
                    f"engine worker timed out after {timeout:g} s while running {what}; killed",
                    fix="raise the check's timeout, or find why the engine hangs",
                    detail=self._last_words(),
                )
            try:
                message = self._receive.recv()
            except (EOFError, OSError):
                raise self._lost(what) from None
            except Exception as exc:  # an answer that does not unpickle: out of step, restart
                self._kill()
                raise WorkerError(
                    f"engine worker's answer for {what} could not be read: {exc}"
                ) from None
            kind = message[0]
            if kind == "say":
                self._say(message[1], message[2])
            elif kind == "grouped":
                self._grouped = True
            elif kind == "outcome":
                outcome: Outcome = message[1]
                return outcome
            elif kind == "error":
                error: KvguardError = message[1]
                raise error
            else:  # "bug": an exception kvguard did not expect, and its traceback
                raise WorkerError(f"engine worker raised {message[1]}", detail=message[2])

    def _last_words(self) -> str:
        tail = _tail(self._log) if self._log is not None else ""
        return f"last lines the engine wrote:\n{tail}" if tail else ""

    def _lost(self, what: str) -> WorkerLost:
        assert self._process is not None
        try:
            cause = describe_exit(self._process.wait(timeout=30))
        except subprocess.TimeoutExpired:
            self._kill()
            cause = "its pipe closed, and it did not exit within 30 s (killed)"
        last_words = self._last_words()
        self._stop()
        return WorkerLost(f"engine worker died: {cause} while running {what}", detail=last_words)

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def _stop(self) -> None:
        for conn in (self._send, self._receive):
            if conn is not None:
                conn.close()
        self._send = self._receive = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._process = None

    def close(self) -> None:
        """Ask the worker to unload its engines and leave; kill it if it does not."""
        if self.alive and self._send is not None and not self._busy:
            try:
                self._send.send(("close",))
                assert self._process is not None
                self._process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()
        self._stop()


class WorkerPool:
    """The session's workers, by interpreter and side."""

    def __init__(
        self,
        options: EngineOptions,
        say: Callable[[str, bool], None],
        fault: str | None = None,
    ) -> None:
        self.options = options
        self.fault = fault
        self._say = say
        self._workers: dict[tuple[str, bool], EngineWorker] = {}

    def worker(self, python: str, *, judged: bool = True) -> EngineWorker:
        """The worker for this interpreter; ``judged=False`` for an upgrade preview's other run,
        which never runs under an injected fault."""
        # Without a fault both sides are alike: one worker (one model load) serves them.
        key = (python, judged or self.fault is None)
        if key not in self._workers:
            setup = WorkerSetup(self.options, fault=self.fault if judged else None)
            self._workers[key] = EngineWorker(python, setup, self._say)
        return self._workers[key]

    def run(
        self, check: Check[Any], python: str, timeout: float | None, *, judged: bool = True
    ) -> Outcome:
        return self.worker(python, judged=judged).run(check, timeout)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()
