"""Scenario ``edit_replay``: a long chat is cached, a follow-up arrives; count what is re-prefilled.

The follow-up is an edited earlier message, a regenerated last reply, a plain appended turn, or
history trimmed as templates and agent frameworks do (earlier reasoning dropped). Both requests
are the ids the engine's own chat call prefills (``Engine.chat_ids``: the model's chat template
or the check's, the generation prompt, special tokens parsed); what is reused is the decision
of the engine's user-facing API (``via: api``, which makes the chat call itself) or of kvguard
from the engine's memory operations (``via: memory``). Token counts are exact; a fixed reply
forced after the follow-up is scored against a fresh prefill on the same engine and settings,
and the gap judged against the engine's own floor (fresh prefills cut where a correct reuse
may be cut), so a reuse that is counted is also checked to be right.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pytest_kvguard.core.budgets import Budgets, Limit
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import DEFAULT_CHECKPOINT_STEP, Policy
from pytest_kvguard.core.units import mib
from pytest_kvguard.engines import (
    API_STATES,
    ENGINES,
    Prompt,
    ReusesThroughApi,
    engine_info,
)
from pytest_kvguard.inputs.chats import (
    BUNDLED_TEMPLATES,
    DEFAULT_CHAT,
    FOLLOWUPS,
    followup,
    history,
    load_chat_template,
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

MAX_REUSE_EXCESS = Limit(
    "max_reuse_excess", "reuse_excess", "max", " nats", "reuse excess",
    "reuse gap beyond the engine's own floor",
    "edit_replay: the reuse gap minus the floor, in nats per forced reply token. The gap is the "
    "mean |NLL difference| between the reused cache and a fresh prefill of the follow-up on the "
    "same engine and settings; the floor is the same figure between a fresh prefill cut where the"
    " reuse was cut (the tokens it kept, then the rest) and the fresh prefill in the engine's own"
    " batches: this engine's own rounding on these ids (0 where it is exact, and where nothing "
    "was reused).",
    span=(-math.inf, math.inf),
)  # fmt: skip
MAX_REPREFILL_TOKENS = Limit(
    "max_reprefill_tokens", "reprefill_tokens", "max", " tokens", "re-prefill",
    "prompt tokens re-prefilled",
    "edit_replay: follow-up prompt tokens decoded again (llama-server's prompt_n).",
)  # fmt: skip
MAX_REPREFILL_FRACTION = Limit(
    "max_reprefill_fraction", "reprefill_fraction", "max", "", "re-prefill share",
    "share of the follow-up prompt re-prefilled",
    "edit_replay: re-prefilled tokens / follow-up prompt tokens (0 to 1).",
    span=(0.0, 1.0),
)  # fmt: skip
MIN_REUSED_TOKENS = Limit(
    "min_reused_tokens", "reused_tokens", "min", " tokens", "reused",
    "cached tokens reused",
    "edit_replay: tokens served from the cache (llama-server's cache_n).",
)  # fmt: skip
MAX_WINDOW_MISSING_TOKENS = Limit(
    "max_window_missing_tokens", "window_missing_tokens", "max", " tokens", "window missing",
    "sliding-window positions missing under the reused prefix",
    "edit_replay, llama_cpp via api: of the positions the first re-prefilled token attends to in "
    "the sliding layers, those the cache no longer held when the engine kept its prefix "
    "(llama_memory_seq_pos_min). Above 0 the reused prefix is wrong whatever the scores say; the "
    "memory path never reuses such a prefix.",
)  # fmt: skip
MAX_MEMORY_BYTES = Limit(
    "max_memory_bytes", "memory_bytes", "max", " B", "mem",
    "cache plus checkpoint memory",
    "edit_replay: cache state plus checkpoints after the first prompt; bytes or '24 MiB'.",
)  # fmt: skip

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
    reply_tokens: int = 128
    """Forced reply tokens scored against a fresh prefill (0: not scored, also where the
    engine is a server elsewhere speaking the OpenAI API, which cannot force tokens)."""
    chat_template: str | None = None
    """The chat template the check gives its engines (None: the model's own)."""
    stale_window: bool = False
    """The check reuses a prefix whose sliding window is gone on purpose: an error, not a
    verdict, where the reuse kept its window."""

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
    """``api`` where the engine has a user-facing path that decides reuse (capability
    ``api_reuse``, or a prefix cache that replays whole prompts: a server's), else ``memory``."""
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
        Param("followup", "str", None,
              "edit, resend, regenerate, append or trim_reasoning (required)"),
        Param("message", "int", None,
              "edit, resend: index of the edited message (negative counts from the end)"),
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
              "llama_cpp with via: api, how the app keeps its states: "
              + "; ".join(f"{k} ({v})" for k, v in API_STATES.items())),
        Param("reply_tokens", "int", 128,
              "tokens of a fixed reply forced after the follow-up and scored against a fresh "
              "prefill and the engine's floor (0: no correctness score)", minimum=0),
        Param("chat_template", "str", None,
              "the chat template every engine applies, as an app passes one: a Jinja file or "
              f"{', '.join(BUNDLED_TEMPLATES)} (bundled); default: the model's own. A model "
              "without one needs it: the engines' own fallbacks differ"),
        Param("stale_window", "bool", False,
              "true: the check reuses a prefix whose sliding window is gone on purpose (a "
              "control, or a finding): ERROR where the reuse kept its whole window "
              "(window_missing_tokens 0), since it then tests nothing stale (where the engine "
              "reuses nothing, the expected violation reads MISSED: the finding is gone); "
              "llama_cpp via api"),
        *KV_PRECISION,
    )  # fmt: skip
    limits = (
        MAX_REUSE_EXCESS,
        MAX_REPREFILL_TOKENS,
        MAX_REPREFILL_FRACTION,
        MIN_REUSED_TOKENS,
        MAX_WINDOW_MISSING_TOKENS,
        MAX_MEMORY_BYTES,
    )
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
        # Capability replay: its prefix cache takes whole prompts and decides the reuse itself
        # (the servers); there is nothing for kvguard's memory path to call.
        decides_reuse = "replay" in info.capabilities
        if via == "memory" and decides_reuse:
            raise KvguardError(
                f"engine {fields.engine} is a server: its own cache decides the reuse, and "
                "kvguard has no memory operations to call on it",
                fix="use via: api (the default for a server), or drop params.via",
                key="params.via",
            )
        if via == "api" and not decides_reuse:
            if "api_reuse" not in info.capabilities:
                raise KvguardError(
                    f"engine {fields.engine} has no user-facing reuse path kvguard can run",
                    fix="use via: memory", key="params.via",
                )  # fmt: skip
            fields = replace(fields, engine_path="api_reuse")
        if via == "api" and not decides_reuse and p["checkpoints"]:
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
        keeping = [e for e, i in ENGINES.items() if len(i.api_states) > 1]
        if p["api_state"] != "none" and (via != "api" or p["api_state"] not in info.api_states):
            raise KvguardError(
                f"params.api_state is how an app keeps an engine API's states: {p['api_state']} "
                f"goes with via: api on engine {' or '.join(keeping) or 'none'} only",
                fix=f"drop params.api_state, or use engine {' or '.join(keeping)} with via: api",
                key="params.api_state",
            )
        policy = fields.policy_of(
            "policy", fields.policy or "", checkpoints=p["checkpoints"],
            checkpoint_step=p["checkpoint_step"],
        )  # fmt: skip
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
        if (kind in ("edit", "resend")) != (message is not None):
            raise KvguardError(
                "params.message goes with followup: edit or resend, and only with them",
                fix="give the index of the edited message with edit or resend; drop it otherwise",
                key="params.message" if message is not None else "params.followup",
            )
        # Parse the chat now: a bad file or index fails before any engine loads.
        conversation = load_conversation(p["chat"], fields.base_dir).first(p["chat_messages"])
        followup(conversation, kind, message)
        template = p["chat_template"]
        if template is not None:
            load_chat_template(template, fields.base_dir)  # a bad file fails here
        if p["stale_window"] and not (info.window_probe and via == "api"):
            probing = " or ".join(e for e, i in ENGINES.items() if i.window_probe) or "none"
            raise KvguardError(
                "params.stale_window is checked against the window the cache still held when "
                f"the engine kept its prefix, which only {probing} via: api reads",
                fix=f"drop params.stale_window, or use engine {probing} with via: api",
                key="params.stale_window",
            )
        reply_tokens = 0 if info.remote else p["reply_tokens"]
        return ReplaySpec(policy, p["chat"], kind, message, p["chat_messages"], via,
                          p["api_state"], reply_tokens, template, p["stale_window"])  # fmt: skip

    def check_budgets(self, spec: ReplaySpec, budgets: Budgets) -> None:
        """A correctness budget needs a scored reply."""
        if spec.reply_tokens == 0 and budgets.max_reuse_excess is not None:
            raise KvguardError(
                "budget max_reuse_excess compares a scored reply with fresh prefills, and this "
                "check scores none (reply_tokens: 0, or a server elsewhere: the OpenAI API "
                "cannot force tokens)",
                fix="remove max_reuse_excess, or set params.reply_tokens to 1 or more on an "
                "engine kvguard runs",
                key="budgets.max_reuse_excess",
            )

    def run(self, ctx: Context, check: Check[ReplaySpec]) -> Measured:
        """Cache the chat under the policy, send the follow-up, count reused and re-prefilled,
        and score the reply against fresh prefills."""
        spec = check.spec
        loaded = ctx.engine(check.engine, check.model)
        conversation = load_conversation(spec.chat, check.base_dir).first(spec.chat_messages)
        template = (None if spec.chat_template is None
                    else load_chat_template(spec.chat_template, check.base_dir))  # fmt: skip
        first, second = (
            Prompt(tuple(loaded.chat_ids(chat, template)), tuple(chat), template)
            for chat in (history(conversation), followup(conversation, spec.followup,
                                                          spec.message))
        )  # fmt: skip
        reply = reply_ids(loaded.tokenize, spec.reply_tokens)
        label = (f"{check.engine} {check.model.name} {spec.policy.describe()} {spec.followup} "
                 f"via {spec.via}")  # fmt: skip
        # One prefill per engine, model, policy and chat on the memory path; each follow-up
        # restores the engine's own snapshot of it into a fresh cache. The API path prefills
        # each time: what it keeps between requests is the engine's own business.
        key = ("prefilled", check.engine, check.model.resolve(), spec.policy, first.ids)
        prefilled = ctx.saved(key) if spec.via == "memory" else None
        if prefilled is None:
            ctx.say(f"{label}: prefilling {len(first.ids)} tokens, then the follow-up")
        else:
            ctx.say(f"{label}: restoring the saved {len(first.ids)}-token prefill")
        # The fresh prefills depend on the engine, model, path, cache settings and tokens, not
        # on checkpoints (copies taken between the same batches) nor on how an app keeps
        # states (they start from an empty cache): checks that differ only there share them,
        # each computed once per session, the reference (cut 0) and each floor cut alike.
        fresh_key = (
            "fresh_prefill", check.engine, check.model.resolve(), spec.via,
            replace(spec.policy, checkpoints=0, checkpoint_step=DEFAULT_CHECKPOINT_STEP),
            len(first.ids), second.ids, tuple(reply),
        )  # fmt: skip
        known = ctx.saved(fresh_key) or {}
        run, saved, fresh = run_edit_replay(
            loaded, spec.policy, first, second, prefilled, reply, spec.via, spec.api_state,
            known,
        )  # fmt: skip
        if prefilled is None and saved is not None:
            ctx.save(key, saved)
        ctx.save(fresh_key, fresh)
        replay = run.replay
        m = run.metrics
        shared = sorted(c for c in fresh if c in known)
        cut = ", ".join(map(str, sorted(replay.cut_nll))) or "none"
        ctx.say(f"{label}: reused {replay.reused}, re-prefilled {replay.reprefilled} "
                f"in {replay.seconds:.1f} s; reply vs a fresh prefill over {len(reply)} tokens: "
                f"mean |dNLL| {m['mean_abs_nll_diff']:.4f} nats, floor {m['reuse_floor']:.4f} "
                f"(cut at {cut}), excess {m['reuse_excess']:+.4f}, shift {m['nll_shift']:+.4f}"
                + (f"; fresh prefills cut at {shared} shared with an earlier check"
                   if shared else ""))  # fmt: skip
        if spec.stale_window and replay.reused and not m.get("window_missing_tokens"):
            raise KvguardError(
                f"this check is built to reuse a prefix whose sliding window is gone, and the "
                f"engine kept {replay.reused} tokens with their whole window: it no longer "
                "tests a stale reuse (the edit moved inside the window?)",
                fix="move params.message earlier (further from the end than the window), or "
                "drop params.stale_window",
                key="params.stale_window",
            )
        path = spec.via
        if spec.via == "api" and isinstance(loaded, ReusesThroughApi):
            path = loaded.api_calls(spec.api_state)
        return Measured(
            policy=spec.policy.describe(),
            tokens=replay.prompt_tokens,
            text=Text(conversation.name, json.dumps(first.messages)),
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
                   "reuse gap", "floor", "excess", "memory", "replay s"]  # fmt: skip
        lines = []
        for o in outcomes:
            m = o.metrics
            lines.append([[
                o.detail.followup, o.detail.via, str(o.tokens), f"{m['split']:.0f}",
                f"{m['reused_tokens']:.0f}", f"{m['reprefill_tokens']:.0f}",
                *format_gap(m),
                # A server elsewhere does not say what its cache costs.
                "-" if math.isnan(m["memory_bytes"]) else mib(m["memory_bytes"]),
                f"{o.seconds['replay']:.1f}",
            ]])  # fmt: skip
        return headers, lines


def format_gap(metrics: Mapping[str, float]) -> tuple[str, str, str]:
    """The reuse gap (mean |dNLL|), the floor and the excess as the table shows them, in
    nats per reply token (``-`` where nothing was scored)."""
    gap = metrics.get("mean_abs_nll_diff", math.nan)
    if math.isnan(gap):
        return "-", "-", "-"
    return (f"{gap:.4f}", f"{metrics['reuse_floor']:.4f}",
            f"{metrics['reuse_excess']:+.4f}")  # fmt: skip


SCENARIO = EditReplayScenario()
