"""Chats for edit_replay: the bundled ``tutor`` chat or a JSON chat file, the follow-ups sent
after it (an edit, a regenerated reply, an appended turn, trimmed reasoning), the chat template
a check gives its engines, and the fixed reply forced after a follow-up to score it.

Each request is a list of messages, as an app passes them to its engine's chat call; the
engine's own chat call turns them into token ids (``Engine.chat_ids``: the template applied,
the generation prompt added, special tokens parsed)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.paths import resolve_under

DEFAULT_CHAT = "tutor"
BUNDLED_TEMPLATES = ("gemma3-it",)
"""Chat templates shipped with kvguard (``data/chat_templates/NAME.jinja``): ``gemma3-it`` is
the template Gemma 3's instruction-tuned releases ship, for the bundled Gemma 3 270M base GGUF,
which carries none."""
FOLLOWUPS = {
    "edit": "message `message` gets EDIT_SUFFIX appended; everything else stays",
    "resend": "user message `message` gets EDIT_SUFFIX appended and every message after it is "
    "dropped, as a chat app resends an edited question: the reply follows the edit",
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
    "made before you start. Most mistakes show up as an answer that is far from that estimate. "
    "The same habit helps when you read code. Before you run a function, say in one sentence "
    "what it should return for a small input you can work out by hand, then run it on that "
    "input and compare. When the two disagree, the difference usually points at one line: a "
    "loop that stops one step too early, a name that refers to an older value, or a default "
    "argument that was shared between calls. Print the values around that line, or step "
    "through it in a debugger, and the cause is rarely far away. Keep each change small and "
    "test it before you make the next one, so that when something breaks you know which change "
    "broke it. Write down what you expected and what you saw; the notes make the next bug "
    "easier to find, and they are the first thing a colleague will ask for when you need help. "
    "Finally, when the answer is right, read the code once more and ask whether a reader who "
    "has never seen it would understand why each line is there. If not, rename a variable, "
    "split a long expression into two steps, or add a short comment that says why, not what. "
    "Code that explains itself is easier to check, and easier to change when the question "
    "changes next week."
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


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template a check gives its engines (``params.chat_template``), passed to
    each the way an app passes one: llama-cpp-python's ``Jinja2ChatFormatter`` as the
    ``Llama``'s chat handler, llama-server's ``--chat-template-file``, mlx-lm's
    ``apply_chat_template(chat_template=...)``."""

    name: str
    """As the check wrote it: a bundled name or a file path."""
    path: Path
    source: str
    """The Jinja text."""


class NoChatTemplate(KvguardError):
    """A chat request for a model that carries no chat template, with none given."""

    def __init__(self, model: str, **kwargs: object) -> None:
        if kwargs:  # unpickled in the pytest process: the message is already whole
            super().__init__(model, **kwargs)  # type: ignore[arg-type]
            return
        super().__init__(
            f"{model} carries no chat template, and each engine falls back to another "
            "(llama-cpp-python's chat call: llama-2 [INST]; llama.cpp's C API and llama-server: "
            "chatml; mlx_lm.server: plain 'USER: ... ASSISTANT:' text), so there is no one "
            "prompt an app sends",
            fix="give a chat template (params.chat_template in a budgets file, --chat-template "
            "on the command line): a Jinja file, or gemma3-it (the template Gemma 3's "
            "instruction-tuned releases ship) for Gemma 3",
            key="params.chat_template",
        )


def load_chat_template(spec: str, base_dir: Path) -> ChatTemplate:
    """A bundled template by name (``BUNDLED_TEMPLATES``), or a Jinja file."""
    if spec in BUNDLED_TEMPLATES:
        resource = resources.files("pytest_kvguard").joinpath(f"data/chat_templates/{spec}.jinja")
        source = resource.read_text("utf-8")
        path = Path(str(resource))
        if not path.is_file():  # a zipped install: a file a server can be given
            path = Path(tempfile.mkdtemp(prefix="kvguard-template-")) / f"{spec}.jinja"
            path.write_text(source, encoding="utf-8")
        return ChatTemplate(spec, path, source)
    path = resolve_under(spec, base_dir)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise KvguardError(
            f"chat template '{spec}': {why}",
            fix="give a Jinja chat template file, or one of: " + ", ".join(BUNDLED_TEMPLATES),
            key="params.chat_template",
        ) from None
    if "{" not in source:
        raise KvguardError(
            f"chat template '{spec}' has no Jinja in it",
            fix="give the template's Jinja text (tokenizer_config.json's chat_template)",
            key="params.chat_template",
        )
    return ChatTemplate(spec, path, source)


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
    """The first request's messages: every message, reasoning included."""
    return [m.rendered(with_reasoning=True) for m in conversation.messages]


def followup(conversation: Conversation, kind: str, message: int | None) -> list[dict[str, str]]:
    """The follow-up request's messages."""
    messages = list(conversation.messages)
    if kind in ("edit", "resend"):
        if message is None or not -len(messages) <= message < len(messages):
            raise KvguardError(
                f"{kind} needs a message index within the chat's {len(messages)} messages",
                fix="set params.message, e.g. 1 (near the start) or -3 (near the end)",
                key="params.message",
            )
        edited = messages[message]
        if kind == "resend" and edited.role != "user":
            raise KvguardError(
                f"resend edits a user message, and message {message} is the {edited.role}'s",
                fix="set params.message to a user message's index (odd ones in the tutor chat)",
                key="params.message",
            )
        messages[message] = Message(edited.role, edited.content + EDIT_SUFFIX, edited.reasoning)
        if kind == "resend":
            del messages[message % len(messages) + 1 :]
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: where the edited request starts to differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reply_ids(tokenize: Callable[[str], list[int]], count: int) -> list[int]:
    """The first ``count`` tokens of ``REPLY`` as the engine's ``tokenize`` gives them, without
    the BOS it adds where the model wants one: what the model generates after the request's
    generation prompt."""
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
