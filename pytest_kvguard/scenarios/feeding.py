"""How scenarios feed tokens to an engine and score what comes back: one loop for all of them.

While the cache has room, tokens go in chunks of up to ``PREFILL_CHUNK`` (never past the
room left); once it is full, ``policy.chunk`` tokens per call (1: the decode path; more: the
engine's batched path, which makes room for the whole chunk at once). A policy that never
evicts, or leaves eviction to the engine, is fed ``PREFILL_CHUNK`` at a time throughout.
Chunks end exactly on the points where a scenario samples the engine's figures.
``run_specs`` is the one pass every stream-like scenario (stream, sweep, parity, memory,
recall) makes, for one run or for several decoded together (``RunSpec`` each); ``run_stream``
is it for one policy over one text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from pytest_kvguard.core.policies import Policy
from pytest_kvguard.core.scoring import nll_of
from pytest_kvguard.engines import Engine, GroupsStreams, Stream, StreamGroup

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
    top1: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64), repr=False)
    """top1[i] = the token the logits after feeding token i rank first; -1 where not scored."""
    quantized_from: int | None = None
    """Tokens fed when the cache first held quantized keys and values; None: it never did."""

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


@dataclass(frozen=True)
class RunSpec:
    """One pass to make: a policy over token ids, its figures sampled at ``lengths``.

    ``score_from`` is the first index i whose nll[i] (the score of token i + 1) is wanted;
    engine calls that end before it ask for no logits. None: nothing is scored (memory runs).
    """

    policy: Policy
    token_ids: Sequence[int]
    lengths: tuple[int, ...] = ()
    score_from: int | None = 0


class _Pass:
    """One policy's pass over its token ids: its own chunk schedule, scores and samples."""

    def __init__(self, stream: Stream, spec: RunSpec) -> None:
        token_ids, n = spec.token_ids, len(spec.token_ids)
        self.stream, self.policy, self.token_ids, self.n = stream, spec.policy, token_ids, n
        self.points = sample_points(spec.policy, n, spec.lengths)
        self.score_from = spec.score_from
        self.targets = np.asarray(token_ids[1:], dtype=np.int64)
        scored = 0 if spec.score_from is None else n - 1
        self.nll = np.full(scored, np.nan, dtype=np.float64)
        self.top1 = np.full(scored, -1, dtype=np.int64)
        self.first_eviction: int | None = None
        self.samples: list[StreamSample] = []
        self.done = 0
        self._one_alone = False
        self._sizes = chunks(stream, spec.policy, n, self.points)
        self.pending: int | None = next(self._sizes, None)
        """The size of the next engine call; None once every token is fed."""

    def wants_logits(self, size: int) -> bool:
        """Whether the next call of ``size`` tokens ends at or past the first scored index."""
        return self.score_from is not None and self.done + size - 1 >= self.score_from

    @property
    def next_token(self) -> int:
        return int(self.token_ids[self.done])

    @property
    def fed_one_alone(self) -> bool:
        """Whether the pass has made a one-token call of its own on a full cache, or has no
        more to feed."""
        return self.pending is None or self._one_alone

    def feed_alone(self) -> None:
        assert self.pending is not None
        size, evicted_before = self.pending, self.stream.evicted
        self._one_alone = self._one_alone or (size == 1 and self.stream.room() == 0)
        logits = self.stream.feed(
            self.token_ids[self.done : self.done + size], logits=self.wants_logits(size)
        )
        self.took(size, logits, evicted_before)

    def took(self, size: int, logits: np.ndarray, evicted_before: int) -> None:
        """Score what the call returned, sample the figures where due, plan the next call."""
        done, stream = self.done, self.stream
        if self.first_eviction is None and stream.evicted > evicted_before:
            self.first_eviction = done
        if self.wants_logits(size):
            assert self.score_from is not None
            first = max(done, self.score_from)
            last = min(done + size, self.n - 1)  # the last token has nothing left to predict
            if last > first:
                rows = logits[first - done : last - done]
                self.nll[first:last] = nll_of(rows, self.targets[first:last])
                self.top1[first:last] = rows.argmax(axis=1)
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
            top1=self.top1,
            quantized_from=self.stream.quantized_from,
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
    spec = RunSpec(policy, token_ids, tuple(lengths), 0 if score else None)
    return run_specs(engine, [spec], progress)[0]


def run_streams(
    engine: Engine,
    policies: Sequence[Policy],
    token_ids: Sequence[int],
    progress: Progress | None = None,
    lengths: Collection[int] = (),
) -> list[StreamRun]:
    """``run_stream`` for several policies over the same token ids (see ``run_specs``)."""
    return run_specs(engine, [RunSpec(p, token_ids, tuple(lengths)) for p in policies], progress)


def run_specs(
    engine: Engine, specs: Sequence[RunSpec], progress: Progress | None = None
) -> list[StreamRun]:
    """Every pass, each through a fresh stream of its own policy. Several passes share each
    decode step's pass over the weights where the engine can (``Engine.open_stream_group``):
    each keeps its own cache, token ids, chunk schedule and figures, and a pass that ends
    early leaves the group. Without a group they run one after another. In a group every
    run's ``seconds`` is the whole group's wall time.
    """
    if not specs:
        return []
    if len(specs) > 1 and not isinstance(engine, GroupsStreams):
        return [run_specs(engine, [spec], progress)[0] for spec in specs]
    started = time.perf_counter()
    group: StreamGroup | None = None
    if len(specs) == 1:
        spec = specs[0]
        streams: Sequence[Stream] = [engine.open_stream(spec.policy, len(spec.token_ids))]
    else:
        assert isinstance(engine, GroupsStreams)
        group = engine.open_stream_group(
            [spec.policy for spec in specs], max(len(s.token_ids) for s in specs)
        )
        streams = group.streams
    try:
        passes = [_Pass(stream, spec) for stream, spec in zip(streams, specs, strict=True)]
        _feed_all(passes, group, progress)
        seconds = time.perf_counter() - started
        return [one.result(seconds) for one in passes]
    finally:
        if group is not None:
            group.close()
        else:
            streams[0].close()


def _feed_all(passes: list[_Pass], group: StreamGroup | None, progress: Progress | None) -> None:
    """Feed every pass to its end.

    In a group, each pass is first fed alone, one pass after another, through its fill and its
    first one-token call: until then it runs exactly as it would in a stream of its own, so an
    engine can measure figures its group rows cannot split (mlx's peak memory) over that part.
    From then on a call of one token that every pass still running makes at the same token
    index (past the cap) goes through the group in one engine call: passes of one group key at
    the same index hold as many entries. Anything else goes pass by pass, the pass furthest
    behind first, so the passes meet again."""
    total = sum(p.n for p in passes)
    next_report = 0
    while True:
        live = [p for p in passes if p.pending is not None]
        if not live:
            return
        filling = [p for p in live if group is not None and not p.fed_one_alone]
        behind = min(p.done for p in live)
        together = (
            group is not None
            and not filling
            and len(live) > 1
            and all(p.done == behind and p.pending == 1 for p in live)
        )
        if filling:
            filling[0].feed_alone()
        elif together:
            assert group is not None
            rows = [row for row, p in enumerate(passes) if p.pending is not None]
            evicted_before = [p.stream.evicted for p in live]
            logits = group.feed_rows(rows, [p.next_token for p in live])
            for k, (one, before) in enumerate(zip(live, evicted_before, strict=True)):
                one.took(1, logits[k : k + 1], before)
        else:
            for one in live:
                if one.done == behind:
                    one.feed_alone()
        done = sum(p.done for p in passes)
        if progress is not None and (done >= next_report or done == total):
            progress(done, total)
            next_report = done + max(1, total // 4)
