"""Scenario ``stream``: feed a long text far past the cache's capacity and score every next token.

The score of token i+1 comes from the logits of feeding token i. Tokens fed after the first
eviction are "post-eviction"; the same split is applied to the baseline run on the same token
ids, so the delta compares like with like.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from pytest_kvguard.engines import Engine
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.policies import Policy

PREFILL_CHUNK = 256
"""Tokens decoded per call while no eviction is due; one at a time once it is."""

Progress = Callable[[int, int], None]
"""Called as progress(tokens_done, tokens_total)."""


@dataclass(frozen=True)
class StreamSample:
    """What the cache held after the first ``tokens`` tokens were fed."""

    tokens: int
    held: int
    """KV entries held (the largest layer)."""
    figures: dict[str, float]
    """The engine's memory figures at that moment (kv_bytes, peak_memory_bytes, ...)."""


@dataclass(frozen=True)
class StreamRun:
    """One policy's pass over the token ids."""

    policy: Policy
    n_tokens: int
    nll: np.ndarray = field(repr=False)
    """nll[i] = -log p(token[i+1] | what the cache held after feeding token i)."""
    first_eviction: int | None
    """Index of the first token fed after an eviction; None if nothing was evicted."""
    kv_entries: int
    """KV entries held at the end (the largest layer)."""
    evicted: int
    seconds: float
    engine_figures: dict[str, float] = field(default_factory=dict)
    """What the engine measured at the end: cache bytes, peak memory, ..."""
    layer_sizes: list[tuple[int, int]] = field(default_factory=list)
    """(tokens seen, entries held) per layer, where the engine exposes it."""
    samples: list[StreamSample] = field(default_factory=list)
    """Figures at the sample points: the cap, any lengths asked for, and the end."""

    @property
    def tokens_per_second(self) -> float:
        return self.n_tokens / self.seconds if self.seconds else math.inf

    def sample(self, tokens: int) -> StreamSample:
        return next(s for s in self.samples if s.tokens == tokens)

    def kv_growth_after_cap(self) -> float | None:
        """KV bytes gained between reaching the cap and the end; None without a cap or figure."""
        cap = self.policy.cap
        if cap is None or cap >= self.n_tokens or "kv_bytes" not in self.engine_figures:
            return None
        at_cap = self.sample(cap).figures["kv_bytes"]
        return max(s.figures["kv_bytes"] for s in self.samples if s.tokens >= cap) - at_cap


def check_reaches_eviction(policy: Policy, n_tokens: int) -> None:
    """Refuse a run that would never evict: it would prove nothing about the policy."""
    if not policy.bounded:
        raise KvguardError(
            "policy 'full' never evicts, so the stream scenario has nothing to judge",
            fix="use a bounded policy (window, sink) as the candidate and full as the baseline",
        )
    if policy.cap is None:
        return  # swa: the model's window decides; a run that never evicts is refused later
    if n_tokens <= policy.cap:
        raise KvguardError(
            f"tokens {n_tokens} <= cap {policy.cap}: eviction would never start",
            fix=f"raise tokens well past the cap (e.g. {policy.cap * 6}) or lower the cap",
        )


def sample_points(policy: Policy, n_tokens: int, lengths: Collection[int] = ()) -> list[int]:
    """Where a run records the engine's figures: the cap (if reached), ``lengths``, the end."""
    points = {n_tokens, *(length for length in lengths if 0 < length <= n_tokens)}
    if policy.cap is not None and policy.cap < n_tokens:
        points.add(policy.cap)
    return sorted(points)


def run_stream(
    engine: Engine,
    policy: Policy,
    token_ids: Sequence[int],
    progress: Progress | None = None,
    lengths: Collection[int] = (),
    score: bool = True,
) -> StreamRun:
    """Feed ``token_ids`` through a fresh stream under ``policy`` and score every next token.

    The engine's figures are sampled at ``sample_points``; chunks end exactly on them.
    ``score=False`` asks the engine for no logits (memory runs): ``nll`` is then empty.
    """
    n = len(token_ids)
    points = sample_points(policy, n, lengths)
    samples: list[StreamSample] = []
    targets = np.asarray(token_ids[1:], dtype=np.int64)
    nll = np.empty(n - 1 if score else 0, dtype=np.float64)
    first_eviction: int | None = None
    max_chunk = PREFILL_CHUNK
    if policy.cap is not None:
        max_chunk = min(max_chunk, policy.cap - policy.sinks)
    started = time.perf_counter()
    stream = engine.open_stream(policy, n)
    try:
        done = 0
        next_report = 0
        while done < n:
            room = stream.room()
            chunk = max_chunk if room is None else max(1, min(room, max_chunk))
            chunk = min(chunk, next(p for p in points if p > done) - done)
            evicted_before = stream.evicted
            logits = stream.feed(token_ids[done : done + chunk], logits=score)
            if first_eviction is None and stream.evicted > evicted_before:
                first_eviction = done
            scored = min(chunk, n - 1 - done)  # the last token has nothing left to predict
            if score and scored > 0:
                nll[done : done + scored] = _nll(logits[:scored], targets[done : done + scored])
            done += chunk
            if done in points:
                samples.append(StreamSample(done, stream.held, stream.figures()))
            if progress is not None and (done >= next_report or done == n):
                progress(done, n)
                next_report = done + max(1, n // 4)
        held, evicted = stream.held, stream.evicted
        figures, layer_sizes = samples[-1].figures, stream.layer_sizes()
    finally:
        stream.close()
    return StreamRun(
        policy=policy,
        n_tokens=n,
        nll=nll,
        first_eviction=first_eviction,
        kv_entries=held,
        evicted=evicted,
        seconds=time.perf_counter() - started,
        engine_figures=figures,
        layer_sizes=layer_sizes,
        samples=samples,
    )


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under a row of logits (stable log-softmax)."""
    wide = logits.astype(np.float64)
    peak = wide.max(axis=1)
    log_norm = peak + np.log(np.exp(wide - peak[:, None]).sum(axis=1))
    result: np.ndarray = log_norm - wide[np.arange(len(targets)), targets]
    return result


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(nll.mean()))) if len(nll) else math.nan


@dataclass(frozen=True)
class StreamResult:
    """A bounded candidate against its baseline on the same token ids, split at first eviction."""

    candidate: StreamRun
    baseline: StreamRun

    @property
    def split(self) -> int:
        """First token fed after an eviction; where none happened, where the cap says it should."""
        split = self.candidate.first_eviction or self.candidate.policy.cap
        assert split is not None
        return split

    @property
    def metrics(self) -> dict[str, float]:
        """Every figure budgets can gate on, by metric name."""
        s = self.split
        cand, base = self.candidate.nll, self.baseline.nll
        post, base_post = perplexity(cand[s:]), perplexity(base[s:])
        return {
            "pre_eviction_ppl": perplexity(cand[:s]),
            "post_eviction_ppl": post,
            "baseline_pre_eviction_ppl": perplexity(base[:s]),
            "baseline_post_eviction_ppl": base_post,
            "ppl_increase_pct": (post / base_post - 1.0) * 100.0,
            "kv_entries": float(self.candidate.kv_entries),
            "evicted": float(self.candidate.evicted),
            "first_eviction": float(s),
            "post_eviction_tokens": float(len(cand) - s),
            **self.candidate.engine_figures,
            **growth_metric(self.candidate),
        }


def growth_metric(run: StreamRun) -> dict[str, float]:
    """``kv_growth_after_cap_bytes`` where the run has a cap and a kv_bytes figure."""
    growth = run.kv_growth_after_cap()
    return {} if growth is None else {"kv_growth_after_cap_bytes": growth}


def compare(candidate: StreamRun, baseline: StreamRun) -> StreamResult:
    # A capped policy that never evicted is a finding (the cap was not applied), not an error.
    if candidate.first_eviction is None and candidate.policy.cap is None:
        raise KvguardError(
            f"policy {candidate.policy.describe()} never evicted over {candidate.n_tokens} tokens",
            fix="raise tokens past the cap",
        )
    if candidate.n_tokens != baseline.n_tokens:
        raise ValueError("candidate and baseline must score the same token ids")
    return StreamResult(candidate, baseline)
