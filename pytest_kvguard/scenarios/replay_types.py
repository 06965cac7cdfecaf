"""What one edit-replay measured; shared by the engine adapters and the scenario."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: where the edited prompt starts to differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
