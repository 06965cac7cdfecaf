"""Scenario ``recall``: a fact placed before the window, asked about after a long filler.

The prompt is the fact, then ``filler_tokens`` of text, then the question. After the prompt the
answer is teacher-forced token by token; the fact counts as recalled when the model's top
choice is the answer's token at every step. A full cache should recall it; a bounded cache
that evicted the fact should not. A budget can require either (``must_recall`` /
``must_forget``); without one, the result is recorded and forgetting is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_kvguard.core.budgets import Budgets, Limit
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy, make_policy
from pytest_kvguard.engines import Engine
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import DEFAULT_TEXT, Text, load_text
from pytest_kvguard.scenarios.base import (
    CAP,
    CHUNK,
    EVICT_STEP,
    POSITIONS,
    SINKS,
    Check,
    Context,
    Fields,
    LaterRequest,
    Measured,
    Param,
    Planned,
    RunRequest,
    Scenario,
)
from pytest_kvguard.scenarios.feeding import StreamRun
from pytest_kvguard.scenarios.limits import MAX_KV_ENTRIES
from pytest_kvguard.scenarios.validate import require_text_room

MUST_RECALL = Limit(
    "must_recall", "forgot", "flag", "", "must recall",
    "the fact was not recalled",
    "recall: true = the answer must be the model's top choice at every token.",
)  # fmt: skip
MUST_FORGET = Limit(
    "must_forget", "recalled", "flag", "", "must forget",
    "the fact was still recalled",
    "recall: true = the answer must not be recalled (the policy must really have evicted the "
    "fact). Set neither to allow both: recorded, not gated. Not with must_recall.",
)  # fmt: skip

DEFAULT_FACT = "Note for later: the password of the blue vault is PAPAYA-7.\n\n"
DEFAULT_QUESTION = "\n\nQuestion: what is the password of the blue vault?\nAnswer: the password is"
DEFAULT_ANSWER = " PAPAYA-7"
DEFAULT_FILLER_TOKENS = 1000


@dataclass(frozen=True)
class RecallPrompt:
    """Token ids of the three parts and of the answer (the answer is teacher-forced)."""

    fact: list[int]
    filler: list[int]
    question: list[int]
    answer: list[int]

    @property
    def prompt(self) -> list[int]:
        return [*self.fact, *self.filler, *self.question]


def build_prompt(
    engine: Engine, fact: str, filler_ids: Sequence[int], question: str, answer: str
) -> RecallPrompt:
    """Tokenize each part on its own (BOS once, at the start) and check the answer's tokens."""
    bos = engine.tokenize("")
    fact_ids = engine.tokenize(fact)
    question_ids = engine.tokenize(question)[len(bos) :]
    both = engine.tokenize(question + answer)[len(bos) :]
    if both[: len(question_ids)] != question_ids or len(both) == len(question_ids):
        raise KvguardError(
            "the answer merges into the question's last token",
            fix="start the answer with a space, e.g. answer: ' PAPAYA-7'",
        )
    filler = list(filler_ids[len(bos) :]) if filler_ids[: len(bos)] == bos else list(filler_ids)
    return RecallPrompt(fact_ids, filler, question_ids, both[len(question_ids) :])


@dataclass(frozen=True)
class RecallRun:
    policy: Policy
    prompt_tokens: int
    fact_end: int
    """Position right after the fact."""
    answer_hits: int
    """Answer tokens that were the model's top choice."""
    answer_tokens: int
    answer_nll: float
    """Mean negative log-likelihood of the answer's tokens, in nats."""
    evicted: int
    held: int
    seconds: float

    @property
    def recalled(self) -> bool:
        return self.answer_hits == self.answer_tokens

    @property
    def fact_evicted(self) -> bool:
        """Whether eviction reached into the fact (sinks pinned at the start are never evicted)."""
        return self.evicted > 0 and self.fact_end > self.policy.sinks


@dataclass(frozen=True)
class RecallFeed:
    """The recall prompt (fact, filler, question) and the answer after it, as token ids."""

    fact: str
    question: str
    answer: str
    """Teacher-forced after the question, every token scored."""
    filler_tokens: int
    """Tokens of ``text`` between the fact and the question."""
    text: Text

    @property
    def key(self) -> tuple[Any, ...]:
        return ("recall", self.fact, self.question, self.answer, self.filler_tokens,
                self.text.sha256)  # fmt: skip

    def prompt(self, ctx: Context, engine: str, model: ModelRef) -> RecallPrompt:
        filler = ctx.token_ids(engine, model, self.text, self.filler_tokens + 1)
        loaded = ctx.engine(engine, model)
        return build_prompt(loaded, self.fact, filler, self.question, self.answer)

    def ids(self, ctx: Context, engine: str, model: ModelRef) -> list[int]:
        prompt = self.prompt(ctx, engine, model)
        return [*prompt.prompt, *prompt.answer]


def recall_request(
    engine: str, model: ModelRef, policy: Policy, feed: RecallFeed, prompt: RecallPrompt
) -> RunRequest:
    """The prompt fed as kvguard feeds any stream (logits asked for only from its last token
    on), then the answer one token at a time, each scored: every length from the end of the
    prompt on is a stop."""
    n_prompt = len(prompt.prompt)
    stops = tuple(range(n_prompt, n_prompt + len(prompt.answer) + 1))
    return RunRequest(engine, model, policy, feed, stops, score_from=n_prompt - 1)


def recall_run(run: StreamRun, prompt: RecallPrompt) -> RecallRun:
    """The answer's scores, read from a run over the prompt and the answer."""
    first = len(prompt.prompt) - 1  # the last prompt token's logits predict the answer's first
    answer = np.asarray(prompt.answer)
    scored = slice(first, first + len(answer))
    nll = [float(value) for value in run.nll[scored]]
    return RecallRun(
        policy=run.policy,
        prompt_tokens=len(prompt.prompt),
        fact_end=len(prompt.fact),
        answer_hits=int((run.top1[scored] == answer).sum()),
        answer_tokens=len(answer),
        answer_nll=sum(nll) / len(nll) if nll else math.nan,
        evicted=run.evicted,
        held=run.kv_entries,
        seconds=run.seconds,
    )


@dataclass(frozen=True)
class RecallResult:
    candidate: RecallRun
    baseline: RecallRun

    @property
    def metrics(self) -> dict[str, float]:
        cand, base = self.candidate, self.baseline
        return {
            "recalled": float(cand.recalled),
            "forgot": float(not cand.recalled),
            "answer_hits": float(cand.answer_hits),
            "answer_tokens": float(cand.answer_tokens),
            "answer_nll": cand.answer_nll,
            "baseline_recalled": float(base.recalled),
            "baseline_answer_nll": base.answer_nll,
            "fact_evicted": float(cand.fact_evicted),
            "fact_tokens": float(cand.fact_end),
            "prompt_tokens": float(cand.prompt_tokens),
            "evicted": float(cand.evicted),
            "kv_entries": float(cand.held),
        }


@dataclass(frozen=True)
class RecallSpec:
    policy: Policy
    fact: str = DEFAULT_FACT
    question: str = DEFAULT_QUESTION
    answer: str = DEFAULT_ANSWER
    filler_tokens: int = DEFAULT_FILLER_TOKENS
    text: str = DEFAULT_TEXT


@dataclass(frozen=True)
class RecallDetail:
    """Everything the recall table shows is a figure in ``metrics``."""


class RecallScenario(Scenario[RecallSpec]):
    name = "recall"
    summary = "a fact before the window, asked about after a long filler: recalled or lost"
    params = (
        CAP, SINKS, POSITIONS, EVICT_STEP, CHUNK,
        Param("text", "str", DEFAULT_TEXT, "where the filler comes from: 'pydoc' or a UTF-8 file"),
        Param("filler_tokens", "int", DEFAULT_FILLER_TOKENS,
              "tokens of filler between the fact and the question", minimum=1),
        Param("fact", "str", DEFAULT_FACT, "the sentence placed first"),
        Param("question", "str", DEFAULT_QUESTION, "the question placed after the filler"),
        Param("answer", "str", DEFAULT_ANSWER,
              "the expected answer, teacher-forced; start it with a space"),
    )  # fmt: skip
    limits = (MAX_KV_ENTRIES, MUST_RECALL, MUST_FORGET)
    detail_type = RecallDetail

    def build(self, fields: Fields) -> RecallSpec:
        assert fields.policy is not None
        policy = fields.policy_of("policy", fields.policy)
        p = fields.params
        for key in ("fact", "question", "answer"):
            if not p[key].strip():
                raise KvguardError(f"params.{key} is empty", fix=f"write the {key} as text",
                                   key=f"params.{key}")  # fmt: skip
        require_text_room(fields, p["filler_tokens"] + 1, "params.filler_tokens")
        return RecallSpec(policy, p["fact"], p["question"], p["answer"], p["filler_tokens"],
                          fields.text_name())  # fmt: skip

    def check_budgets(self, spec: RecallSpec, budgets: Budgets) -> None:
        if budgets.must_recall and budgets.must_forget:
            raise KvguardError(
                "must_recall and must_forget together can never both hold",
                fix="keep one of them (neither: recall is recorded, not gated)",
                key="budgets.must_forget",
            )
        if budgets.must_forget and not spec.policy.bounded:
            raise KvguardError(
                f"must_forget with policy '{spec.policy.kind}', which never evicts: it could "
                "never pass",
                fix="use a bounded policy (window, sink), or must_recall",
                key="budgets.must_forget",
            )

    def feed(self, check: Check[RecallSpec]) -> RecallFeed:
        spec = check.spec
        text = load_text(spec.text, check.base_dir)
        return RecallFeed(spec.fact, spec.question, spec.answer, spec.filler_tokens, text)

    def planned_runs(self, check: Check[RecallSpec]) -> list[Planned]:
        """The candidate's run and the full cache's; where the answer starts is known once the
        engine has tokenized the prompt, so each request is made then."""
        feed = self.feed(check)

        def later(policy: Policy) -> LaterRequest:
            def make(ctx: Context) -> RunRequest:
                prompt = feed.prompt(ctx, check.engine, check.model)
                return recall_request(check.engine, check.model, policy, feed, prompt)

            return LaterRequest(check.engine, check.model, policy, make)

        return [later(check.spec.policy), later(make_policy("full"))]

    def run(self, ctx: Context, check: Check[RecallSpec]) -> Measured:
        """The fact, the filler and the question under the policy and under the full cache."""
        engine = check.engine
        feed = self.feed(check)
        prompt = feed.prompt(ctx, engine, check.model)
        runs, fresh = [], []
        for candidate in (check.spec.policy, make_policy("full")):
            # The full-cache run is shared by every recall check of the same prompt.
            request = recall_request(engine, check.model, candidate, feed, prompt)
            stream, new = ctx.run(request)
            run = recall_run(stream, prompt)
            if new:
                ctx.say(
                    f"{engine} {check.model.name} {candidate.describe()}: recall "
                    f"{run.answer_hits}/{run.answer_tokens} answer tokens after "
                    f"{run.prompt_tokens} prompt tokens in {run.seconds:.1f} s"
                )
            runs.append(run)
            fresh.append(new)
        result = RecallResult(*runs)
        return Measured(
            policy=check.spec.policy.describe(),
            tokens=len(prompt.prompt),
            text=feed.text,
            metrics=result.metrics,
            seconds={
                "candidate": runs[0].seconds if fresh[0] else 0.0,
                "baseline": runs[1].seconds if fresh[1] else 0.0,
            },
            tokens_per_second=runs[0].prompt_tokens / runs[0].seconds if runs[0].seconds else 0.0,
            detail=RecallDetail(),
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        headers = ["prompt", "fact evicted", "recalled", "full cache"]
        lines = []
        for o in outcomes:
            m = o.metrics
            hits = f"{m['answer_hits']:.0f}/{m['answer_tokens']:.0f}"
            lines.append([[
                str(o.tokens), "yes" if m["fact_evicted"] else "no",
                f"{'yes' if m['recalled'] else 'no'} ({hits}, nll {m['answer_nll']:.2f})",
                f"{'yes' if m['baseline_recalled'] else 'no'} "
                f"(nll {m['baseline_answer_nll']:.2f})",
            ]])  # fmt: skip
        return headers, lines


SCENARIO = RecallScenario()
