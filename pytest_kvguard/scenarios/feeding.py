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

from pytest_kvguard.engines import Engine, Stream, StreamGroup
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


class _Pass:
    """One policy's pass over the token ids: its own chunk schedule, scores and samples."""

    def __init__(
        self, stream: Stream, policy: Policy, token_ids: Sequence[int], points: list[int],
        score: bool,
    ) -> None:  # fmt: skip
        n = len(token_ids)
        self.stream, self.policy, self.token_ids = stream, policy, token_ids
        self.points, self.score, self.n = points, score, n
        self.targets = np.asarray(token_ids[1:], dtype=np.int64)
        self.nll = np.empty(n - 1 if score else 0, dtype=np.float64)
        self.first_eviction: int | None = None
        self.samples: list[StreamSample] = []
        self.done = 0
        self._sizes = chunks(stream, policy, n, points)
        self.pending: int | None = next(self._sizes, None)
        """The size of the next engine call; None once every token is fed."""

    def feed_alone(self) -> None:
        assert self.pending is not None
        size, evicted_before = self.pending, self.stream.evicted
        logits = self.stream.feed(self.token_ids[self.done : self.done + size], logits=self.score)
        self.took(size, logits, evicted_before)

    def took(self, size: int, logits: np.ndarray, evicted_before: int) -> None:
        """Score what the call returned, sample the figures where due, plan the next call."""
        done, stream = self.done, self.stream
        if self.first_eviction is None and stream.evicted > evicted_before:
            self.first_eviction = done
        scored = min(size, self.n - 1 - done)  # the last token has nothing left to predict
        if self.score and scored > 0:
            self.nll[done : done + scored] = nll_of(
                logits[:scored], self.targets[done : done + scored]
            )
        self.done = done + size
        if self.done in self.points:
            self.samples.append(StreamSample(self.done, stream.held, stream.figures()))
        # Read only now: the schedule decides each size from the room left after this call.
        self.pending = next(self._sizes, None)

    def result(self, seconds: float) -> StreamRun:
        return StreamRun(
            policy=self.policy,
            n_tokens=self.n,
            nll=self.nll,
            first_eviction=self.first_eviction,
            kv_entries=self.stream.held,
            evicted=self.stream.evicted,
            seconds=seconds,
            engine_figures=self.samples[-1].figures,
            layer_sizes=self.stream.layer_sizes(),
            samples=self.samples,
        )


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
    started = time.perf_counter()
    stream = engine.open_stream(policy, len(token_ids))
    try:
        one = _Pass(stream, policy, token_ids, sample_points(policy, len(token_ids), lengths),
                    score)  # fmt: skip
        _feed_all([one], None, progress)
        return one.result(time.perf_counter() - started)
    finally:
        stream.close()


def run_streams(
    engine: Engine,
    policies: Sequence[Policy],
    token_ids: Sequence[int],
    progress: Progress | None = None,
    lengths: Collection[int] = (),
) -> list[StreamRun]:
    """``run_stream`` for several policies at once, sharing each decode step's pass over the
    weights where the engine can (``Engine.open_stream_group``); each policy keeps its own
    cache, chunk schedule and figures. Without a group, the policies run one after another.
    Every run's ``seconds`` is the whole group's wall time.
    """
    open_group = getattr(engine, "open_stream_group", None)
    if len(policies) == 1 or open_group is None:
        return [run_stream(engine, p, token_ids, progress, lengths) for p in policies]
    n = len(token_ids)
    started = time.perf_counter()
    group: StreamGroup = open_group(policies, n)
    try:
        passes = [
            _Pass(stream, policy, token_ids, sample_points(policy, n, lengths), True)
            for stream, policy in zip(group.streams, policies, strict=True)
        ]
        _feed_all(passes, group, progress)
        seconds = time.perf_counter() - started
        return [one.result(seconds) for one in passes]
    finally:
        group.close()


def _feed_all(passes: list[_Pass], group: StreamGroup | None, progress: Progress | None) -> None:
    """Feed every pass to its end. A decode step that every pass takes at the same token (one
    token each, caches full) goes through the group in one engine call; anything else (the
    fill up to the cap, where sink counts cut their chunks differently) goes pass by pass,
    the pass furthest behind first, so the passes meet again at the cap."""
    n = passes[0].n
    next_report = 0
    while True:
        live = [p for p in passes if p.pending is not None]
        if not live:
            return
        behind = min(p.done for p in live)
        together = (
            group is not None
            and len(live) == len(passes) > 1
            and all(p.done == behind and p.pending == 1 for p in live)
        )
        if together:
            assert group is not None
            evicted_before = [p.stream.evicted for p in passes]
            rows = group.feed_one(passes[0].token_ids[behind])
            for k, (one, before) in enumerate(zip(passes, evicted_before, strict=True)):
                one.took(1, rows[k : k + 1], before)
        else:
            for one in live:
                if one.done == behind:
                    one.feed_alone()
        done = min((p.done for p in passes if p.pending is not None), default=n)
        if progress is not None and (done >= next_report or done == n):
            progress(done, n)
            next_report = done + max(1, n // 4)
