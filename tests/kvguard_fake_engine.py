"""A toy engine for testing pytest mechanics fast. It proves nothing about real caches.

Token ids are ``i % VOCAB``; the toy predicts ``last + 1`` sharply while token 0 of the
sequence (its "sink") is still held, slightly less once anything was evicted, and
vaguely once the sink is gone: a pure window loses the
sink and its perplexity jumps, a sink policy keeps it. Its prefix cache (edit_replay) keeps
any prefix under ``full`` and, under ``swa``, only one whose last ``TOY_WINDOW`` tokens it still
holds. Set KVGUARD_FAKE_FAIL=1 to make decoding fail; KVGUARD_FAKE_CRASH=KIND (abort) or
KVGUARD_FAKE_HANG=KIND (block forever) to break decoding under policy KIND; KVGUARD_FAKE_NO_CAP=1
to ignore the cap (the cache grows), as it always does on a model file whose name has ``nocap`` in
it (the model preview's toy regression); KVGUARD_FAKE_VERSION to report another version;
KVGUARD_FAKE_ATTENTION=1 to give it toy attention probabilities (layer 1 parks 80% on token 0).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines import AttentionRows, EngineInfo, EngineOptions
from pytest_kvguard.engines.conversation import Turn, converse_through_stream

VOCAB = 32
TOY_WINDOW = 16
CHAT_MARK = "\x02chat\x03"
"""Starts every chat the toy renders, so its tokenizer can tell a chat from a stream text."""
INFO = EngineInfo(
    "fake",
    __name__,
    __name__,
    "pytest-kvguard",
    "it ships with the tests",
    policies={
        "feed": ("full", "window", "sink"),
        "feed_unscored": ("full", "window", "sink"),
        "prefix_cache": ("full", "swa"),
        "generation": ("window", "sink"),
    },
)


def load(model_path: Path, options: EngineOptions) -> FakeEngine:
    return FakeEngine(ignores_cap="nocap" in model_path.name)


class FakeEngine:
    name = "fake"
    kv_element_bytes = 2.0

    def __init__(self, ignores_cap: bool = False) -> None:
        self.ignores_cap = ignores_cap or bool(os.environ.get("KVGUARD_FAKE_NO_CAP"))
        if os.environ.get("KVGUARD_FAKE_ATTENTION"):
            # Instance attributes: the engine has these only when asked (hasattr is the test).
            self.attention = toy_attention
            self.bos_id = None
            self.token_piece = lambda token_id: f"t{token_id}"

    def version(self) -> str:
        return os.environ.get("KVGUARD_FAKE_VERSION", "0.0-test")

    def describe(self) -> dict[str, str]:
        return {"engine": "fake"}

    def tokenize(self, text: str) -> list[int]:
        if text.startswith(CHAT_MARK):  # a rendered chat: one token per character, by content
            return [ord(c) % VOCAB for c in text]
        return [i % VOCAB for i in range(len(text) // 4)]  # a stream: token i is i mod VOCAB

    def chat_ids(self, messages: Sequence[Mapping[str, str]], template: Any = None) -> list[int]:
        """One id per character of the chat (roles marked), then an assistant prompt."""
        text = CHAT_MARK + "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.tokenize(text + "<assistant>")

    def open_stream(self, policy: Policy, max_tokens: int) -> FakeStream:
        return FakeStream(policy, self.ignores_cap)

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> FakePrefixCache:
        return FakePrefixCache(policy)

    group_figures_own = False
    """A row of a group runs alone when its own figures are asked for (as engines that cannot
    measure a row's peak)."""

    def group_key(self, policy: Policy) -> tuple[str, int] | None:
        """Capped policies fed a token at a time, one group per cap (as both real engines)."""
        if policy.kind in ("sink", "window") and policy.chunk == 1 and policy.cap is not None:
            return ("capped", policy.cap)
        return None

    def open_stream_group(self, policies: Sequence[Policy], max_tokens: int) -> FakeStreamGroup:
        FakeStreamGroup.opened.append(list(policies))
        return FakeStreamGroup([FakeStream(p, self.ignores_cap) for p in policies])

    def converse(
        self, policy: Policy, token_ids: Sequence[int], turns: Sequence[Turn], prefill_step: int
    ) -> np.ndarray:
        stream = FakeStream(policy, self.ignores_cap)
        return converse_through_stream(stream, token_ids, turns, prefill_step)

    def close(self) -> None:
        pass


def toy_attention(
    token_ids: Sequence[int], queries: Sequence[int], precision: object = None
) -> AttentionRows:
    """2 layers x 2 heads: layer 0 spreads evenly over what each query sees; layer 1 puts 80%
    on token 0 and spreads the rest."""
    width = max(queries) + 1
    probs = np.zeros((2, 2, len(queries), width), dtype=np.float32)
    for i, q in enumerate(queries):
        probs[0, :, i, : q + 1] = 1.0 / (q + 1)
        probs[1, :, i, 1 : q + 1] = 0.2 / q
        probs[1, :, i, 0] = 0.8
    return AttentionRows(probs, "toy", 0.0)


class FakeStream:
    feeds: ClassVar[list[tuple[Policy, int]]] = []
    """(policy, tokens) of every call made in this process, for tests to read."""

    def __init__(self, policy: Policy, ignores_cap: bool = False) -> None:
        self.policy = policy
        self.ignores_cap = ignores_cap
        self.positions: list[int] = []  # absolute index of each held token
        self.fed = 0
        self._evicted = 0

    @property
    def held(self) -> int:
        return len(self.positions)

    @property
    def evicted(self) -> int:
        return self._evicted

    def room(self) -> int | None:
        if self.policy.cap is None or self.ignores_cap:
            return None
        return self.policy.cap - self.held

    def feed(self, token_ids: Sequence[int], logits: bool = True) -> np.ndarray:
        if os.environ.get("KVGUARD_FAKE_FAIL"):
            raise EngineError("fake decode failed (KVGUARD_FAKE_FAIL is set)")
        if os.environ.get("KVGUARD_FAKE_CRASH") == self.policy.kind:
            os.abort()
        if os.environ.get("KVGUARD_FAKE_HANG") == self.policy.kind:
            threading.Event().wait()
        FakeStream.feeds.append((self.policy, len(token_ids)))
        cap = None if self.ignores_cap else self.policy.cap
        if cap is not None:
            while self.held + len(token_ids) > cap:
                step = self.policy.evict_step
                del self.positions[self.policy.sinks : self.policy.sinks + step]
                self._evicted += step
        rows = np.zeros((len(token_ids), VOCAB), dtype=np.float32)
        for row, token in enumerate(token_ids):
            self.positions.append(self.fed)
            self.fed += 1
            # Sink held: a little worse than full once anything is gone; sink lost: much worse.
            sharp = (6.0 if not self._evicted else 5.0) if self.positions[0] == 0 else 2.0
            rows[row, (token + 1) % VOCAB] = sharp
        return rows if logits else rows[:0]

    def close(self) -> None:
        pass

    def figures(self) -> dict[str, float]:
        return {"kv_bytes": float(self.held * 64), "peak_memory_bytes": float(self.fed * 64)}

    quantized_from = None
    """The fake engine has no quantized caches."""

    def layer_sizes(self) -> list[tuple[int, int]]:
        return [(self.fed, self.held)]


class FakeStreamGroup:
    """Rows decoded one after another: it tests the scheduling, not a shared forward pass."""

    opened: list[list[Policy]] = []
    """The policies of every group opened in this process, for tests to read."""
    steps_together = 0

    def __init__(self, streams: list[FakeStream]) -> None:
        self.streams = streams

    def feed_rows(self, rows: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        chosen = [self.streams[row] for row in rows]
        if len({s.held for s in chosen}) != 1 or len({s.fed for s in chosen}) != 1:
            raise AssertionError("rows of different sizes were fed together")
        FakeStreamGroup.steps_together += 1
        return np.concatenate([s.feed([t]) for s, t in zip(chosen, token_ids, strict=True)])

    def close(self) -> None:
        pass


class FakePrefixCache:
    """Counts tokens only: what a real cache would hold, without any tensors."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.n_tokens = 0

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        if start != self.n_tokens:
            raise EngineError(f"extend at {start}, but {self.n_tokens} tokens are cached")
        self.n_tokens += len(token_ids)

    def keep_prefix(self, n_tokens: int) -> tuple[int, int | None]:
        # A sliding window still holds the prefix's last TOY_WINDOW tokens only near the end.
        slid_out = self.policy.kind == "swa" and self.n_tokens - n_tokens > TOY_WINDOW
        self.n_tokens = 0 if slid_out else min(n_tokens, self.n_tokens)
        return self.n_tokens, None

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        """No model: every cache predicts the same (a correctness gap of exactly 0)."""
        self.extend(token_ids[:-1], start)
        return np.zeros(len(token_ids) - 1)

    def memory_bytes(self) -> dict[str, float]:
        held = min(self.n_tokens, TOY_WINDOW) if self.policy.kind == "swa" else self.n_tokens
        return {"state_bytes": float(held * 64), "checkpoint_bytes": 0.0, "checkpoints": 0.0}

    def close(self) -> None:
        pass
