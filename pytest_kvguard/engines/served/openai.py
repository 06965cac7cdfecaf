"""Engine adapter ``openai``: an OpenAI-compatible server already running at a URL.

vLLM, SGLang and llama-server all serve ``/v1/completions`` and report how many prompt tokens
their prefix cache served in ``usage.prompt_tokens_details.cached_tokens``. kvguard sends the
first prompt and then the follow-up as token ids (``prompt: [ids]``, ``max_tokens: 1``) and
reads reused = ``cached_tokens``, re-prefilled = ``prompt_tokens - cached_tokens``.

The token ids come from the server itself, so they are the ids it caches. Which endpoint gives
them depends on the server, named by ``/v1/models`` (``owned_by``):

- ``llamacpp``: ``/apply-template`` renders the chat with the generation prompt, ``/tokenize``
  tokenizes it with special tokens parsed, as ``/v1/chat/completions`` does and as the
  ``llama_server`` engine asks for them.
- ``vllm``: ``/tokenize`` with ``messages`` renders and tokenizes in one call.
- ``sglang``: its ``/tokenize`` takes text only, and nothing renders a chat without generating,
  so edit_replay is refused with that reason.

Only the llama.cpp dialect runs on this project's machines (tests start a real llama-server);
the vLLM and SGLang paths are written to their documented APIs and untested here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pytest_kvguard.core.errors import EngineError, KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.options import EngineOptions
from pytest_kvguard.engines.protocols import Prompt, Reuse
from pytest_kvguard.engines.served.process import (
    DEFAULT_REQUEST_TIMEOUT,
    REQUEST_TIMEOUT_ENV,
    Http,
    chat_ids_of,
    own_template,
    seconds_from_env,
)
from pytest_kvguard.inputs.chats import ChatTemplate

CACHE_REPORT_FLAGS = {
    "vllm": "start vLLM with --enable-prompt-tokens-details (and prefix caching on, its default)",
    "sglang": "start SGLang with --enable-cache-report",
}
"""What makes each server report cached_tokens where it does not by default."""


def load(target: object, options: EngineOptions) -> OpenAIServerEngine:
    return OpenAIServerEngine(str(target), options)


def answer_field(answer: Any, *keys: str, where: str) -> Any:
    """``answer[k1][k2]...``, or an error naming what the server left out."""
    value = answer
    for key in keys:
        if not isinstance(value, Mapping) or key not in value:
            raise EngineError(f"the server's {where} answer has no '{'.'.join(keys)}': "
                              f"{str(answer)[:160]}")  # fmt: skip
        value = value[key]
    return value


def token_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise EngineError(f"the server's {where} gave no list of token ids: {str(value)[:120]}")
    return value


class OpenAIServerEngine:
    """A running OpenAI-compatible server: edit_replay counts from its usage report."""

    name = "openai"
    kv_element_bytes = math.nan
    """Unknown: the server's cache type is not in its API."""

    def __init__(self, url: str, options: EngineOptions) -> None:
        if not url.startswith(("http://", "https://")):
            raise KvguardError(
                f"engine openai talks to a running server, and '{url}' is not a URL",
                fix="give model: http://HOST:PORT",
                key="model",
            )
        self.url = url.rstrip("/")
        self.http = Http(self.url, seconds_from_env(REQUEST_TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT),
                         server="OpenAI-compatible server")  # fmt: skip
        self._served: tuple[str, str] | None = None

    def served(self) -> tuple[str, str]:
        """(model id, server kind) from ``/v1/models``: the first model and its owned_by."""
        if self._served is None:
            models = answer_field(self.http.get("/v1/models"), "data", where="/v1/models")
            if not isinstance(models, list) or not models or not isinstance(models[0], Mapping):
                raise EngineError(f"the server at {self.url} lists no model in /v1/models")
            model = models[0]
            self._served = (str(model.get("id", "")), str(model.get("owned_by", "")))
        return self._served

    @property
    def dialect(self) -> str:
        return self.served()[1]

    def version(self) -> str:
        """llama-server's build (/props), vLLM's release (/version); else unknown."""
        path, key = {"llamacpp": ("/props", "build_info"), "vllm": ("/version", "version")}.get(
            self.dialect, ("", "")
        )
        answer = self.http.get(path) if path else None
        return str(answer.get(key, "unknown")) if isinstance(answer, Mapping) else "unknown"

    def describe(self) -> dict[str, str]:
        model, kind = self.served()
        return {"engine": f"{kind or 'openai'} {self.version()}", "url": self.url, "model": model}

    # -- text ------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        if self.dialect == "llamacpp":
            body: dict[str, Any] = {"content": text, "add_special": True, "parse_special": False}
        else:
            body = {"model": self.served()[0], "prompt": text, "add_special_tokens": True}
        return token_list(answer_field(self.http.post("/tokenize", body), "tokens",
                                       where="/tokenize"), "/tokenize")  # fmt: skip

    def chat_ids(
        self, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None = None
    ) -> list[int]:
        """The chat's ids as the server's own chat path makes them, the generation prompt
        added: llama-server's ``/apply-template`` then ``/tokenize`` with special tokens
        parsed; vLLM's ``/tokenize`` of the messages (one call, its template and tokenizer)."""
        if self.dialect == "llamacpp":
            if template is not None:
                raise own_template(self.url)
            return chat_ids_of(self.http, messages)
        if self.dialect == "vllm":
            body = {"model": self.served()[0], "messages": list(messages),
                    "add_generation_prompt": True, "add_special_tokens": False}  # fmt: skip
            if template is not None:
                body["chat_template"] = template.source
        else:
            raise self._no_rendering()
        return token_list(answer_field(self.http.post("/tokenize", body), "tokens",
                                       where="/tokenize"), "/tokenize")  # fmt: skip

    def _no_rendering(self) -> EngineError:
        kind = self.dialect or "this server"
        return EngineError(
            f"{kind} at {self.url} has no endpoint that renders a chat into token ids without "
            "generating (its /tokenize takes text), so the two prompts cannot be sent as ids",
            fix="gate this model through llama_server or vLLM, whose APIs render a chat",
        )

    # -- edit_replay -----------------------------------------------------------------------

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> OpenAIPrefixCache:
        return OpenAIPrefixCache(self)

    def open_stream(self, policy: Policy, max_tokens: int) -> Any:
        raise KvguardError(
            "an OpenAI-compatible server returns no logits for prompt tokens",
            fix="use scenario edit_replay with engine openai",
        )

    def close(self) -> None:
        pass  # the server is not ours


class OpenAIPrefixCache:
    """The server's prefix cache, seen through its usage report (``replay``, as llama_server's)."""

    def __init__(self, engine: OpenAIServerEngine) -> None:
        self.engine = engine

    def _complete(self, token_ids: Sequence[int]) -> int | None:
        """Send the ids as a prompt, generate one token: the cached tokens the server reports
        (None where it reports none)."""
        body = {"model": self.engine.served()[0], "prompt": list(token_ids), "max_tokens": 1,
                "temperature": 0.0}  # fmt: skip
        usage = answer_field(self.engine.http.post("/v1/completions", body), "usage",
                             where="/v1/completions")  # fmt: skip
        prompt = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        if prompt != len(token_ids):
            raise EngineError(
                f"the server counted {prompt} prompt tokens for {len(token_ids)} token ids sent",
            )
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        if cached is not None and not isinstance(cached, int):
            raise EngineError(f"the server's cached_tokens is not a count: {cached!r:.60}")
        return cached

    def request(self, prompt: Prompt) -> None:
        self._complete(prompt.ids)  # a cold prompt may report nothing cached, or nothing at all

    def replay(self, prompt: Prompt, reply: Sequence[int]) -> Reuse:
        """Reused and re-prefilled for the follow-up; no checkpoint figure, and no scores: the
        reply is not sent (forcing tokens is not part of the OpenAI API)."""
        token_ids = prompt.ids
        cached = self._complete(token_ids)
        if cached is None:
            # Some vLLM releases leave the details out when nothing was cached: the same
            # prompt again must now be cached, so a second silence means no report at all.
            if self._complete(token_ids) is None:
                raise EngineError(
                    f"the server at {self.engine.url} reports no "
                    "usage.prompt_tokens_details.cached_tokens",
                    fix=CACHE_REPORT_FLAGS.get(self.engine.dialect, "enable its cache report"),
                )
            cached = 0
        return Reuse(cached, len(token_ids) - cached, None, None)

    def score_fresh(self, prompt: Prompt, reply: Sequence[int], cut: int = 0) -> None:
        return None

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        raise EngineError("a server is sent requests: use request()")

    def memory_bytes(self) -> dict[str, float]:
        # Not in the API: budgets on memory are refused at parse time for a URL.
        return {"state_bytes": math.nan, "checkpoint_bytes": math.nan, "checkpoints": math.nan}

    def keep_prefix(self, n_tokens: int) -> tuple[int, int | None]:
        raise EngineError("a server decides its own reuse: use replay()")

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        raise EngineError("a server decides its own reuse: use replay()")

    def close(self) -> None:
        pass
