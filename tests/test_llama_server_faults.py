"""Engine llama_server when the server misbehaves: it exits at once, never becomes healthy,
answers garbage, or dies mid-check. Each costs one ERROR line per check, within its time limit,
and the run goes on. The "servers" here are small scripts standing in for the binary; the real
server's tests are in test_llama_server.py.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

TWO_CHECKS = """\
version: 1
defaults:
  engine: llama_server
  model: tiny.gguf
checks:
  - name: server-edit
    scenario: edit_replay
    policy: full
    params: {followup: edit, message: -3, chat_template: gemma3-it}
    budgets: {min_reused_tokens: 100}
  - name: server-append
    scenario: edit_replay
    policy: full
    params: {followup: append, chat_template: gemma3-it}
    budgets: {min_reused_tokens: 100}
"""

HTTP_SERVER = """\
import http.server, json, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
model = sys.argv[sys.argv.index("--model") + 1]
MODE = {mode!r}

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, body, status=200):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.answer(b'{{"status": "ok"}}')
        elif self.path == "/props":  # it is the server kvguard started, serving its model
            self.answer(json.dumps({{"model_path": model}}).encode())
        else:
            self.answer(b"<html>not a llama-server</html>")

    def do_POST(self):
        if MODE == "die":
            print("server: giving up on", self.path, flush=True)
            os._exit(7)
        if MODE == "protocol":
            self.wfile.write(b"SSH-2.0-OpenSSH\\r\\n\\r\\n")  # not HTTP at all
            return
        self.answer(b"<html>not a llama-server</html>")

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_server(folder: Path, body: str) -> Path:
    script = folder / "llama-server"
    script.write_text(body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def run_gate(gate: pytest.Pytester, binary: Path, **env: str) -> tuple[pytest.RunResult, dict]:  # type: ignore[type-arg]
    gate.makefile(".yaml", budgets=TWO_CHECKS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVGUARD_LLAMA_SERVER", str(binary))
        for key, value in env.items():
            patch.setenv(key, value)
        result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "report.json")
    report = json.loads((gate.path / "report.json").read_text())
    return result, report


def errors_of(report: dict) -> dict[str, str]:  # type: ignore[type-arg]
    rows = report["checks"]
    assert len(rows) == 2 and report["verdict"] == "fail"
    assert all(row["verdict"] == "ERROR" for row in rows), rows
    return {row["name"]: row["error"] for row in rows}


def test_a_server_that_exits_at_once_is_one_error_per_check(gate: pytest.Pytester) -> None:
    script = "#!/bin/sh\necho 'error: unknown argument: --bogus' >&2\nexit 3\n"
    binary = fake_server(gate.path, script)
    result, report = run_gate(gate, binary)
    result.assert_outcomes(failed=2)
    for error in errors_of(report).values():
        assert "llama-server" in error and "exited with code 3" in error
        assert "error: unknown argument: --bogus" in error  # the log's tail, quoted


def test_a_server_that_never_becomes_healthy_is_stopped_at_its_start_limit(
    gate: pytest.Pytester,
) -> None:
    binary = fake_server(gate.path, "#!/bin/sh\nexec sleep 600\n")
    result, report = run_gate(gate, binary, KVGUARD_SERVER_START_TIMEOUT="2")
    result.assert_outcomes(failed=2)
    for error in errors_of(report).values():
        assert "did not become healthy within 2 s" in error
        assert "KVGUARD_SERVER_START_TIMEOUT" in error


@pytest.mark.parametrize(
    ("mode", "said"),
    [("garbage", "answered something that is not JSON: '<html>"),
     ("protocol", "answered something that is not HTTP: BadStatusLine")],
)  # fmt: skip
def test_a_server_that_answers_garbage_is_one_error_per_check(
    gate: pytest.Pytester, mode: str, said: str
) -> None:
    binary = fake_server(gate.path, f"#!{sys.executable}\n" + HTTP_SERVER.format(mode=mode))
    result, report = run_gate(gate, binary)
    result.assert_outcomes(failed=2)
    for error in errors_of(report).values():
        assert said in error


def test_a_server_that_dies_mid_check_is_one_error_per_check(gate: pytest.Pytester) -> None:
    binary = fake_server(gate.path, f"#!{sys.executable}\n" + HTTP_SERVER.format(mode="die"))
    result, report = run_gate(gate, binary)
    result.assert_outcomes(failed=2)
    for error in errors_of(report).values():
        assert "exited with code 7" in error and "server: giving up on" in error


def test_a_binary_that_is_not_there_is_one_error_per_check(gate: pytest.Pytester) -> None:
    result, report = run_gate(gate, gate.path / "no-such-llama-server")
    result.assert_outcomes(failed=2)
    for error in errors_of(report).values():
        assert "KVGUARD_LLAMA_SERVER" in error and "is not an executable file" in error


def test_a_binary_that_cannot_run_is_one_error_per_check(gate: pytest.Pytester) -> None:
    binary = fake_server(gate.path, "not a program\n")  # executable, yet no interpreter line
    result, report = run_gate(gate, binary)
    result.assert_outcomes(failed=2)
    for error in errors_of(report).values():
        assert "could not be started: Exec format error" in error and ".ci/install" in error


def test_a_url_is_a_model_only_for_a_server_engine(gate: pytest.Pytester) -> None:
    gate.makefile(".yaml", budgets=TWO_CHECKS.replace("llama_server", "fake").replace(
        "tiny.gguf", "http://127.0.0.1:9"))  # fmt: skip
    result = gate.runpytest("--kvguard", "budgets.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*budgets.yaml:*engine 'fake' cannot load a model url*"
                                 "(a URL is for engines llama_server and openai)*"])  # fmt: skip
