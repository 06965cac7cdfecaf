"""The ids kvguard feeds for a chat are those the engines' own chat calls prefill: read back from
each engine's chat call on every bundled model, not recomputed by kvguard."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.engines.served.process import ServerSettings
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.inputs.chats import (
    ChatTemplate,
    NoChatTemplate,
    followup,
    history,
    load_chat_template,
    load_conversation,
)
from pytest_kvguard.inputs.models import ModelRef

TUTOR = load_conversation("tutor", Path(".")).first(5)
REQUESTS = {
    "history": history(TUTOR),
    "edit": followup(TUTOR, "edit", 1),
    "resend": followup(TUTOR, "resend", 3),
    "append": followup(TUTOR, "append", None),
    "regenerate": followup(TUTOR, "regenerate", None),
    "trim_reasoning": followup(TUTOR, "trim_reasoning", None),
}
BUNDLED = {"smollm2-135m": None, "gemma3-270m": "gemma3-it"}
"""Each bundled model and the chat template its chat checks give (Gemma 3's base GGUF has none)."""


def template_of(model: str) -> ChatTemplate | None:
    name = BUNDLED[model]
    return None if name is None else load_chat_template(name, Path("."))


class AppLlama:
    """llama-cpp-python's Llama as an app holds one: the template (where the check gives one)
    handed over as a Jinja2ChatFormatter chat handler, written here as an app writes it."""

    def __init__(self, model: str) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llm = Llama(str(ModelRef(model).resolve()), n_ctx=2048, verbose=False)
        template = template_of(model)
        if template is not None:
            text = self.llm.detokenize
            eos, bos = self.llm.token_eos(), self.llm.token_bos()
            self.llm.chat_handler = Jinja2ChatFormatter(
                template.source, text([eos], special=True).decode(),
                text([bos], special=True).decode(), stop_token_ids=[eos],
            ).to_chat_handler()  # fmt: skip

    def prefilled(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The ids create_chat_completion evaluated for the messages (one token generated)."""
        self.llm.reset()
        self.llm.create_chat_completion(messages=[dict(m) for m in messages], max_tokens=1)
        return [int(t) for t in self.llm.input_ids[: self.llm.n_tokens]]


@pytest.fixture(scope="module", params=sorted(BUNDLED))
def app(request: pytest.FixtureRequest) -> Iterator[tuple[str, AppLlama]]:
    llama = AppLlama(request.param)
    yield request.param, llama
    llama.llm.close()


@pytest.mark.llama_cpp
@pytest.mark.mlx
@pytest.mark.parametrize("request_name", sorted(REQUESTS))
def test_in_process_engines_feed_what_create_chat_completion_prefills(
    kvguard_runner: Runner, app: tuple[str, AppLlama], request_name: str
) -> None:
    """llama_cpp, and mlx on a GGUF (it has no mlx-lm tokenizer), against the ids the Llama
    evaluated in a real create_chat_completion of the same messages."""
    model, llama = app
    messages = REQUESTS[request_name]
    expected = llama.prefilled(messages)
    for engine in ("llama_cpp", "mlx"):
        loaded = kvguard_runner.engine(engine, ModelRef(model))
        assert loaded.chat_ids(messages, template_of(model)) == expected, (engine, model)
    # The chat's first id is the template's own special token, as an app's cache holds it.
    first = llama.llm.detokenize(expected[:2], special=True).decode()
    assert first.startswith({"smollm2-135m": "<|im_start|>", "gemma3-270m": "<bos>"}[model])


def test_special_tokens_are_parsed_and_the_generation_prompt_added(kvguard_runner: Runner) -> None:
    """SmolLM2: <|im_start|>user\\nhi<|im_end|>\\n is 6 ids parsed (the issue's measurement),
    and the request ends with the assistant's generation prompt."""
    engine = kvguard_runner.engine("llama_cpp", ModelRef("smollm2-135m"))
    ids = engine.chat_ids([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    pieces = [engine.token_piece(t) for t in ids]
    assert pieces[:3] == ["<|im_start|>", "system", "\n"]
    assert "".join(pieces[-4:]) == "<|im_start|>assistant\n"
    assert engine.tokenize("<|im_start|>user\nhi<|im_end|>\n") != [1, 4093, 198, 6004, 2, 198]
    assert ids[ids.index(4093) - 1 : ids.index(4093) + 5] == [1, 4093, 198, 6004, 2, 198]


def tutor_chat_via_openai(server: Any, messages: Sequence[Mapping[str, str]]) -> int:
    """The prompt tokens llama-server counts for the chat through /v1/chat/completions."""
    http = server.serve(None)
    answer = http.post("/v1/chat/completions", {"messages": list(messages), "max_tokens": 1,
                                                "temperature": 0.0})  # fmt: skip
    return int(answer["usage"]["prompt_tokens"])


@pytest.mark.llama_server
@pytest.mark.llama_cpp
@pytest.mark.parametrize("model", sorted(BUNDLED))
def test_llama_server_feeds_what_its_chat_completions_prefill(
    kvguard_runner: Runner, model: str
) -> None:
    """llama-server's ids (/apply-template, then /tokenize with specials parsed) against the
    prompt tokens its /v1/chat/completions counts for the same messages, on the server started
    with the check's template; and the same ids as the in-process engines."""
    server = kvguard_runner.engine("llama_server", ModelRef(model))
    in_process = kvguard_runner.engine("llama_cpp", ModelRef(model))
    template = template_of(model)
    # A context the whole chat fits in, the template the check gives (chat_ids then uses it).
    path = None if template is None else template.path
    server.serve(ServerSettings(2048, chat_template=path))
    for name, messages in REQUESTS.items():
        ids = server.chat_ids(messages, template)
        assert len(ids) == tutor_chat_via_openai(server, messages), (model, name)
        assert ids == in_process.chat_ids(messages, template), (model, name)


@pytest.mark.llama_cpp
@pytest.mark.mlx
@pytest.mark.llama_server
def test_a_model_without_a_template_is_refused_and_the_engines_fallbacks_differ(
    kvguard_runner: Runner,
) -> None:
    """The Gemma 3 base GGUF carries no chat template. Each engine's own fallback makes another
    prompt (a finding): llama-cpp-python's chat call the llama-2 [INST] format, llama.cpp's C
    template code chatml, llama-server chatml; so kvguard refuses it on every engine."""
    import llama_cpp as lc
    from llama_cpp import Llama

    model = ModelRef("gemma3-270m")
    for engine in ("llama_cpp", "mlx", "llama_server"):
        with pytest.raises(NoChatTemplate, match="carries no chat template"):
            kvguard_runner.engine(engine, model).chat_ids(REQUESTS["history"])
    llm = Llama(str(model.resolve()), vocab_only=True, verbose=False)
    assert llm.chat_format == "llama-2"
    chat = [lc.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in TUTOR_ROLES]
    array = (lc.llama_chat_message * len(chat))(*chat)
    buffer = ctypes.create_string_buffer(1 << 16)
    n = lc.llama_chat_apply_template(None, array, len(chat), True, buffer, len(buffer))
    assert buffer.raw[:n].decode().startswith("<|im_start|>system")
    llm.close()


TUTOR_ROLES = REQUESTS["history"]
