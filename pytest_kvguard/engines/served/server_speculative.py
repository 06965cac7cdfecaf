"""llama-server's speculative decoding, as deployments run it: the server started with a draft
model (``--model-draft DRAFT --spec-type draft-simple --spec-draft-n-max N``) and one greedy
``/completion`` request, against the same request to the same server settings without the
draft.

The draft is the target's GGUF re-quantized by llama.cpp's quantizer (``gguf_q4_0``,
``gguf_q3_k``). The server drafts ``num_draft`` tokens each round with the draft model,
verifies the sampled token and the drafts in one batch on the target, keeps the accepted ones
and removes the rest from the target's cache (``llama_memory_seq_rm``).

What the server reports, and what it does not:

- **tokens**: every emitted token, from ``completion_probabilities``.
- **log probabilities**: the plain path gives each token's log probability and the top two
  (``n_probs: 2``, ``post_sampling_probs: false``: the raw softmax). The speculative path gives
  them for its first token only: every token a verification round emits comes back as
  ``logprob: 0.0`` with an empty top list (the accept branch of the server's
  ``server-context.cpp`` sets ``prob = 1.0f`` and leaves ``// TODO: set result.probs``). kvguard
  records those as NaN, never as the 0 the server writes: the log-probability gap of the draft
  path is not measurable through this server, and the scenario leaves that figure out (a
  budget on it is refused as not applying).
- **rounds**: ``timings`` has totals only (``draft_n``, ``draft_n_accepted``). The server logs
  each round at ``--log-verbosity 5`` (``generate_draft: ... #tokens=N, #draft=D``, then
  ``add accepted tokens: ... ids.size=A+1, n_draft=D``; its ``accepted A/D`` line is missing
  for a round that reaches ``n_predict``), so a draft server is started at that verbosity and
  the rounds are read from its log (they must add up to ``draft_n``). A server that turns
  drafting off (``speculative decoding not supported by this context``, logged when it loads
  the model) is refused with that line.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pytest_kvguard.core.errors import EngineError, KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.protocols import Decoded
from pytest_kvguard.engines.served.process import ServerSettings, field
from pytest_kvguard.engines.served.server_cache import SLOT

if TYPE_CHECKING:
    from pytest_kvguard.engines.served.llama_server import LlamaServerEngine

SPEC_TYPE = "draft-simple"
"""llama-server's draft-model speculation (``--spec-type``; the default is none)."""
ROUND_LOG_VERBOSITY = 5
"""The log level at which llama-server logs each verification round (debug)."""
LOG_WAIT = 10.0
"""Seconds to wait for the server's log of a request to reach its end."""
_DRAFT = re.compile(r"generate_draft: id=-?\d+, #tokens=(\d+), #draft=(\d+)")
_ACCEPTED = re.compile(r"add accepted tokens: sampled=-?\d+, ids\.size=(\d+), n_draft=(\d+)")
_TURNED_OFF = re.compile(r"[^\n]*speculative decoding (?:is )?not supported[^\n]*")


@dataclass(frozen=True)
class DraftSettings(ServerSettings):
    """A server's settings with a draft model: one server per distinct value, as for
    ``ServerSettings`` (a draft server is never the plain one)."""

    draft_model: Path | None = None
    num_draft: int = 3

    def args(self) -> list[str]:
        args = super().args()
        if self.draft_model is not None:
            args += ["--model-draft", str(self.draft_model), "--spec-type", SPEC_TYPE,
                     "--spec-draft-n-max", str(self.num_draft), "--spec-draft-n-min", "0",
                     "--spec-draft-p-min", "0",
                     "--log-verbosity", str(ROUND_LOG_VERBOSITY)]  # fmt: skip
        return args


def draft_path(engine: LlamaServerEngine, draft: str) -> Path:
    """The draft GGUF: the target re-quantized (written once per process)."""
    from pytest_kvguard.engines.gguf_quantize import GGUF_DRAFT_TYPES, requantized

    if draft not in GGUF_DRAFT_TYPES:
        raise KvguardError(
            f"llama-server has no draft '{draft}'", fix="use " + " or ".join(GGUF_DRAFT_TYPES)
        )
    assert engine.model_path is not None
    return requantized(engine.model_path, GGUF_DRAFT_TYPES[draft])


def _settings(
    policy: Policy, prompt: int, new_tokens: int, num_draft: int, draft_model: Path | None
) -> ServerSettings:
    """The server for the policy: a context that holds prompt and reply (the adapter offers
    full, swa and swa_full only: with a context shift, llama-server drafts at most
    ``n_ctx - n_tokens - 2`` tokens, so a one-token shift never drafts past the cap). Gemma 3's
    sliding layers get the server's small SWA cache on swa, all of it with ``--swa-full`` on
    full (as llama-cpp-python's default) and swa_full."""
    if policy.kind not in ("full", "swa", "swa_full"):
        raise KvguardError(f"llama-server's speculative path has no policy {policy.kind}")
    common: dict[str, Any] = {
        "cache_type_k": policy.cache_type_k, "cache_type_v": policy.cache_type_v,
        "swa_full": policy.kind in ("full", "swa_full"),
    }  # fmt: skip
    n_ctx = prompt + new_tokens + num_draft + 2
    if draft_model is None:
        return ServerSettings(n_ctx, **common)
    return DraftSettings(n_ctx, draft_model=draft_model, num_draft=num_draft, **common)


def _complete(
    engine: LlamaServerEngine, settings: ServerSettings, prompt: Sequence[int], new_tokens: int
) -> tuple[list[int], np.ndarray, np.ndarray, float, dict[str, Any], str, list[int]]:  # fmt: skip
    """One greedy ``/completion``: the emitted ids, their log probabilities and top-2 margins
    (NaN where the server gave none), the request's seconds, its ``timings`` and what the
    server logged meanwhile."""
    http = engine.serve(settings)
    body: dict[str, Any] = {
        "prompt": list(prompt), "n_predict": new_tokens, "cache_prompt": False,
        "n_probs": 2, "post_sampling_probs": False, "temperature": 0.0, "ignore_eos": True,
        "id_slot": SLOT,
    }  # fmt: skip
    server = engine.server
    log_start = len(server.log_text()) if server is not None else 0
    started = time.perf_counter()
    answer = http.post("/completion", body)
    seconds = time.perf_counter() - started
    log = _log_of_request(server, log_start)
    probs = field(answer, "completion_probabilities", where="/completion")
    if not isinstance(probs, list) or len(probs) != new_tokens:
        made = len(probs) if isinstance(probs, list) else "no"
        raise EngineError(
            f"llama-server generated {made} of {new_tokens} tokens (stop: "
            f"{answer.get('stop_type') if isinstance(answer, dict) else None})",
            fix="check the server's log",
        )
    tokens, logprobs, margins = [], np.full(len(probs), np.nan), np.full(len(probs), np.nan)
    runners_up: list[int] = []
    try:
        for i, entry in enumerate(probs):
            tokens.append(int(entry["id"]))
            top = entry.get("top_logprobs") or []
            runners_up.append(int(top[1]["id"]) if len(top) >= 2 else -1)
            if len(top) >= 2:  # the speculative accept path leaves it empty (see the module doc)
                best, second = (-math.inf if t["logprob"] is None else float(t["logprob"])
                                for t in top[:2])  # fmt: skip
                logprobs[i] = -math.inf if entry["logprob"] is None else float(entry["logprob"])
                margins[i] = best - second
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(
            f"llama-server answered /completion in an unknown shape: {exc!r}",
            fix="check that this llama-server build is a supported one",
        ) from None
    timings = answer.get("timings") if isinstance(answer, dict) else None
    return tokens, logprobs, margins, seconds, timings or {}, log, runners_up


def _log_of_request(server: Any, start: int) -> str:
    """What the server logged for the request just answered. Its log is written by a thread of
    its own and may lag the answer: read until the slot's closing timings (``total time``,
    then the draft statistics where it drafted) are there, for a few seconds at most."""
    if server is None:
        return ""
    deadline = time.monotonic() + LOG_WAIT
    while True:
        log = str(server.log_text()[start:])
        done = "total time =" in log and (
            not isinstance(server.settings, DraftSettings)
            or server.settings.draft_model is None
            or "draft acceptance" in log
            or "statistics" in log
        )
        if done or time.monotonic() > deadline:
            return log
        time.sleep(0.05)


def rounds_of(log: str, prompt: int) -> list[tuple[int, int, int]]:
    """(index of the first token a round emits, drafted, accepted) from a draft server's
    round log (``ROUND_LOG_VERBOSITY``). A round starts with the cache holding ``#tokens``
    cells (its token before the drafts not yet among them), so its first draft is token
    ``#tokens - prompt + 1`` of the reply."""
    rounds: list[tuple[int, int, int]] = []
    start: int | None = None
    for line in log.splitlines():
        if begun := _DRAFT.search(line):
            start = int(begun.group(1)) - prompt + 1
        elif (done := _ACCEPTED.search(line)) and start is not None:
            # ids: the accepted drafts and the target's own next token.
            rounds.append((start, int(done.group(2)), int(done.group(1)) - 1))
            start = None
    return rounds


def speculate(
    engine: LlamaServerEngine, policy: Policy, prompt: Sequence[int], new_tokens: int,
    draft: str | None, num_draft: int, prefilled: int = 0,
) -> Decoded:  # fmt: skip
    """See ``protocols.Speculates.speculate``: the plain path on a server without a draft, the
    draft path on one started with it (``DraftSettings``), each one ``/completion`` request
    with ``cache_prompt: false``. The draft path's rounds are read from the server's log and
    must add up to what its ``timings`` count."""
    if prefilled:
        raise KvguardError("llama-server's speculative path starts from its own prompt")
    if engine.url:
        raise KvguardError(
            "kvguard starts the draft server itself (--model-draft); a server given by URL "
            "has the draft it was started with", fix="give the check a GGUF model",
        )  # fmt: skip
    path = None if draft is None else draft_path(engine, draft)
    settings = _settings(policy, len(prompt), new_tokens, num_draft, path)
    tokens, logprobs, margins, seconds, timings, log, runners_up = _complete(
        engine, settings, prompt, new_tokens
    )
    rounds: list[tuple[int, int, int]] = []
    if path is not None:
        rounds = rounds_of(log, len(prompt))
        drafted = int(timings.get("draft_n") or 0)
        # Rounds placed in the reply or none: a round log that does not add up to the server's
        # own count (or is missing while it drafted) cannot say where the drafts fell.
        if sum(r[1] for r in rounds) != drafted:
            raise EngineError(
                f"llama-server logged {sum(r[1] for r in rounds)} drafted tokens in "
                f"{len(rounds)} rounds where its timings count {drafted}"
            )
        # The server says so when it loads the model, before any request: read its whole log.
        turned_off = _TURNED_OFF.search(engine.server.log_text() if engine.server else log)
        if turned_off and not rounds:
            # It went on without drafts: an error naming the server's reason, never a pass.
            return Decoded((), np.zeros(0), np.zeros(0), seconds=seconds,
                           refused="llama-server turned speculation off: "
                           + turned_off.group(0).strip()[:200])  # fmt: skip
    return Decoded(tuple(tokens), logprobs, margins, rounds=tuple(rounds), seconds=seconds,
                   runners_up=tuple(runners_up))  # fmt: skip


def verification_noise(
    engine: LlamaServerEngine, prompt: Sequence[int], plain: Decoded, num_draft: int
) -> tuple[float, float]:
    """See ``protocols.Speculates.verification_noise``, through the server's own API on the
    full policy's plain server: its prompt cache (``cache_prompt: true``) holds the prompt and
    the plain tokens up to a point, and each request adds the next ``num_draft + 1`` plain
    tokens in one batch, as a verification round evaluates them, and samples one token: its
    log probability and top-2 margin against the plain path's, which decoded it after a
    single-token step. Every phase of the batches is measured (the first request of a phase
    also starts the cache, and is not compared). Where the batch's greedy token is not the
    plain one, a near tie flipped: the plain margin there is part of the noise."""
    batch = num_draft + 1
    tokens = plain.tokens
    settings = _settings(Policy("full"), len(prompt), len(tokens), num_draft, None)
    http = engine.serve(settings)
    lp_gap = margin_gap = 0.0
    for phase in range(batch):
        ends = list(range(phase, len(tokens), batch))
        for n, end in enumerate(ends):
            body = {"prompt": [*prompt, *tokens[:end]], "n_predict": 1, "cache_prompt": True,
                    "n_probs": 2, "post_sampling_probs": False, "temperature": 0.0,
                    "id_slot": SLOT}  # fmt: skip
            answer = http.post("/completion", body)
            if n == 0:
                continue
            timings = answer.get("timings") if isinstance(answer, dict) else None
            evaluated = (timings or {}).get("prompt_n")
            if evaluated != batch:
                raise EngineError(
                    f"llama-server evaluated {evaluated} prompt tokens where its cache should "
                    f"have left {batch} (cache_n {(timings or {}).get('cache_n')})",
                    fix="check that the server keeps its slot's cache between requests",
                )
            entry = field(answer, "completion_probabilities", where="/completion")[0]
            top = entry["top_logprobs"]
            best, second = float(top[0]["logprob"]), float(top[1]["logprob"])
            if int(entry["id"]) != tokens[end]:
                margin_gap = max(margin_gap, float(plain.margins[end]))
                continue
            lp_gap = max(lp_gap, abs(float(entry["logprob"]) - float(plain.logprobs[end])))
            margin_gap = max(margin_gap, abs(best - second - float(plain.margins[end])))
    return lp_gap, margin_gap
