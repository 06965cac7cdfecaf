"""A GGUF model's tokenizer and chat call as llama-cpp-python has them (vocab only): the llama.cpp
adapter's own, and how other engines (mlx on a GGUF) get identical ids. A chat's ids are those
``Llama.create_chat_completion`` prefills (``ChatCall``), read from that call itself."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp as lc

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.engines.llama_log import captured_log, init_backend
from pytest_kvguard.inputs.chats import ChatTemplate, NoChatTemplate
from pytest_kvguard.inputs.models import gguf_chat_template


def tokenize(vocab: Any, text: str) -> list[int]:
    """Token ids with BOS where the model's metadata asks for one; special tokens not parsed."""
    data = text.encode("utf-8")
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
    capacity = len(data) + 8
    buffer = (lc.llama_token * capacity)()
    n = lc.llama_tokenize(vocab, data, len(data), buffer, capacity, add_bos, False)
    if n < 0:
        raise EngineError(f"tokenizer needed {-n} slots, had {capacity}")
    return list(buffer[:n])


def chat_handler(llm: Any, template: ChatTemplate) -> Any:
    """``template`` as an app hands one to llama-cpp-python: a ``Jinja2ChatFormatter`` with the
    model's BOS and EOS texts, stopping on its EOS id (what ``Llama`` builds for a GGUF's own
    template), as the ``Llama``'s chat handler."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    eos, bos = llm.token_eos(), llm.token_bos()

    def text(token: int) -> str:
        return llm.detokenize([token], special=True).decode() if token >= 0 else ""

    formatter = Jinja2ChatFormatter(template.source, text(eos), text(bos), stop_token_ids=[eos])
    return formatter.to_chat_handler()


class _Prefilled(Exception):
    """Raised by the stand-in for ``create_completion``: the chat call got as far as its ids."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = [int(i) for i in ids]


class ChatCall:
    """llama-cpp-python's ``Llama.create_chat_completion`` as an app calls it, on a vocab-only
    ``Llama``: its own chat handler applies the template (the GGUF's, or the one given), adds
    the generation prompt and tokenizes with special tokens parsed; ``ids`` stops it where it
    hands the ids to ``create_completion`` and returns them."""

    def __init__(self, model_path: Path, template: ChatTemplate | None) -> None:
        from llama_cpp import Llama

        if template is None and gguf_chat_template(model_path) is None:
            raise NoChatTemplate(model_path.name)  # llama-cpp-python would use llama-2
        with captured_log():
            self.llm = Llama(str(model_path), vocab_only=True, verbose=False)
        if template is not None:
            self.llm.chat_handler = chat_handler(self.llm, template)

        def stop_at_prefill(*args: Any, **kwargs: Any) -> Any:
            raise _Prefilled(kwargs["prompt"] if "prompt" in kwargs else args[0])

        self.llm.create_completion = stop_at_prefill  # type: ignore[method-assign]

    def ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        try:
            self.llm.create_chat_completion(messages=[dict(m) for m in messages])  # type: ignore[misc]
        except _Prefilled as prefilled:
            return prefilled.ids
        except Exception as exc:  # the template raising (raise_exception), jinja errors
            raise EngineError(
                f"llama-cpp-python could not apply the chat template: {exc}"
            ) from None
        raise EngineError("llama-cpp-python's chat call did not reach create_completion")

    def close(self) -> None:
        self.llm.close()


def bos_id(vocab: Any) -> int | None:
    """The vocabulary's BOS token; None where it has none."""
    bos = int(lc.llama_vocab_bos(vocab))
    return None if bos < 0 else bos


def token_piece(vocab: Any, token_id: int) -> str:
    """The token's text, special tokens spelt out (``<bos>``)."""
    buffer = ctypes.create_string_buffer(256)
    n = lc.llama_token_to_piece(vocab, token_id, buffer, 256, 0, True)
    return buffer.raw[: max(n, 0)].decode("utf-8", errors="replace")


class ChatCalls:
    """One ``ChatCall`` per template for a model, made when first asked for."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.calls: dict[str | None, ChatCall] = {}

    def ids(
        self, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None
    ) -> list[int]:
        key = None if template is None else template.source
        if key not in self.calls:
            self.calls[key] = ChatCall(self.model_path, template)
        return self.calls[key].ids(messages)

    def close(self) -> None:
        for call in self.calls.values():
            call.close()
        self.calls.clear()


class GgufVocab:
    """llama.cpp's tokenizer alone (vocab-only load): how other engines get identical ids."""

    def __init__(self, model_path: Path) -> None:
        init_backend()
        params = lc.llama_model_default_params()
        params.vocab_only = True
        with captured_log() as log:
            self.model = lc.llama_model_load_from_file(str(model_path).encode(), params)
        if not self.model:
            # llama.cpp says why only in its log ("unknown model architecture: 'x'").
            why = [line.strip() for line in "".join(log).splitlines() if "error" in line]
            raise EngineError(
                f"llama.cpp could not read the vocabulary of {model_path}"
                + (f": {why[-1]}" if why else "")
            )
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.chat_calls = ChatCalls(model_path)

    def tokenize(self, text: str) -> list[int]:
        return tokenize(self.vocab, text)

    def chat_ids(
        self, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None = None
    ) -> list[int]:
        return self.chat_calls.ids(messages, template)

    @property
    def bos_id(self) -> int | None:
        return bos_id(self.vocab)

    def token_piece(self, token_id: int) -> str:
        return token_piece(self.vocab, token_id)

    def __del__(self) -> None:
        if getattr(self, "chat_calls", None):
            self.chat_calls.close()
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
