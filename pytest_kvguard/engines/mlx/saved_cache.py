"""Saved mlx-lm prompt caches across releases: one release writes the file, another reads it.

Run with the interpreter of the engine environment under test, pytest_kvguard on its
``PYTHONPATH`` (as kvguard's engine workers have it; ``kvguard saved-cache`` does this)::

    PYTHON -m pytest_kvguard.engines.mlx.saved_cache write --model M --kind K --out FILE
    PYTHON -m pytest_kvguard.engines.mlx.saved_cache read --model M --kind K --file FILE

``write`` prefills the bundled chat's first request (edit_replay's ``history``, its first
``--messages`` messages, as the engine's chat call makes its ids), up to where the appended
turn's request parts from it, into a cache of kind K as ``mlx_lm.cache_prompt`` does
(``generate_step(max_tokens=0)``), and saves it with this release's ``save_prompt_cache``, the
token ids in its metadata. ``read`` loads the file with this release's ``load_prompt_cache``.
Where that works it feeds the appended turn's new tokens on the loaded cache with
``generate_step`` and forces edit_replay's ``REPLY`` through a logits processor that records
-log p of each forced token from the raw logits; then it does the same on a fresh cache of the
same kind, prefilled here through the same calls (the chat, then the new tokens), so the only
difference left is the file. Each prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_kvguard.engines.entry_io import bundled_chat_requests, one_line, saved_cache_main

KINDS = {
    "plain": "KVCache on every layer (policy full)",
    "rotating": "RotatingKVCache(max_size=cap, keep=sinks) on every layer (policy sink)",
    "model": "the model's own make_cache() (Gemma 3: RotatingKVCache(512) on 5 of 6 layers)",
}
"""The cache kinds a file can hold, by the name the command line takes."""
DEFAULT_CAP = 256
DEFAULT_SINKS = 4
DEFAULT_MESSAGES = 5
"""The bundled chat's first 5 messages: 756 cached tokens on SmolLM2, 716 on Gemma 3 (its
gemma3-it template), past both a 256-entry rotating cache and Gemma 3's 512-token window, so
every rotating layer has wrapped."""
DEFAULT_REPLY_TOKENS = 64
PREFILL_STEP = 2048
"""``generate_step``'s prefill_step_size, pinned: a release's default does not move the chunks."""
TOKEN_IDS_KEY = "kvguard_token_ids"
"""The metadata entry holding the cached token ids (JSON), as ``cache_prompt`` saves its own."""
WRITER_KEY = "kvguard_mlx_lm"
"""The metadata entry naming the mlx-lm release that wrote the file."""


def versions() -> dict[str, str]:
    """The engine's versions, and the BLAS mlx runs on where the adapter has loaded."""
    found = {}
    for name in ("mlx-lm", "mlx"):
        try:
            found[name.replace("-", "_")] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name.replace("-", "_")] = "not installed"
    blas = sys.modules.get("pytest_kvguard.engines.mlx.blas")
    if blas is not None:
        found["blas"] = blas.preload_openblas()
    return found


def say(message: str) -> None:
    print(f"saved_cache: mlx-lm {versions()['mlx_lm']}: {message}", file=sys.stderr, flush=True)


class Chat:
    """The model and the token ids a check needs: the cached prompt, the follow-up, the reply."""

    def __init__(
        self, model: str, messages: int, reply_tokens: int, chat_template: str | None = None
    ) -> None:
        # The adapter preloads OpenBLAS before mlx; import it first.
        from pytest_kvguard.engines.mlx.engine import MlxEngine
        from pytest_kvguard.engines.options import EngineOptions
        from pytest_kvguard.inputs.chats import common_prefix
        from pytest_kvguard.inputs.models import parse_model

        path = parse_model(model, Path.cwd()).resolve()
        self.model_name = path.name
        self.engine = MlxEngine(path, EngineOptions.from_env())
        first, then, self.reply = bundled_chat_requests(
            self.engine, messages, chat_template, reply_tokens
        )
        self.followup = list(then.ids)
        # What a cache of the first request holds that the next one can use: the two requests'
        # ids up to where the first one's generation prompt and the new turn part.
        self.cached = self.followup[: common_prefix(first.ids, self.followup)]

    def new_caches(self, kind: str, cap: int, sinks: int) -> list[Any]:
        from pytest_kvguard.core.policies import Policy
        from pytest_kvguard.engines.mlx.caches import make_caches

        policy = {
            "plain": Policy("full"),
            "rotating": Policy("sink", cap=cap, sinks=sinks),
            "model": Policy("swa"),
        }[kind]
        return make_caches(self.engine.model, policy)

    def prefill(self, caches: list[Any]) -> None:
        """The cached prompt into the caches, as ``mlx_lm.cache_prompt`` fills them."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        steps = generate_step(
            mx.array(self.cached), self.engine.model, max_tokens=0, prompt_cache=caches,
            prefill_step_size=PREFILL_STEP,
        )  # fmt: skip
        for _ in steps:
            pass

    def score_reply(self, caches: list[Any]) -> Any:
        """The follow-up's new tokens on the caches, then the forced reply: -log p of each
        reply token, from the logits the model gave before any processing."""
        import mlx.core as mx
        import numpy as np
        from mlx_lm.generate import generate_step

        forced = ForcedReply(self.reply)
        steps = generate_step(
            mx.array(self.followup[len(self.cached) :]), self.engine.model,
            max_tokens=len(self.reply), prompt_cache=caches, logits_processors=[forced],
            prefill_step_size=PREFILL_STEP,
        )  # fmt: skip
        for k, (token, _) in enumerate(steps):
            if int(token) != self.reply[k]:
                raise RuntimeError(f"reply token {k}: generated {token}, forced {self.reply[k]}")
        if len(forced.nll) < len(self.reply):
            raise RuntimeError(f"the logits processor saw {len(forced.nll)} reply tokens")
        mx.eval(forced.nll)
        return np.array([float(x.item()) for x in forced.nll[: len(self.reply)]])


class ForcedReply:
    """A ``generate_step`` logits processor: records -log p of the next reply token from the
    raw logits, then leaves that token the only one the greedy sampler can pick."""

    def __init__(self, reply: Sequence[int]) -> None:
        self.reply = list(reply)
        self.nll: list[Any] = []

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        k = len(self.nll)
        if k >= len(self.reply):  # generate_step computes one step past the last it yields
            return logits
        raw = logits.astype(mx.float32)
        token = self.reply[k]
        self.nll.append((mx.logsumexp(raw, axis=-1) - raw[:, token]).squeeze())
        only = mx.arange(raw.shape[-1]) == token
        return mx.where(only, raw, mx.array(-mx.inf, dtype=mx.float32))


def cache_summary(caches: Sequence[Any]) -> dict[str, int]:
    """Layers per cache class, e.g. ``{"KVCache": 3, "RotatingKVCache": 15}``."""
    counts: dict[str, int] = {}
    for c in caches:
        counts[type(c).__name__] = counts.get(type(c).__name__, 0) + 1
    return counts


def write(args: argparse.Namespace) -> dict[str, Any]:
    chat = Chat(args.model, args.messages, 0, args.chat_template)  # first: picks mlx's BLAS
    from mlx_lm.models.cache import save_prompt_cache

    out = Path(args.out)
    caches = chat.new_caches(args.kind, args.cap, args.sinks)
    say(f"prefilling {len(chat.cached)} tokens into {args.kind} caches")
    started = time.perf_counter()
    chat.prefill(caches)
    metadata = {TOKEN_IDS_KEY: json.dumps(chat.cached), WRITER_KEY: versions()["mlx_lm"]}
    save_prompt_cache(str(out), caches, metadata=metadata)
    say(f"saved {out.stat().st_size:,} bytes to {out}")
    return {
        **versions(), "kind": args.kind, "model": chat.model_name, "tokens": len(chat.cached),
        "bytes": out.stat().st_size, "caches": cache_summary(caches),
        "seconds": round(time.perf_counter() - started, 2),
    }  # fmt: skip


def read(args: argparse.Namespace) -> dict[str, Any]:
    chat = Chat(args.model, args.messages, args.reply_tokens, args.chat_template)  # BLAS first
    from mlx_lm.models.cache import load_prompt_cache

    from pytest_kvguard.core.scoring import reuse_gap

    path = Path(args.file)
    result: dict[str, Any] = {
        **versions(), "kind": args.kind, "model": chat.model_name,
        "file_bytes": path.stat().st_size if path.is_file() else None,
    }  # fmt: skip
    say(f"loading {path}")
    try:
        loaded, metadata = load_prompt_cache(str(path), return_metadata=True)
    except Exception as exc:  # whatever the engine raises is the finding: quote it
        return {**result, "loads": False, "error": one_line(exc)}
    result["loads"] = True
    result.update(read_metadata(metadata, chat.cached))
    result["caches"] = cache_summary(loaded)
    fresh = chat.new_caches(args.kind, args.cap, args.sinks)
    if cache_summary(fresh) != result["caches"] or len(loaded) != len(fresh):
        result["metadata_error"] = (
            f"loaded caches {result['caches']}, this release builds {cache_summary(fresh)}"
        )
    say(f"replaying {len(chat.followup) - len(chat.cached)} new tokens and {len(chat.reply)} "
        "reply tokens on the loaded cache")  # fmt: skip
    try:
        reused = chat.score_reply(loaded)
    except Exception as exc:  # a file that loads but cannot be used: quote the engine
        return {**result, "replay_error": one_line(exc)}
    say(f"the same after a fresh prefill of {len(chat.cached)} tokens")
    chat.prefill(fresh)
    reference = chat.score_reply(fresh)
    return {**result, **reuse_gap(reused, reference)}


def read_metadata(metadata: Any, cached: Sequence[int]) -> dict[str, Any]:
    """The file's token count and writer, and a ``metadata_error`` where the metadata did not
    come back as written (the cached prompt's token ids)."""
    found: dict[str, Any] = {"tokens_in_file": None, "writer_in_file": None}
    try:
        ids = json.loads(metadata[TOKEN_IDS_KEY])
        found["writer_in_file"] = metadata.get(WRITER_KEY)
    except Exception as exc:  # a misread metadata block can be any shape
        return {**found, "metadata_error": f"token ids not in the loaded metadata: {one_line(exc)}"}
    found["tokens_in_file"] = len(ids)
    if ids != list(cached):
        found["metadata_error"] = "the file's token ids are not this chat's cached prompt"
    return found


def main(argv: list[str] | None = None) -> int:
    def cache_shape(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--cap", type=int, default=DEFAULT_CAP)
        sub.add_argument("--sinks", type=int, default=DEFAULT_SINKS)

    return saved_cache_main(
        argv, prog="python -m pytest_kvguard.engines.mlx.saved_cache", kinds=KINDS,
        defaults={"messages": DEFAULT_MESSAGES, "reply_tokens": DEFAULT_REPLY_TOKENS},
        write=write, read=read, versions=versions, add_arguments=cache_shape,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
