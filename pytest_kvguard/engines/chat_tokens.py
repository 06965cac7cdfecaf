"""Where two GGUF models' chat ids differ, as llama-cpp-python's chat call makes them (a
vocabulary-only load, so no weights): the model preview's and ``kvguard model-facts``' line."""

from __future__ import annotations

from pathlib import Path

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.inputs.model_facts import ModelFacts

CHAT_TOKENS = 200


def chat_token_line(before: ModelFacts, after: ModelFacts, count: int = CHAT_TOKENS) -> str | None:
    """Where the bundled chat's ids, as llama-cpp-python's chat call makes them for each model
    (its template, the generation prompt, special tokens parsed), first differ in their first
    ``count`` tokens (compared as text, since two vocabularies number tokens differently);
    None where that cannot be told here."""
    paths = (before.path, after.path)
    if count <= 0 or not all(p.is_file() for p in paths):
        return None
    from pytest_kvguard.inputs.chats import (
        DEFAULT_CHAT,
        NoChatTemplate,
        history,
        load_conversation,
    )

    label = f"{DEFAULT_CHAT} chat, first {count} tokens of the chat call"
    try:
        from pytest_kvguard.engines.gguf_vocab import GgufVocab
    except ImportError:  # llama-cpp-python is optional
        return None
    except (RuntimeError, OSError) as exc:  # installed, but its library does not load
        return f"{label}: not compared (llama-cpp-python does not load: {exc})"
    messages = history(load_conversation(DEFAULT_CHAT, Path.cwd()))
    pieces = []
    try:
        for path in paths:
            vocab = GgufVocab(path)
            ids = vocab.chat_ids(messages)
            pieces.append([vocab.token_piece(t) for t in ids])
    except NoChatTemplate:
        return f"{label}: not compared ({path.name} carries no chat template)"
    except EngineError as exc:  # a file with no usable vocabulary still has its facts
        return f"{label}: not compared ({exc})"
    first, second = (p[:count] for p in pieces)
    if first == second:
        return f"{label}: the same"
    at = next((i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y), None)
    if at is None:
        return f"{label}: one is a prefix of the other ({len(first)} and {len(second)} tokens)"
    differ = sum(x != y for x, y in zip(first, second, strict=False)) + abs(
        len(first) - len(second)
    )
    return (
        f"{label}: {differ} positions differ, the first at token {at}: "
        f"{first[at]!r} -> {second[at]!r}"
    )
