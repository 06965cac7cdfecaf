"""Scenario ``edit_replay``: a long chat is cached, a follow-up arrives; count what is re-prefilled.

The follow-up is an edited earlier message, a regenerated last reply, a plain appended turn, or
history trimmed as templates and agent frameworks do (earlier reasoning dropped). Both prompts are
rendered with the model's own chat template and tokenized by the engine; the engine adapter keeps
what its own memory operations allow and re-prefills the rest. Token counts are exact.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pytest_kvguard.engines import (
    Engine,
    ReplaysPrefix,
    SnapshotsPrefix,
    TokenizesChat,
    engine_info,
)
from pytest_kvguard.errors import EngineError, KvguardError
from pytest_kvguard.gate.policies import DEFAULT_CHECKPOINT_STEP, Policy
from pytest_kvguard.inputs.texts import Text
from pytest_kvguard.paths import resolve_under
from pytest_kvguard.scenarios.base import Check, Context, Fields, Measured, Param, Scenario
from pytest_kvguard.units import mib

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
    engine: Engine,
    policy: Policy,
    first_ids: Sequence[int],
    followup_ids: Sequence[int],
    prefilled: object | None = None,
) -> tuple[ReplayRun, object | None]:
    """Prefill the first prompt into a fresh cache (or restore ``prefilled``, what the engine's
    prefix cache ``save`` returned after that prefill), then replay the follow-up against it:
    through the cache's ``replay`` where it has one (a server counting its own reuse), else by
    keeping the longest prefix the engine can use and prefilling the rest.
    Also returns the saved prefill for the next follow-up, where the engine can save one."""
    cache = engine.open_prefix_cache(policy, max(len(first_ids), len(followup_ids)))
    try:
        if prefilled is None:
            started = time.perf_counter()
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
            # A server decides its own reuse when the follow-up arrives, and counts it.
            reused, reprefilled, restored = cache.replay(followup_ids)
            if reused > split:
                raise EngineError(
                    f"the server reused {reused} tokens of a follow-up that shares only {split} "
                    "with the prompt before it: it held the follow-up from an earlier request",
                    fix="restart the server or flush its prefix cache before the run",
                )
        else:
            # At least one token is decoded, so the follow-up has logits to generate from.
            reused, restored = cache.keep_prefix(min(split, len(followup_ids) - 1))
            cache.extend(followup_ids[reused:], reused)
            reprefilled = len(followup_ids) - reused
        replay = Replay(
            prompt_tokens=len(followup_ids),
            split=split,
            reused=reused,
            reprefilled=reprefilled,
            restored_checkpoint=restored,
            seconds=time.perf_counter() - started,
        )
    finally:
        cache.close()
    return ReplayRun(policy, len(first_ids), replay, memory, seconds), prefilled


@dataclass(frozen=True)
class ReplaySpec:
    """The policy a chat is cached under and the follow-up sent after it."""

    policy: Policy
    chat: str
    followup: str
    message: int | None
    chat_messages: int | None = None
    """Only the chat's first this many messages (None: all)."""

    def describe_followup(self) -> str:
        """``edit #13``, ``append``."""
        return self.followup + (f" #{self.message}" if self.message is not None else "")


@dataclass(frozen=True)
class ReplayDetail:
    followup: str
    """The follow-up, as the table shows it: ``edit #13``."""


class EditReplayScenario(Scenario[ReplaySpec]):
    name = "edit_replay"
    summary = "a cached chat gets a follow-up: count reused and re-prefilled prompt tokens"
    params = (
        Param("chat", "str", DEFAULT_CHAT,
              f"'{DEFAULT_CHAT}' (the bundled 4k-token chat) or a JSON chat file"),
        Param("chat_messages", "int", None,
              "use only the chat's first this many messages (default: all); "
              f"'{DEFAULT_CHAT}' with 11 is 1,845 tokens on Gemma 3, 1,927 on SmolLM2",
              minimum=2),
        Param("followup", "str", None, "edit, regenerate, append or trim_reasoning (required)"),
        Param("message", "int", None,
              "edit: index of the edited message (negative counts from the end)"),
        Param("checkpoints", "int", 0,
              "swa: keep at most this many sliding-layer checkpoints (0: none)",
              minimum=0),
        Param("checkpoint_step", "int", DEFAULT_CHECKPOINT_STEP,
              "swa: tokens between checkpoints", minimum=1),
    )  # fmt: skip
    budgets = ("max_reprefill_tokens", "max_reprefill_fraction", "min_reused_tokens",
               "max_memory_bytes")  # fmt: skip
    engine_path = "prefix_cache"
    detail_type = ReplayDetail
    serves_running_server = True

    def build(self, fields: Fields) -> ReplaySpec:
        assert fields.policy is not None
        p = fields.params
        policy = fields.policy_of("policy", fields.policy)
        if policy.checkpoints and engine_info(fields.engine).remote:
            raise KvguardError(
                f"engine {fields.engine} talks to a running server whose checkpoints are its own "
                "settings: kvguard cannot set them",
                fix="remove params.checkpoints (start the server with its own flag for them)",
                key="params.checkpoints",
            )
        kind, message = p["followup"], p["message"]
        if kind not in FOLLOWUPS:
            raise KvguardError(
                "an edit_replay check needs params.followup" if kind is None
                else f"unknown follow-up '{kind}'",
                fix="use one of " + ", ".join(FOLLOWUPS),
                key="params.followup",
            )  # fmt: skip
        if (kind == "edit") != (message is not None):
            raise KvguardError(
                "params.message goes with followup: edit, and only with it",
                fix="give the index of the edited message with edit; drop it otherwise",
                key="params.message" if message is not None else "params.followup",
            )
        # Parse the chat now: a bad file or index fails before any engine loads.
        conversation = load_conversation(p["chat"], fields.base_dir).first(p["chat_messages"])
        followup(conversation, kind, message)
        return ReplaySpec(policy, p["chat"], kind, message, p["chat_messages"])

    def run(self, ctx: Context, check: Check[ReplaySpec]) -> Measured:
        """Cache the chat under the policy, send the follow-up, count reused and re-prefilled."""
        spec = check.spec
        loaded = ctx.engine(check.engine, check.model)
        conversation = load_conversation(spec.chat, check.base_dir).first(spec.chat_messages)
        chats = (history(conversation), followup(conversation, spec.followup, spec.message))
        # Engine openai takes the ids from its server (vLLM renders and tokenizes a chat in one
        # call) through tokenize_chat; the others render the template, then tokenize the text.
        if isinstance(loaded, TokenizesChat):
            first_ids, second_ids = (loaded.tokenize_chat(chat) for chat in chats)
            first_text = json.dumps(chats[0])  # no rendered text: the messages stand for it
        else:
            first_text, second_text = (loaded.render_chat(chat) for chat in chats)
            first_ids, second_ids = loaded.tokenize(first_text), loaded.tokenize(second_text)
        label = f"{check.engine} {check.model.name} {spec.policy.describe()} {spec.followup}"
        # One prefill per engine, model, policy and chat; each follow-up restores the engine's
        # own snapshot of it into a fresh cache.
        key = ("prefilled", check.engine, check.model.resolve(), spec.policy, tuple(first_ids))
        prefilled = ctx.saved(key)
        if prefilled is None:
            ctx.say(f"{label}: prefilling {len(first_ids)} tokens, then the follow-up")
        else:
            ctx.say(f"{label}: restoring the saved {len(first_ids)}-token prefill")
        run, saved = run_edit_replay(loaded, spec.policy, first_ids, second_ids, prefilled)
        if prefilled is None and saved is not None:
            ctx.save(key, saved)
        replay = run.replay
        ctx.say(f"{label}: reused {replay.reused}, re-prefilled {replay.reprefilled} "
                f"in {replay.seconds:.1f} s")  # fmt: skip
        return Measured(
            policy=spec.policy.describe(),
            tokens=replay.prompt_tokens,
            text=Text(conversation.name, first_text),
            metrics=run.metrics,
            seconds={"prefill": run.prefill_seconds, "replay": replay.seconds},
            tokens_per_second=replay.reprefilled / replay.seconds if replay.seconds else 0.0,
            detail=ReplayDetail(spec.describe_followup()),
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["follow-up", "prompt", "split", "reused", "re-prefilled", "memory", "replay s"]
        lines = []
        for o in outcomes:
            m = o.metrics
            lines.append([[
                o.detail.followup, str(o.tokens), f"{m['split']:.0f}", f"{m['reused_tokens']:.0f}",
                f"{m['reprefill_tokens']:.0f}",
                # A server elsewhere does not say what its cache costs.
                "-" if math.isnan(m["memory_bytes"]) else mib(m["memory_bytes"]),
                f"{o.seconds['replay']:.1f}",
            ]])  # fmt: skip
        return headers, lines


SCENARIO = EditReplayScenario()
