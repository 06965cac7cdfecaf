"""Scenario ``recall``: a fact placed before the window, asked about after a long filler.

The prompt is the fact, then ``filler_tokens`` of text, then the question. After the prompt the
answer is teacher-forced token by token; the fact counts as recalled when the model's top
choice is the answer's token at every step. A full cache should recall it; a bounded cache
that evicted the fact should not. A budget can require either (``must_recall`` /
``must_forget``); without one, the result is recorded and forgetting is allowed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pytest_kvguard.engines import Engine
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.policies import Policy
from pytest_kvguard.scenarios.stream import PREFILL_CHUNK, _nll

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


def run_recall(engine: Engine, policy: Policy, prompt: RecallPrompt) -> RecallRun:
    """Feed the prompt under the policy (logits only for its last token), then the answer."""
    ids = prompt.prompt
    max_chunk = PREFILL_CHUNK
    if policy.cap is not None:
        max_chunk = min(max_chunk, policy.cap - policy.sinks)
    started = time.perf_counter()
    stream = engine.open_stream(policy, len(ids) + len(prompt.answer))
    try:
        done = 0
        logits = np.empty(0)
        while done < len(ids):
            room = stream.room()
            chunk = max_chunk if room is None else max(1, min(room, max_chunk))
            chunk = min(chunk, len(ids) - done)
            last = done + chunk == len(ids)
            logits = stream.feed(ids[done : done + chunk], logits=last)
            done += chunk
        hits, nll = 0, []
        for token in prompt.answer:
            row = logits[-1:]
            hits += int(np.argmax(row[0]) == token)
            nll.append(float(_nll(row, np.asarray([token]))[0]))
            logits = stream.feed([token])
        evicted, held = stream.evicted, stream.held
    finally:
        stream.close()
    return RecallRun(
        policy=policy,
        prompt_tokens=len(ids),
        fact_end=len(prompt.fact),
        answer_hits=hits,
        answer_tokens=len(prompt.answer),
        answer_nll=sum(nll) / len(nll) if nll else math.nan,
        evicted=evicted,
        held=held,
        seconds=time.perf_counter() - started,
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
