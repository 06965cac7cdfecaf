"""Saved llama-cpp-python states across releases: one release pickles a ``Llama.save_state()``,
another unpickles and loads it.

An app that persists a conversation stores what ``Llama.save_state`` returns, a ``LlamaState``,
pickled (``LlamaDiskCache`` does exactly that); after an upgrade the new release unpickles it
and calls ``load_state``. Run with the interpreter of the engine environment under test,
pytest_kvguard on its ``PYTHONPATH`` (``kvguard saved-cache --engine llama_cpp`` does this)::

    PYTHON -m pytest_kvguard.engines.llama_cpp.saved_state write --model M --kind K --out FILE
    PYTHON -m pytest_kvguard.engines.llama_cpp.saved_state read --model M --kind K --file FILE

``write`` sends the bundled chat's first request (edit_replay's ``history``) through this
release's ``create_chat_completion`` (one token generated) and pickles ``save_state()``, the
prompt's ids and the writer's release beside it in a JSON file. ``read`` unpickles it with this
release, ``load_state``s it into a new ``Llama`` of the same settings, and sends the chat's
appended turn through ``create_chat_completion`` with edit_replay's ``REPLY`` forced; then the
same request from an empty ``Llama`` (the reference) and from one that was sent only the
tokens the restored state let it keep (the floor), as edit_replay judges a reuse. Each prints
one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_kvguard.engines.entry_io import bundled_chat_requests, one_line, saved_cache_main

if TYPE_CHECKING:
    from pytest_kvguard.engines.llama_cpp.api_cache import CountedLlama

KINDS = {
    "full": "Llama() as a model without sliding layers gets it (SmolLM2)",
    "swa": "Llama(swa_full=False): the sliding layers' small cache (Gemma 3)",
    "swa_full": "Llama(swa_full=True): the sliding layers keep every position (Gemma 3)",
}
"""The ``Llama`` settings a state is saved and loaded with, by the name the command takes."""
DEFAULT_MESSAGES = 5
DEFAULT_REPLY_TOKENS = 128


def version() -> str:
    import importlib.metadata

    return importlib.metadata.version("llama-cpp-python")


def say(message: str) -> None:
    print(f"saved_state: llama-cpp-python {version()}: {message}", file=sys.stderr, flush=True)


class Chat:
    """The model in a ``CountedLlama`` of the kind's settings, and the chat's two requests."""

    def __init__(self, args: argparse.Namespace) -> None:
        from pytest_kvguard.engines.llama_cpp.api_cache import context_size
        from pytest_kvguard.engines.llama_cpp.engine import LlamaCppEngine
        from pytest_kvguard.engines.options import EngineOptions
        from pytest_kvguard.inputs.chats import REPLY, common_prefix
        from pytest_kvguard.inputs.models import parse_model

        path = parse_model(args.model, Path.cwd()).resolve()
        self.model_name = path.name
        self.engine = LlamaCppEngine(path, EngineOptions.from_env())
        self.first, self.followup, self.reply = bundled_chat_requests(
            self.engine, args.messages, args.chat_template, getattr(args, "reply_tokens", 0)
        )
        self.reusable = common_prefix(self.first.ids, self.followup.ids)
        """What the follow-up can reuse of the saved first request (up to its generation
        prompt)."""
        self.swa_full = {"full": None, "swa": False, "swa_full": True}[args.kind]
        # Room for the follow-up and the whole fixed reply: a state carries arrays the size of
        # its context, so the readers take the writer's (from the file's sidecar).
        self.n_ctx = context_size(len(self.followup.ids) + len(self.engine.tokenize(REPLY)))

    def load(self, n_ctx: int | None = None) -> CountedLlama:
        from pytest_kvguard.engines.llama_cpp.api_cache import CountedLlama

        return CountedLlama(self.engine, self.swa_full, n_ctx or self.n_ctx)


def write(args: argparse.Namespace) -> dict[str, Any]:
    chat = Chat(args)
    llama = chat.load()
    say(f"sending the {len(chat.first.ids)}-token first request ({args.kind})")
    started = time.perf_counter()
    llama.send(chat.first, ())
    state = llama.llm.save_state()
    data = pickle.dumps(state)
    Path(args.out).write_bytes(data)
    meta = {"ids": list(chat.first.ids), "writer": version(), "n_ctx": llama.n_ctx}
    Path(args.out + ".json").write_text(json.dumps(meta), encoding="utf-8")
    say(f"pickled {len(data):,} bytes to {args.out}")
    return {
        "llama_cpp_python": version(), "kind": args.kind, "model": chat.model_name,
        "tokens": len(chat.first.ids), "bytes": len(data),
        "state_bytes": int(state.llama_state_size),
        "seconds": round(time.perf_counter() - started, 2),
    }  # fmt: skip


def read(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from pytest_kvguard.core.scoring import floor_cuts, reuse_gap

    chat = Chat(args)
    path = Path(args.file)
    result: dict[str, Any] = {
        "llama_cpp_python": version(), "kind": args.kind, "model": chat.model_name,
        "file_bytes": path.stat().st_size if path.is_file() else None,
    }  # fmt: skip
    meta = json.loads(Path(args.file + ".json").read_text(encoding="utf-8"))
    result["writer_in_file"] = meta.get("writer")
    if meta.get("ids") != list(chat.first.ids):
        result["ids_error"] = "this release's chat call makes other ids than the writer's"
    llama = chat.load(meta.get("n_ctx"))
    say(f"unpickling and loading {path}")
    llm = llama.llm
    try:
        state = pickle.loads(path.read_bytes())  # noqa: S301 - a file this command wrote
        llm.reset()  # type: ignore[no-untyped-call]
        llm.load_state(state)
    except Exception as exc:  # whatever the engine raises is the finding: quote it
        return {**result, "loads": False, "error": one_line(exc)}
    result["loads"] = True
    say(f"replaying the appended turn and {len(chat.reply)} reply tokens on the loaded state")
    try:
        reused = np.array(llama.send(chat.followup, chat.reply))
        kept = llama.kept(chat.followup)[0]
    except Exception as exc:  # loads, but cannot be used: quote the engine
        return {**result, "replay_error": one_line(exc)}
    result.update(kept=kept, reusable=chat.reusable)
    say("the same from an empty Llama, and after the kept tokens alone (the floor)")
    fresh = np.array(llama.fresh(chat.followup, chat.reply))
    cuts = {c: np.array(llama.fresh(chat.followup, chat.reply, c))
            for c in floor_cuts(kept, len(chat.followup.ids))}  # fmt: skip
    return {**result, **reuse_gap(reused, fresh, cuts)}


def main(argv: list[str] | None = None) -> int:
    return saved_cache_main(
        argv, prog="python -m pytest_kvguard.engines.llama_cpp.saved_state", kinds=KINDS,
        defaults={"messages": DEFAULT_MESSAGES, "reply_tokens": DEFAULT_REPLY_TOKENS},
        write=write, read=read, versions=lambda: {"llama_cpp_python": version()},
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
