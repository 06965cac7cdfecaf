"""What an engine entry point run in another interpreter needs (``kvguard saved-cache``'s
writers and readers): a one-line error, stdout kept for the one JSON result, and the
``write`` / ``read`` command line both engines' entry points share."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_kvguard.engines.protocols import Prompt


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as the one line a table can quote: ``ValueError: too many values``."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def stdout_for_json() -> Iterator[Callable[[str], None]]:
    """Everything the engine prints goes to stderr; the JSON alone goes to stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)

    def emit(text: str) -> None:
        os.write(saved, text.encode())

    try:
        yield emit
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def saved_cache_main(
    argv: list[str] | None,
    *,
    prog: str,
    kinds: Iterable[str],
    defaults: Mapping[str, int],
    write: Callable[[argparse.Namespace], dict[str, Any]],
    read: Callable[[argparse.Namespace], dict[str, Any]],
    versions: Callable[[], dict[str, Any]],
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda sub: None,
) -> int:
    """A saved-cache entry point's ``write --out`` / ``read --file``: the chat and model
    arguments both engines take (``defaults``: ``messages`` and ``reply_tokens``), the
    engine's own (``add_arguments``), and the result as one JSON line on stdout, an error
    included (exit 1), never a traceback."""
    parser = argparse.ArgumentParser(prog=prog)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("write", "read"):
        sub = commands.add_parser(name)
        sub.add_argument("--model", required=True, help="a bundled model name or a GGUF path")
        sub.add_argument("--kind", required=True, choices=sorted(kinds))
        add_arguments(sub)
        sub.add_argument("--messages", type=int, default=defaults["messages"])
        sub.add_argument("--chat-template", default=None, help="a bundled name or a Jinja file")
        if name == "write":
            sub.add_argument("--out", required=True)
        else:
            sub.add_argument("--file", required=True)
            sub.add_argument("--reply-tokens", type=int, default=defaults["reply_tokens"])
    args = parser.parse_args(argv)
    with stdout_for_json() as emit:
        try:
            result = write(args) if args.command == "write" else read(args)
            code = 0
        except Exception as exc:  # one line for the caller, never a traceback
            result, code = {**versions(), "error": one_line(exc)}, 1
        emit(json.dumps(result) + "\n")
    return code


def bundled_chat_requests(
    engine: Any, messages: int, chat_template: str | None, reply_tokens: int
) -> tuple[Prompt, Prompt, list[int]]:
    """The bundled chat's first ``messages`` as an app sends them to ``engine``: the first
    request, the follow-up (a message appended), and the forced reply's ids."""
    from pytest_kvguard.engines.protocols import Prompt
    from pytest_kvguard.inputs.chats import (
        DEFAULT_CHAT,
        followup,
        history,
        load_chat_template,
        load_conversation,
        reply_ids,
    )

    template = None if chat_template is None else load_chat_template(chat_template, Path.cwd())
    conversation = load_conversation(DEFAULT_CHAT, Path.cwd()).first(messages)
    first, then = (
        Prompt(tuple(engine.chat_ids(chat, template)), tuple(chat), template)
        for chat in (history(conversation), followup(conversation, "append", None))
    )  # fmt: skip
    return first, then, reply_ids(engine.tokenize, reply_tokens)
