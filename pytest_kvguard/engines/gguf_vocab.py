"""A GGUF model's tokenizer and chat template as llama.cpp reads them (llama-cpp-python, vocab
only): the llama.cpp adapter's own, and how other engines (mlx on a GGUF) get identical ids."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp as lc

from pytest_kvguard.engines.llama_log import captured_log, init_backend
from pytest_kvguard.errors import EngineError
from pytest_kvguard.inputs.models import BUILTIN_CHAT_TEMPLATES


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


def render_chat(model: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt llama.cpp's own chat-template code renders for these messages.

    The template comes from the GGUF metadata; a model without one (the Gemma 3 base GGUF) gets
    llama.cpp's built-in template for its architecture family.
    """
    template = lc.llama_model_chat_template(model, None)
    if not template:
        arch = ctypes.create_string_buffer(64)
        lc.llama_model_meta_val_str(model, b"general.architecture", arch, 64)
        family = arch.value.decode()
        builtin = BUILTIN_CHAT_TEMPLATES.get(family)
        template = builtin.encode() if builtin else None
        if template is None:
            raise EngineError(
                f"the model has no chat template, and kvguard knows no built-in one for '{family}'",
                fix="use a model whose GGUF carries tokenizer.chat_template",
            )
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (lc.llama_chat_message * len(keep))(*[lc.llama_chat_message(r, c) for r, c in keep])
    size = 2 * sum(len(c) for _, c in keep) + 4096
    for _ in range(2):
        buffer = ctypes.create_string_buffer(size)
        n = lc.llama_chat_apply_template(template, chat, len(keep), False, buffer, size)
        if n < 0:
            raise EngineError("llama.cpp could not apply the chat template")
        if n <= size:
            return buffer.raw[:n].decode("utf-8")
        size = n
    raise EngineError("chat template output did not fit")


def bos_id(vocab: Any) -> int | None:
    """The vocabulary's BOS token; None where it has none."""
    bos = int(lc.llama_vocab_bos(vocab))
    return None if bos < 0 else bos


def token_piece(vocab: Any, token_id: int) -> str:
    """The token's text, special tokens spelt out (``<bos>``)."""
    buffer = ctypes.create_string_buffer(256)
    n = lc.llama_token_to_piece(vocab, token_id, buffer, 256, 0, True)
    return buffer.raw[: max(n, 0)].decode("utf-8", errors="replace")


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

    def tokenize(self, text: str) -> list[int]:
        return tokenize(self.vocab, text)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return render_chat(self.model, messages)

    @property
    def bos_id(self) -> int | None:
        return bos_id(self.vocab)

    def token_piece(self, token_id: int) -> str:
        return token_piece(self.vocab, token_id)

    def __del__(self) -> None:
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
