"""Chats for edit_replay: the bundled ``tutor`` chat or a JSON chat file, the follow-ups sent
after it (an edit, a regenerated reply, an appended turn, trimmed reasoning), and the fixed
reply forced after a follow-up to score it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pytest_kvguard.errors import KvguardError
from pytest_kvguard.paths import resolve_under

DEFAULT_CHAT = "tutor"
FOLLOWUPS = {
    "edit": "message `message` gets EDIT_SUFFIX appended; everything else stays",
    "regenerate": "the last assistant reply is dropped, as when asking for a new one",
    "append": "a new user turn is added after the whole history",
    "trim_reasoning": "reasoning is dropped from every assistant turn but the last",
}
EDIT_SUFFIX = " Please keep the answer short."
APPENDED_TURN = "Thank you. Could you summarise all of that in three sentences?"
REPLY = (
    "Of course. The short version is this: each step builds on the one before it, so check "
    "your work after every step instead of only at the end. If a result looks wrong, go back "
    "to the last step you are sure of and redo the rest from there. Write the units next to "
    "every number, keep the signs straight, and compare the final answer with a rough estimate "
    "made before you start. Most mistakes show up as an answer that is far from that estimate."
)
"""The reply forced after the follow-up and scored (its first ``reply_tokens`` tokens): a
fixed continuation, so that a follow-up whose prompt is reused whole is still measured."""


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

    def first(self, count: int | None) -> Conversation:
        """The chat's first ``count`` messages (all of them for None), named so the report
        tells a shortened chat from the whole one: ``tutor[:11]``."""
        if count is None or count == len(self.messages):
            return self
        if not 2 <= count <= len(self.messages):
            raise KvguardError(
                f"params.chat_messages is {count}, and chat '{self.name}' has "
                f"{len(self.messages)} messages",
                fix=f"use chat_messages: 2 to {len(self.messages)}, or leave it out for all",
                key="params.chat_messages",
            )
        return Conversation(f"{self.name}[:{count}]", self.messages[:count])


def load_conversation(spec: str, base_dir: Path) -> Conversation:
    """The bundled ``tutor`` chat, or a JSON file ``{"messages": [{"role", "content", ...}]}``."""
    if spec == DEFAULT_CHAT:
        raw = resources.files("pytest_kvguard").joinpath("data/tutor_chat.json").read_text("utf-8")
    else:
        try:
            raw = resolve_under(spec, base_dir).read_text(encoding="utf-8")
        except OSError as exc:
            raise KvguardError(
                f"chat file '{spec}': {exc.strerror}",
                fix="give a JSON chat file",
                key="params.chat",
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
            key="params.chat",
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
                key="params.message",
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


def reply_ids(tokenize: Callable[[str], list[int]], count: int) -> list[int]:
    """The first ``count`` tokens of ``REPLY`` as the engine's ``tokenize`` gives them, without
    the BOS it adds where the model wants one."""
    if not count:
        return []
    bos = len(tokenize(""))  # [BOS] where the model wants one, else nothing
    ids = tokenize(REPLY)[bos:]
    if len(ids) < count:
        raise KvguardError(
            f"params.reply_tokens is {count}; the fixed reply is {len(ids)} tokens here",
            fix=f"use reply_tokens: {len(ids)} or fewer",
            key="params.reply_tokens",
        )
    return ids[:count]
