"""Replaying a follow-up on a cache that held the chat before it (edit_replay's run): the
counts of what was reused and re-prefilled, and the forced reply's scores against a fresh
prefill of the follow-up on the same engine and settings."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.core.scoring import floor_cuts, reuse_gap
from pytest_kvguard.engines import (
    Engine,
    PrefixCache,
    Prompt,
    ReplaysPrefix,
    ReusesThroughApi,
    SnapshotsPrefix,
)
from pytest_kvguard.inputs.chats import common_prefix


@dataclass(frozen=True)
class Replay:
    """A follow-up prompt served from a cache that held the previous prompt."""

    prompt_tokens: int
    split: int
    """Longest common token prefix of the old and new prompt."""
    reused: int
    """Tokens the engine kept (llama-server's cache_n)."""
    reprefilled: int
    """Tokens decoded again (llama-server's prompt_n)."""
    restored_checkpoint: int | None
    """Tokens covered by the checkpoint restored, if one was."""
    seconds: float
    reply_nll: np.ndarray | None = None
    """-log p of each forced reply token after the follow-up, from the reused cache."""
    fresh_nll: np.ndarray | None = None
    """The same, after a fresh prefill of the follow-up on the same engine and settings."""
    cut_nll: Mapping[int, np.ndarray] = field(default_factory=dict)
    """The same after a fresh prefill cut where this reuse was cut (``floor_cuts``), by the
    cut: the engine's own floor."""
    window_missing: int | None = None
    """Sliding-window positions under the reused prefix the cache no longer held (Reuse)."""
    loaded_state: int | None = None
    """Tokens of the state the app's own state cache loaded for the follow-up (Reuse)."""


@dataclass(frozen=True)
class ReplayRun:
    """One policy: the first prompt prefilled, then the follow-up served from its cache."""

    policy: Policy
    first_prompt_tokens: int
    replay: Replay
    memory: dict[str, float]
    """What the cache (and its checkpoints) cost after the first prompt."""
    prefill_seconds: float
    reference_seconds: float = 0.0
    """The fresh prefills the reused cache is scored against: the reference and the floor's
    (0 where an earlier check computed both)."""

    @property
    def metrics(self) -> dict[str, float]:
        r = self.replay
        return {
            "first_prompt_tokens": float(self.first_prompt_tokens),
            "prompt_tokens": float(r.prompt_tokens),
            "split": float(r.split),
            "reused_tokens": float(r.reused),
            "reprefill_tokens": float(r.reprefilled),
            "reprefill_fraction": r.reprefilled / r.prompt_tokens,
            "restored_checkpoint": float(
                -1 if r.restored_checkpoint is None else r.restored_checkpoint
            ),
            "state_bytes": self.memory["state_bytes"],
            "checkpoint_bytes": self.memory["checkpoint_bytes"],
            "checkpoints": self.memory["checkpoints"],
            "memory_bytes": self.memory["state_bytes"] + self.memory["checkpoint_bytes"],
            **reuse_gap(r.reply_nll, r.fresh_nll, r.cut_nll),
            **({} if r.window_missing is None else
               {"window_missing_tokens": float(r.window_missing)}),
            **({} if r.loaded_state is None else
               {"loaded_state_tokens": float(r.loaded_state)}),
        }  # fmt: skip


def open_replay_cache(
    engine: Engine, policy: Policy, max_tokens: int, via: str, state: str = "none"
) -> PrefixCache:
    """The cache a follow-up is replayed on: the engine's user-facing API (``api``: it decides
    the reuse; ``state``: how the app keeps states between requests) or kvguard's own use of
    the engine's memory operations (``memory``)."""
    if via == "api" and isinstance(engine, ReusesThroughApi):
        return engine.open_api_cache(policy, max_tokens, state)
    return engine.open_prefix_cache(policy, max_tokens)


def run_edit_replay(
    engine: Engine,
    policy: Policy,
    first: Prompt,
    followup: Prompt,
    prefilled: object | None = None,
    reply_ids: Sequence[int] = (),
    via: str = "memory",
    api_state: str = "none",
    fresh: Mapping[int, np.ndarray] | None = None,
) -> tuple[ReplayRun, object | None, dict[int, np.ndarray]]:
    """Prefill the first prompt into a fresh cache (or restore ``prefilled``, what the engine's
    prefix cache ``save`` returned after that prefill), then replay the follow-up against it:
    through the cache's ``replay`` where it has one (a server, or the API apps call, counting
    its own reuse), else by keeping the longest prefix the engine can use and prefilling the
    rest. With ``reply_ids``, the reply is then forced token by token and scored, and scored
    again on the same engine and settings after fresh prefills of the follow-up: in the
    engine's own batches (cut 0, the reference) and cut where the reuse was (``floor_cuts``),
    each taken from ``fresh`` where an earlier check computed the very same one.
    Returns the run, the saved prefill for the next follow-up where the engine can save one,
    and the fresh scores by cut (``fresh`` and those computed here)."""
    first_ids, followup_ids = first.ids, followup.ids
    longest = max(len(first_ids), len(followup_ids)) + len(reply_ids)
    cache = open_replay_cache(engine, policy, longest, via, api_state)
    reply_nll: np.ndarray | None = None
    window_missing: int | None = None
    loaded_state: int | None = None
    scores = dict(fresh or {})
    try:
        if prefilled is None:
            started = time.perf_counter()
            if isinstance(cache, ReplaysPrefix):
                cache.request(first)
            else:
                cache.extend(first_ids, 0)
            seconds = time.perf_counter() - started
            prefilled = cache.save() if isinstance(cache, SnapshotsPrefix) else None
        else:
            assert isinstance(cache, SnapshotsPrefix)  # only a cache that saves has a prefill
            cache.restore(prefilled)
            seconds = 0.0  # reused: reported as 0 s, like any run reused from earlier
        memory = cache.memory_bytes()
        started = time.perf_counter()
        split = common_prefix(first_ids, followup_ids)
        if isinstance(cache, ReplaysPrefix):
            # The engine's own path decides its reuse when the follow-up arrives, and counts it.
            reuse = cache.replay(followup, reply_ids)
            reused, reprefilled = reuse.reused, reuse.reprefilled
            restored, reply_nll = reuse.restored_checkpoint, reuse.reply_nll
            window_missing, loaded_state = reuse.window_missing, reuse.loaded_state
            if reused > split:
                raise EngineError(
                    f"the engine reused {reused} tokens of a follow-up that shares only {split} "
                    "with the prompt before it: it held the follow-up from an earlier request",
                    fix="restart the server or flush its prefix cache before the run",
                )
        else:
            # At least one token is decoded, so the follow-up has logits to generate from.
            reused, restored = cache.keep_prefix(min(split, len(followup_ids) - 1))
            cache.extend(followup_ids[reused:-1], reused)
            reprefilled = len(followup_ids) - reused
            if reply_ids:
                reply_nll = score_reply(cache, followup_ids, reply_ids)
            else:
                cache.extend(followup_ids[-1:], len(followup_ids) - 1)
        replay_seconds = time.perf_counter() - started
        started = time.perf_counter()
        cuts = [0, *floor_cuts(reused, len(followup_ids))] if reply_ids else []
        if isinstance(cache, ReplaysPrefix):
            # The engine's own requests on the same server or API object, from an empty cache.
            for cut in cuts:
                if cut not in scores:
                    scores[cut] = np.asarray(cache.score_fresh(followup, reply_ids, cut))
    finally:
        cache.close()
    for cut in cuts:
        if cut not in scores:
            # Opened after the replayed cache is closed: the two never hold memory at once.
            scores[cut] = fresh_prefill_scores(engine, policy, longest, followup_ids,
                                               reply_ids, cut)  # fmt: skip
    reference_seconds = time.perf_counter() - started
    replay = Replay(
        prompt_tokens=len(followup_ids),
        split=split,
        reused=reused,
        reprefilled=reprefilled,
        restored_checkpoint=restored,
        seconds=replay_seconds,
        reply_nll=reply_nll,
        fresh_nll=scores.get(0),
        cut_nll={c: scores[c] for c in cuts if c},
        window_missing=window_missing,
        loaded_state=loaded_state,
    )
    run = ReplayRun(policy, len(first_ids), replay, memory, seconds, reference_seconds)
    return run, prefilled, scores


def score_reply(cache: PrefixCache, prompt_ids: Sequence[int], reply_ids: Sequence[int]) -> Any:
    """Decode the prompt's last token and the reply with logits for each: -log p of each reply
    token (the last prompt token's logits predict the first)."""
    return cache.score([prompt_ids[-1], *reply_ids], len(prompt_ids) - 1)


def fresh_prefill_scores(
    engine: Engine,
    policy: Policy,
    max_tokens: int,
    prompt_ids: Sequence[int],
    reply_ids: Sequence[int],
    cut: int = 0,
) -> np.ndarray:
    """kvguard's memory path: the forced reply's scores in a fresh cache of the same policy,
    the prompt prefilled from token 0 in the engine's usual calls; with ``cut``, its first
    ``cut`` tokens prefilled first and the rest after them, as a correct reuse cut there."""
    fresh = engine.open_prefix_cache(policy, max_tokens)
    try:
        if cut:
            fresh.extend(prompt_ids[:cut], 0)
        fresh.extend(prompt_ids[cut:-1], cut)
        nll: np.ndarray = score_reply(fresh, prompt_ids, reply_ids)
        return nll
    finally:
        fresh.close()
