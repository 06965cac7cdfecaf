"""Scenario ``edit_replay``: a long chat is cached, a follow-up arrives; count what is re-prefilled.

The follow-up is an edited earlier message, a regenerated last reply, a plain appended turn, or
history trimmed as templates and agent frameworks do (earlier reasoning dropped). Both prompts are
rendered with the model's own chat template and tokenized by the engine; the engine adapter keeps
what its own memory operations allow and re-prefills the rest. Token counts are exact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pytest_kvguard.engines import Engine
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.paths import resolve_under
from pytest_kvguard.policies import Policy

DEFAULT_CHAT = "tutor"
FOLLOWUPS = {
    "edit": "message `message` gets EDIT_SUFFIX appended; everything else stays",
    "regenerate": "the last assistant reply is dropped, as when asking for a new one",
    "append": "a new user turn is added after the whole history",
    "trim_reasoning": "reasoning is dropped from every assistant turn but the last",
}
EDIT_SUFFIX = " Please keep the answer short."
APPENDED_TURN = "Thank you. Could you summarise all of that in three sentences?"


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    reasoning: str | None = None

    def rendered(self, with_reasoning: bool) -> dict[str, str]:
        content = self.content
        if with_reasoning and self.reasoning:
            content = f"<think>\n{self.reasoning}\n</think>\n\n{content}"
        return {"role": self.role, "content": content}


@dataclass(frozen=True)
class Conversation:
    name: str
    messages: tuple[Message, ...]


def load_conversation(spec: str, base_dir: Path) -> Conversation:
    """The bundled ``tutor`` chat, or a JSON file ``{"messages": [{"role", "content", ...}]}``."""
    if spec == DEFAULT_CHAT:
        raw = resources.files("pytest_kvguard").joinpath("data/tutor_chat.json").read_text("utf-8")
    else:
        try:
            raw = resolve_under(spec, base_dir).read_text(encoding="utf-8")
        except OSError as exc:
            raise KvguardError(
                f"chat file '{spec}': {exc.strerror}", fix="give a JSON chat file"
            ) from None
    try:
        data = json.loads(raw)
        messages = tuple(
            Message(m["role"], m["content"], m.get("reasoning")) for m in data["messages"]
        )
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise KvguardError(
            f"chat '{spec}' is not a chat file: {exc}",
            fix='write {"messages": [{"role": "user", "content": "..."}, ...]}',
        ) from None
    return Conversation(spec, messages)


def history(conversation: Conversation) -> list[dict[str, str]]:
    """The cached prompt: every message, reasoning included."""
    return [m.rendered(with_reasoning=True) for m in conversation.messages]


def followup(conversation: Conversation, kind: str, message: int | None) -> list[dict[str, str]]:
    """The follow-up prompt's messages."""
    messages = list(conversation.messages)
    if kind == "edit":
        if message is None or not -len(messages) <= message < len(messages):
            raise KvguardError(
                f"edit needs a message index within the chat's {len(messages)} messages",
                fix="set params.message, e.g. 1 (near the start) or -3 (near the end)",
            )
        edited = messages[message]
        messages[message] = Message(edited.role, edited.content + EDIT_SUFFIX, edited.reasoning)
        return [m.rendered(with_reasoning=True) for m in messages]
    if kind == "regenerate":
        last = max(i for i, m in enumerate(messages) if m.role == "assistant")
        return [m.rendered(with_reasoning=True) for m in messages[:last]]
    if kind == "append":
        return history(conversation) + [{"role": "user", "content": APPENDED_TURN}]
    if kind == "trim_reasoning":
        last = max(i for i, m in enumerate(messages) if m.role == "assistant")
        return [m.rendered(with_reasoning=i == last) for i, m in enumerate(messages)]
    raise KvguardError(f"unknown follow-up '{kind}'", fix="use one of " + ", ".join(FOLLOWUPS))


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


@dataclass(frozen=True)
class ReplayRun:
    """One policy: the first prompt prefilled, then the follow-up served from its cache."""

    policy: Policy
    first_prompt_tokens: int
    replay: Replay
    memory: dict[str, float]
    """What the cache (and its checkpoints) cost after the first prompt."""
    prefill_seconds: float

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
        }


def run_edit_replay(
    engine: Engine, policy: Policy, first_ids: Sequence[int], followup_ids: Sequence[int]
) -> ReplayRun:
    """Prefill the first prompt into a fresh cache, then replay the follow-up against it."""
    cache = engine.open_prefix_cache(policy, max(len(first_ids), len(followup_ids)))
    try:
        started = time.perf_counter()
        cache.extend(first_ids, 0)
        prefill_seconds = time.perf_counter() - started
        memory = cache.memory_bytes()
        started = time.perf_counter()
        split = common_prefix(first_ids, followup_ids)
        # At least one token is decoded, so the follow-up has logits to generate from.
        reused, restored = cache.keep_prefix(min(split, len(followup_ids) - 1))
        cache.extend(followup_ids[reused:], reused)
        replay = Replay(
            prompt_tokens=len(followup_ids),
            split=split,
            reused=reused,
            reprefilled=len(followup_ids) - reused,
            restored_checkpoint=restored,
            seconds=time.perf_counter() - started,
        )
    finally:
        cache.close()
    return ReplayRun(policy, len(first_ids), replay, memory, prefill_seconds)
