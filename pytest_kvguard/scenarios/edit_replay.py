"""Scenario ``edit_replay``: a long chat is cached, a follow-up arrives; count what is re-prefilled.

The follow-up is an edited earlier message, a regenerated last reply, a plain appended turn, or
history trimmed as templates and agent frameworks do (earlier reasoning dropped). Both prompts are
rendered with the model's own chat template and tokenized by the engine; what is reused is the
decision of the engine's user-facing API (``via: api``) or of kvguard from the engine's memory
operations (``via: memory``). Token counts are exact; a fixed reply forced after the follow-up
is scored against a fresh prefill, so a reuse that is counted is also checked to be right.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pytest_kvguard.engines import (
    API_STATES,
    ReusesThroughApi,
    TokenizesChat,
    engine_info,
)
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.gate.budgets import Budgets
from pytest_kvguard.gate.policies import DEFAULT_CHECKPOINT_STEP, Policy
from pytest_kvguard.inputs.chats import (
    DEFAULT_CHAT,
    FOLLOWUPS,
    followup,
    history,
    load_conversation,
    reply_ids,
)
from pytest_kvguard.inputs.texts import Text
from pytest_kvguard.scenarios.base import (
    KV_PRECISION,
    Check,
    Context,
    Fields,
    Measured,
    Param,
    Scenario,
)
from pytest_kvguard.scenarios.replaying import run_edit_replay
from pytest_kvguard.units import mib

VIA = {
    "api": "the engine's user-facing API decides the reuse: llama-cpp-python's Llama, mlx-lm's "
    "prompt cache as its server keeps one, a server's own cache",
    "memory": "kvguard decides the reuse from what the engine's memory operations allow "
    "(llama.cpp's memory API and SWA checkpoints, mlx-lm's trim_prompt_cache)",
}


@dataclass(frozen=True)
class ReplaySpec:
    """The policy a chat is cached under and the follow-up sent after it."""

    policy: Policy
    chat: str
    followup: str
    message: int | None
    chat_messages: int | None = None
    """Only the chat's first this many messages (None: all)."""
    via: str = "memory"
    """Whose decision the reuse is (``VIA``)."""
    api_state: str = "none"
    """How the app around llama-cpp-python's Llama keeps states (``API_STATES``)."""
    reply_tokens: int = 64
    """Forced reply tokens scored against a fresh prefill (0: not scored, also where the
    engine is a server elsewhere speaking the OpenAI API, which cannot force tokens)."""

    def describe_followup(self) -> str:
        """``edit #13``, ``append``."""
        return self.followup + (f" #{self.message}" if self.message is not None else "")


@dataclass(frozen=True)
class ReplayDetail:
    followup: str
    """The follow-up, as the table shows it: ``edit #13``."""
    via: str = "memory"
    """Whose decision the reuse was: api or memory."""
    path: str = ""
    """What that path calls, in one line."""


def default_via(engine: str) -> str:
    """``api`` where the engine has a user-facing path that decides reuse (a server always
    does), else ``memory``."""
    info = engine_info(engine)
    return "api" if "api_reuse" in info.capabilities or "replay" in info.capabilities else "memory"


class EditReplayScenario(Scenario[ReplaySpec]):
    name = "edit_replay"
    summary = (
        "a cached chat gets a follow-up: count reused and re-prefilled prompt tokens, "
        "and score a forced reply against a fresh prefill"
    )
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
        Param("via", "str", None,
              "api (the engine's user-facing API decides the reuse) or memory (kvguard decides "
              "from the engine's memory operations); default: api where the engine has one "
              "(llama_cpp, mlx, the servers), else memory"),
        Param("api_state", "str", "none",
              "llama_cpp with via: api: none, ram (Llama.set_cache(LlamaRAMCache())) or saved "
              "(save_state after the first request, load_state before the follow-up)"),
        Param("reply_tokens", "int", 64,
              "tokens of a fixed reply forced after the follow-up and scored against a fresh "
              "prefill (0: no correctness score)", minimum=0),
        *KV_PRECISION,
    )  # fmt: skip
    budgets = ("max_reprefill_tokens", "max_reprefill_fraction", "min_reused_tokens",
               "max_memory_bytes", "max_mean_abs_nll_diff", "max_ppl_diff_pct",
               "max_window_missing_tokens")  # fmt: skip
    engine_path = "prefix_cache"
    detail_type = ReplayDetail
    serves_running_server = True

    def build(self, fields: Fields) -> ReplaySpec:
        assert fields.policy is not None
        p = fields.params
        info = engine_info(fields.engine)
        via = p["via"] or default_via(fields.engine)
        if via not in VIA:
            raise KvguardError(f"unknown params.via '{via}'", fix="use api or memory",
                               key="params.via")  # fmt: skip
        server = "replay" in info.capabilities
        if via == "memory" and server:
            raise KvguardError(
                f"engine {fields.engine} is a server: its own cache decides the reuse, and "
                "kvguard has no memory operations to call on it",
                fix="use via: api (the default for a server), or drop params.via",
                key="params.via",
            )
        if via == "api" and not server:
            if "api_reuse" not in info.capabilities:
                raise KvguardError(
                    f"engine {fields.engine} has no user-facing reuse path kvguard can run",
                    fix="use via: memory", key="params.via",
                )  # fmt: skip
            fields = replace(fields, engine_path="api_reuse")
        if via == "api" and not server and p["checkpoints"]:
            raise KvguardError(
                f"engine {fields.engine}'s user-facing API keeps no SWA checkpoints (only "
                "kvguard's memory path and llama-server do)",
                fix="add via: memory to this check, or remove params.checkpoints",
                key="params.checkpoints",
            )
        if p["api_state"] not in API_STATES:
            raise KvguardError(
                f"unknown params.api_state '{p['api_state']}'",
                fix="use " + ", ".join(API_STATES),
                key="params.api_state",
            )
        if p["api_state"] != "none" and (via != "api" or fields.engine != "llama_cpp"):
            raise KvguardError(
                "params.api_state is how an app keeps llama-cpp-python's Llama states: it goes "
                "with engine llama_cpp and via: api only",
                fix="drop params.api_state, or use engine llama_cpp with via: api",
                key="params.api_state",
            )
        policy = fields.policy_of("policy", fields.policy or "")
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
        reply_tokens = 0 if info.remote else p["reply_tokens"]
        return ReplaySpec(policy, p["chat"], kind, message, p["chat_messages"], via,
                          p["api_state"], reply_tokens)  # fmt: skip

    def check_budgets(self, spec: ReplaySpec, budgets: Budgets) -> None:
        """A correctness budget needs a scored reply."""
        for name in ("max_mean_abs_nll_diff", "max_ppl_diff_pct"):
            if spec.reply_tokens == 0 and getattr(budgets, name) is not None:
                raise KvguardError(
                    f"budget {name} compares a scored reply with a fresh prefill, and this check "
                    "scores none (reply_tokens: 0, or a server elsewhere: the OpenAI API cannot "
                    "force tokens)",
                    fix=f"remove {name}, or set params.reply_tokens to 1 or more on an engine "
                    "kvguard runs",
                    key=f"budgets.{name}",
                )

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
        reply = reply_ids(loaded.tokenize, spec.reply_tokens)
        label = (f"{check.engine} {check.model.name} {spec.policy.describe()} {spec.followup} "
                 f"via {spec.via}")  # fmt: skip
        # One prefill per engine, model, policy and chat on the memory path; each follow-up
        # restores the engine's own snapshot of it into a fresh cache. The API path prefills
        # each time: what it keeps between requests is the engine's own business.
        key = ("prefilled", check.engine, check.model.resolve(), spec.policy, tuple(first_ids))
        prefilled = ctx.saved(key) if spec.via == "memory" else None
        if prefilled is None:
            ctx.say(f"{label}: prefilling {len(first_ids)} tokens, then the follow-up")
        else:
            ctx.say(f"{label}: restoring the saved {len(first_ids)}-token prefill")
        # The fresh reference depends on the engine, model, path, cache settings and tokens,
        # not on checkpoints (copies taken between the same batches) nor on how an app keeps
        # states (the reference request starts from an empty cache): checks that differ only
        # there score against one reference, computed once per session.
        reference_key = (
            "fresh_reference", check.engine, check.model.resolve(), spec.via,
            replace(spec.policy, checkpoints=0, checkpoint_step=DEFAULT_CHECKPOINT_STEP),
            len(first_ids), tuple(second_ids), tuple(reply),
        )  # fmt: skip
        reference = ctx.saved(reference_key) if reply else None
        run, saved = run_edit_replay(
            loaded, spec.policy, first_ids, second_ids, prefilled, reply, spec.via,
            spec.api_state, reference,
        )  # fmt: skip
        if prefilled is None and saved is not None:
            ctx.save(key, saved)
        if reference is None and run.replay.fresh_nll is not None:
            ctx.save(reference_key, run.replay.fresh_nll)
        replay = run.replay
        gap = run.metrics["mean_abs_nll_diff"]
        shared = " (the same reference as an earlier check)" if reference is not None else ""
        ctx.say(f"{label}: reused {replay.reused}, re-prefilled {replay.reprefilled} "
                f"in {replay.seconds:.1f} s; reply vs a fresh prefill: mean |dNLL| {gap:.2e} "
                f"over {len(reply)} tokens{shared}")  # fmt: skip
        path = spec.via
        if spec.via == "api" and isinstance(loaded, ReusesThroughApi):
            path = loaded.api_calls(spec.api_state)
        return Measured(
            policy=spec.policy.describe(),
            tokens=replay.prompt_tokens,
            text=Text(conversation.name, first_text),
            metrics=run.metrics,
            seconds={
                "prefill": run.prefill_seconds,
                "replay": replay.seconds,
                "fresh_reference": run.reference_seconds,
            },  # fmt: skip
            tokens_per_second=replay.reprefilled / replay.seconds if replay.seconds else 0.0,
            detail=ReplayDetail(spec.describe_followup(), spec.via, path),
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["follow-up", "via", "prompt", "split", "reused", "re-prefilled",
                   "reuse gap", "memory", "replay s"]  # fmt: skip
        lines = []
        for o in outcomes:
            m = o.metrics
            lines.append([[
                o.detail.followup, o.detail.via, str(o.tokens), f"{m['split']:.0f}",
                f"{m['reused_tokens']:.0f}", f"{m['reprefill_tokens']:.0f}", format_gap(m),
                # A server elsewhere does not say what its cache costs.
                "-" if math.isnan(m["memory_bytes"]) else mib(m["memory_bytes"]),
                f"{o.seconds['replay']:.1f}",
            ]])  # fmt: skip
        return headers, lines


def format_gap(metrics: Mapping[str, float]) -> str:
    """The reuse gap as the table shows it: mean |dNLL| in nats over the scored reply tokens
    (``-`` where nothing was scored)."""
    mean = metrics.get("mean_abs_nll_diff", math.nan)
    if math.isnan(mean):
        return "-"
    return "0" if mean == 0 else f"{mean:.2e}"


SCENARIO = EditReplayScenario()
