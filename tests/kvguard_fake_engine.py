"""A toy engine for testing pytest mechanics fast. It proves nothing about real caches.

Token ids are ``i % VOCAB``; the toy predicts ``last + 1`` sharply while token 0 of the
sequence (its "sink") is still held, slightly less once anything was evicted, and
vaguely once the sink is gone: a pure window loses the
sink and its perplexity jumps, a sink policy keeps it. Set KVGUARD_FAKE_FAIL=1 to make
decoding fail.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pytest_kvguard.engines import EngineInfo, EngineOptions
from pytest_kvguard.errors import EngineError
from pytest_kvguard.policies import Policy

VOCAB = 32
INFO = EngineInfo(
    "fake",
    __name__,
    __name__,
    "pytest-kvguard",
    "it ships with the tests",
    policies={"stream": ("full", "window", "sink"), "memory": ("full", "window", "sink")},
)


def load(model_path: Path, options: EngineOptions) -> FakeEngine:
    return FakeEngine()


class FakeEngine:
    name = "fake"
    kv_element_bytes = 2.0

    def version(self) -> str:
        return "0.0-test"

    def describe(self) -> dict[str, str]:
        return {"engine": "fake"}

    def tokenize(self, text: str) -> list[int]:
        return [i % VOCAB for i in range(len(text) // 4)]

    def open_stream(self, policy: Policy, max_tokens: int) -> FakeStream:
        return FakeStream(policy)

    def close(self) -> None:
        pass


class FakeStream:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
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
        return None if self.policy.cap is None else self.policy.cap - self.held

    def feed(self, token_ids: Sequence[int], logits: bool = True) -> np.ndarray:
        if os.environ.get("KVGUARD_FAKE_FAIL"):
            raise EngineError("fake decode failed (KVGUARD_FAKE_FAIL is set)")
        cap = self.policy.cap
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
        return {"kv_bytes": float(self.held * 64)}

    def layer_sizes(self) -> list[tuple[int, int]]:
        return [(self.fed, self.held)]
