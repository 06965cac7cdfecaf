"""Engine openai: an OpenAI-compatible server at a URL, counted from its usage report.

The real test points it at a real llama-server (started by kvguard's llama_server engine, on
the bundled SmolLM2-135M): through the plugin, as a user runs it, its counts are the server's
own usage.prompt_tokens_details.cached_tokens, and they equal what the llama_server engine reads
from the same server's timings. vLLM and SGLang do not run on these machines: the stand-in
servers below check only how kvguard reads their answers and what it refuses.
"""

from __future__ import annotations

import http.server
import json
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines import EngineOptions, Prompt, load_engine
from pytest_kvguard.engines.served.llama_server import LlamaServerEngine
from pytest_kvguard.engines.served.process import ServerSettings
from pytest_kvguard.inputs.chats import (
    DEFAULT_CHAT,
    common_prefix,
    followup,
    history,
    load_conversation,
)
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.scenarios.replaying import run_edit_replay

SMOLLM2 = ModelRef("smollm2-135m")


def openai_checks(min_reused_after_edit: int, chat_messages: int | None = None) -> str:
    """Edit #-3 and append through engine openai at {url}, on the whole bundled chat or on its
    first ``chat_messages`` (the real server's slot holds 11 of them, 1,815 tokens, in 2,048)."""
    chat = f"chat_messages: {chat_messages}, " if chat_messages is not None else ""
    return f"""\
version: 1
defaults: {{{{engine: openai, model: "{{url}}"}}}}
checks:
  - name: openai-edit-end
    scenario: edit_replay
    policy: full
    params: {{{{{chat}followup: edit, message: -3}}}}
    budgets: {{{{min_reused_tokens: {min_reused_after_edit}}}}}
  - name: openai-append
    scenario: edit_replay
    policy: full
    params: {{{{{chat}followup: append}}}}
    budgets: {{{{min_reused_tokens: 1}}}}
"""


CHECKS = openai_checks(4100)
REAL_CHECKS = openai_checks(1460, chat_messages=11)


def run_gate(
    pytester: pytest.Pytester, url: str, checks: str = CHECKS
) -> tuple[pytest.RunResult, dict[str, Any]]:
    pytester.makefile(".yaml", budgets=checks.format(url=url))
    result = pytester.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "report.json")
    return result, json.loads((pytester.path / "report.json").read_text())


@pytest.mark.llama_server
def test_openai_counts_are_the_servers_usage_and_equal_its_timings(
    pytester: pytest.Pytester, smollm2_server: LlamaServerEngine
) -> None:
    """The bundled chat's first 11 messages, an edit near the end and an append, through
    /v1/completions, counted from cached_tokens, as the llama_server engine counts them from
    timings on that server."""
    http = smollm2_server.serve(ServerSettings(n_ctx=2048))
    result, report = run_gate(pytester, http.url, REAL_CHECKS)
    result.assert_outcomes(passed=2)
    rows = {row["name"]: row for row in report["checks"]}
    assert rows["openai-edit-end"]["engine_info"]["engine"].startswith("llamacpp b")

    by_url = load_engine("llama_server", http.url, EngineOptions.from_env())
    conversation = load_conversation(DEFAULT_CHAT, pytester.path).first(11)
    try:
        for name, (kind, message) in {"openai-edit-end": ("edit", -3),
                                      "openai-append": ("append", None)}.items():  # fmt: skip
            chats = (history(conversation), followup(conversation, kind, message))
            first, second = (Prompt(tuple(by_url.chat_ids(chat))) for chat in chats)
            run, _, _ = run_edit_replay(by_url, Policy("full"), first, second)
            m = rows[name]["metrics"]
            assert m["prompt_tokens"] == len(second.ids)
            assert (m["reused_tokens"], m["reprefill_tokens"]) == (
                run.replay.reused, run.replay.reprefilled)  # fmt: skip
            assert m["reused_tokens"] == m["split"] == run.replay.split  # full: all of it
    finally:
        by_url.close()  # not the engine that started it: the server stays up
    edit = rows["openai-edit-end"]["metrics"]
    assert (edit["reused_tokens"], edit["reprefill_tokens"]) == (1460, 355)  # as in process


class StandIn(http.server.BaseHTTPRequestHandler):
    """A server that answers as vLLM documents its API, with no model behind it: a chat is 8
    ids per message, and a prompt's cached tokens are its longest common prefix with any
    earlier prompt, in whole blocks, never the last token (as vLLM caches)."""

    owned_by = "vllm"
    block = 16
    reports = True
    null_when_zero = False
    """As some vLLM releases: no prompt_tokens_details at all when nothing was cached."""
    requests: list[tuple[str, dict[str, Any]]]
    seen: list[list[int]]

    def log_message(self, *args: object) -> None:
        pass

    def reply(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply({"data": [{"id": "stand-in", "owned_by": self.owned_by}]})
        else:
            self.reply({"version": "0.0-stand-in"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, body))
        if self.path == "/tokenize":
            ids = [zlib.crc32((m["role"] + m["content"]).encode()) % 50000
                   for m in body.get("messages", []) for _ in range(8)]  # fmt: skip
            self.reply({"tokens": ids, "count": len(ids), "max_model_len": 8192})
            return
        prompt = body["prompt"]
        shared = max((common_prefix(prompt, earlier) for earlier in self.seen), default=0)
        cached = min(shared, len(prompt) - 1) // self.block * self.block
        self.seen.append(prompt)
        silent = not self.reports or (cached == 0 and self.null_when_zero)
        self.reply({"usage": {"prompt_tokens": len(prompt), "completion_tokens": 1,
                              "prompt_tokens_details": None if silent
                              else {"cached_tokens": cached}}})  # fmt: skip


@pytest.fixture
def stand_in() -> Iterator[tuple[str, type[StandIn]]]:
    handler = type("Handler", (StandIn,), {"requests": [], "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


def test_vllm_is_asked_for_the_chat_ids_and_counted_from_cached_tokens(
    pytester: pytest.Pytester, stand_in: tuple[str, type[StandIn]]
) -> None:
    url, handler = stand_in
    result, report = run_gate(pytester, url)
    result.assert_outcomes(passed=1, failed=1)  # the edit's 4,100 budget is not this chat's
    for row in report["checks"]:
        m = row["metrics"]
        expected = min(m["split"], m["prompt_tokens"] - 1) // 16 * 16
        assert (m["reused_tokens"], m["reprefill_tokens"]) == (
            expected, m["prompt_tokens"] - expected)  # fmt: skip
        assert m["reused_tokens"] > 0
    tokenized = [body for path, body in handler.requests if path == "/tokenize"]
    assert tokenized and all(b["add_generation_prompt"] is True and b["model"] == "stand-in"
                             for b in tokenized)  # fmt: skip
    sent = [body for path, body in handler.requests if path == "/v1/completions"]
    assert all(b["max_tokens"] == 1 and isinstance(b["prompt"], list) for b in sent)


def test_no_report_when_nothing_was_cached_is_read_as_zero(
    pytester: pytest.Pytester, stand_in: tuple[str, type[StandIn]]
) -> None:
    """A release that leaves the details out when it cached nothing: the follow-up is sent
    once more, reported cached then, so the first silence meant 0."""
    url, handler = stand_in
    # One block of 192: the edit's 176 shared tokens fill none, its whole repeat one.
    handler.block, handler.null_when_zero = 192, True
    result, report = run_gate(pytester, url)
    rows = {row["name"]: row for row in report["checks"]}
    assert rows["openai-edit-end"]["metrics"]["split"] == 176
    assert rows["openai-edit-end"]["verdict"] == "FAIL"  # a figure, not an ERROR
    assert rows["openai-edit-end"]["metrics"]["reused_tokens"] == 0
    assert rows["openai-append"]["metrics"]["reused_tokens"] == 192
    result.assert_outcomes(passed=1, failed=1)


def test_a_server_without_its_cache_report_is_one_error_naming_the_flag(
    pytester: pytest.Pytester, stand_in: tuple[str, type[StandIn]]
) -> None:
    url, handler = stand_in
    handler.reports = False
    result, report = run_gate(pytester, url)
    result.assert_outcomes(failed=2)
    for row in report["checks"]:
        assert row["verdict"] == "ERROR"
        assert "reports no usage.prompt_tokens_details.cached_tokens" in row["error"]
        assert "--enable-prompt-tokens-details" in row["error"]


def test_a_server_that_held_the_follow_up_already_is_an_error(
    pytester: pytest.Pytester, stand_in: tuple[str, type[StandIn]]
) -> None:
    """The same checks against the same server twice: the second run's follow-ups are in its
    cache from the first, which reads as more reuse than the edit shares with its prompt."""
    url, _ = stand_in
    run_gate(pytester, url)
    result, report = run_gate(pytester, url)
    rows = {row["name"]: row for row in report["checks"]}
    assert "it held the follow-up from an earlier request" in rows["openai-edit-end"]["error"]
    # The append's follow-up starts with the whole first prompt: a cached copy reads as the
    # reuse the server would earn anyway (192 of 200 shared, in blocks), so it passes.
    assert rows["openai-append"]["verdict"] == "PASS"
    result.assert_outcomes(passed=1, failed=1)


def test_sglang_is_refused_for_want_of_a_chat_rendering_endpoint(
    pytester: pytest.Pytester, stand_in: tuple[str, type[StandIn]]
) -> None:
    url, handler = stand_in
    handler.owned_by = "sglang"
    result, report = run_gate(pytester, url)
    result.assert_outcomes(failed=2)
    for row in report["checks"]:
        assert "has no endpoint that renders a chat into token ids" in row["error"]
    assert not [path for path, _ in handler.requests if path == "/v1/completions"]
