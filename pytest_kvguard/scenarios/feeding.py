"""How scenarios feed tokens to an engine and score what comes back: one loop for all of them.

While the cache has room, tokens go in chunks of up to ``PREFILL_CHUNK`` (never past the
room left); once it is full, ``policy.chunk`` tokens per call (1: the decode path; more: the
engine's batched path, which makes room for the whole chunk at once). A policy that never
evicts, or leaves eviction to the engine, is fed ``PREFILL_CHUNK`` at a time throughout.
Chunks end exactly on the points where a scenario samples the engine's figures.
``run_stream`` is the one pass every stream-like scenario (stream, sweep, parity, memory)
makes; recall feeds its own prompt through the same ``chunks`` schedule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from pytest_kvguard.engines import Engine, Stream
from pytest_kvguard.policies import Policy
from pytest_kvguard.scoring import nll_of

PREFILL_CHUNK = 256
"""Tokens decoded per call while no eviction is due; ``policy.chunk`` at a time once it is."""

Progress = Callable[[int, int], None]
"""Called as progress(tokens_done, tokens_total)."""


def chunks(stream: Stream, policy: Policy, n: int, stops: Collection[int] = ()) -> Iterator[int]:
    """The size of each engine call that feeds tokens ``[0, n)``; every chunk ends on a stop.

    Read lazily: each size is decided after the caller fed the previous chunk, from the room
    the stream has left then.
    """
    largest = PREFILL_CHUNK
    if policy.cap is not None:
        largest = min(largest, policy.cap - policy.sinks)
    ends = sorted({n, *(s for s in stops if 0 < s <= n)})
    done = 0
    while done < n:
        room = stream.room()
        if room is None:
            size = largest
        elif room > 0:
            size = min(room, largest)
        else:
            size = policy.chunk
        size = min(size, next(p for p in ends if p > done) - done)
        yield size
        done += size


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


def growth_metric(run: StreamRun) -> dict[str, float]:
    """``kv_growth_after_cap_bytes`` where the run has a cap and a kv_bytes figure."""
    growth = run.kv_growth_after_cap()
    return {} if growth is None else {"kv_growth_after_cap_bytes": growth}


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
    started = time.perf_counter()
    stream = engine.open_stream(policy, n)
    try:
        done = 0
        next_report = 0
        for size in chunks(stream, policy, n, points):
            evicted_before = stream.evicted
            logits = stream.feed(token_ids[done : done + size], logits=score)
            if first_eviction is None and stream.evicted > evicted_before:
                first_eviction = done
            scored = min(size, n - 1 - done)  # the last token has nothing left to predict
            if score and scored > 0:
                nll[done : done + scored] = nll_of(logits[:scored], targets[done : done + scored])
            done += size
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
