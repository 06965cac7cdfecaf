"""The engine worker's main: ``main()`` with the two pipe ends READ_FD WRITE_FD as arguments.

Started by ``workers.EngineWorker``; not a command for users. It receives the folders the
pytest process imports from outside its environment and a ``WorkerSetup`` (it answers
``("ready",)``), then ``("run", check)`` requests, each of them perhaps after a ``("plan",
checks)`` (more checks it will be sent, so runs of several checks can decode together; no
answer), and
answers each with ``("say", line, detail)`` progress lines (and ``("grouped",)`` before it
decodes other checks' policies together with the check's) followed by ``("outcome",
outcome)``, ``("error", KvguardError)`` (something the user can fix) or ``("bug", summary,
traceback)`` (any other exception). Engines load once and stay
loaded; runs are shared across checks as they were in one pytest process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection


def serve(receive: Connection, send: Connection) -> None:
    from pytest_kvguard import engines, scenarios
    from pytest_kvguard.core.errors import KvguardError
    from pytest_kvguard.gate.faults import inject
    from pytest_kvguard.gate.runner import Runner, run_check
    from pytest_kvguard.isolation.workers import WorkerSetup

    setup: WorkerSetup = receive.recv()
    # The registries as the pytest process has them: a test may add a toy engine or scenario,
    # and an environment kvguard env made has no kvguard distribution to read entry points of.
    engines.ENGINES.adopt(setup.engines)
    scenarios.SCENARIOS.update(setup.scenarios)
    send.send(("ready",))

    def say(line: str, detail: bool = False) -> None:
        send.send(("say", line, detail))

    runner = Runner(setup.options, say)
    # Before decoding other checks' policies with the one asked for: if the worker dies now,
    # the pytest process runs the check again alone.
    runner.on_group = lambda: send.send(("grouped",))
    with contextlib.ExitStack() as stack:
        stack.callback(runner.close)
        if setup.fault:
            stack.enter_context(inject(setup.fault))
        while True:
            try:
                request = receive.recv()
            except EOFError:
                return  # the pytest process went away
            if request[0] == "close":
                return
            if request[0] == "plan":  # more checks this worker will be sent
                runner.plan(request[1])
                continue
            try:
                outcome = run_check(runner, request[1])
            except KvguardError as exc:
                send.send(("error", exc))
            except Exception as exc:  # noqa: BLE001 - the check's error, with its traceback
                text = "".join(traceback.format_exception(exc)).rstrip()
                send.send(("bug", f"{type(exc).__name__}: {exc}", text))
            else:
                send.send(("outcome", outcome))


def _exit_with_parent() -> None:
    """A worker stuck in an engine call must not outlive a pytest process that was killed."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kvguard-parent-watch", daemon=True).start()


def main() -> None:
    _exit_with_parent()
    receive = Connection(int(sys.argv[1]), writable=False)
    send = Connection(int(sys.argv[2]), readable=False)
    try:
        # Before the setup: unpickling it may need the modules of pytest's own folders.
        import_path = receive.recv()
        sys.path[:0] = [p for p in import_path if p not in sys.path]
        serve(receive, send)
    finally:
        send.close()


if __name__ == "__main__":
    main()
