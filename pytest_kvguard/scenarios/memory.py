"""Scenario ``memory``: KV bytes at several context lengths, measured against the prediction.

One stream run under the policy, fed exactly as the ``stream`` scenario feeds it, records the
engine's own figures at each length; ``engines.kv_size.predict_engine_kv_bytes`` says what the
policy should hold there. A measured figure far above the prediction means the engine kept more than
the policy allows: the cap or the window was not applied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_kvguard.core.budgets import Budgets, Limit
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.core.units import format_size
from pytest_kvguard.engines.kv_size import predict_engine_kv_bytes, rotating_capacity
from pytest_kvguard.inputs.architecture import load_arch
from pytest_kvguard.inputs.models import ModelArch
from pytest_kvguard.inputs.texts import load_text
from pytest_kvguard.scenarios.base import (
    CAP,
    CHUNK,
    EVICT_STEP,
    POSITIONS,
    SINKS,
    TEXT,
    Check,
    Context,
    Fields,
    Measured,
    Panel,
    Param,
    Planned,
    RunRequest,
    Scenario,
    TextFeed,
)
from pytest_kvguard.scenarios.extras import kv_bytes_panels
from pytest_kvguard.scenarios.feeding import StreamRun, chunks, growth_metric
from pytest_kvguard.scenarios.limits import (
    BOUNDED,
    MAX_KV_BYTES,
    MAX_KV_DEVIATION_PCT,
    MAX_KV_ENTRIES,
    MAX_PEAK_MEMORY_BYTES,
)
from pytest_kvguard.scenarios.validate import ascending_counts, check_bounded_run, require_text_room

MAX_KV_BYTES_PER_TOKEN = Limit(
    "max_kv_bytes_per_token", "kv_bytes_per_token", "max", " B/token", "kv/token",
    "KV bytes per token at the longest length",
    "memory: KV bytes / tokens fed at the longest length; bytes or a size such as '24 KiB'.",
)  # fmt: skip

DEFAULT_LENGTHS = (512, 1024, 2048, 4096)
NOT_APPLIED_RATIO = 1.5
"""Measured above this many times the prediction: flagged "cap or window not applied" (and, for
a quantized cache on ``stream``, "not quantized as asked": 8 bits hold 1.9x less than f16 on
llama.cpp, 3.6x less than float32 on mlx)."""


@dataclass(frozen=True)
class MemoryRow:
    """Predicted and measured KV bytes after ``tokens`` tokens."""

    tokens: int
    held: int
    kv_bytes: float
    predicted_bytes: float
    peak_memory_bytes: float

    @property
    def deviation_pct(self) -> float:
        return (self.kv_bytes / self.predicted_bytes - 1.0) * 100.0

    @property
    def not_applied(self) -> bool:
        return self.kv_bytes > self.predicted_bytes * NOT_APPLIED_RATIO

    def to_json(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "held": self.held,
            "kv_bytes": self.kv_bytes,
            "predicted_bytes": self.predicted_bytes,
            "deviation_pct": self.deviation_pct,
            "peak_memory_bytes": self.peak_memory_bytes,
            "not_applied": float(self.not_applied),
        }


@dataclass(frozen=True)
class MemoryResult:
    run: StreamRun
    rows: list[MemoryRow]

    @property
    def metrics(self) -> dict[str, float]:
        """Figures budgets gate on: the longest length's, and the worst deviation."""
        last = self.rows[-1]
        return {
            "kv_bytes": last.kv_bytes,
            "kv_bytes_predicted": last.predicted_bytes,
            "kv_bytes_per_token": last.kv_bytes / last.tokens,
            "kv_deviation_pct": max(abs(row.deviation_pct) for row in self.rows),
            "kv_over_prediction": max(row.kv_bytes / row.predicted_bytes for row in self.rows),
            "kv_entries": float(self.run.kv_entries),
            "peak_memory_bytes": max(row.peak_memory_bytes for row in self.rows),
            **growth_metric(self.run),
        }

    def findings(self) -> list[str]:
        """A violation when, at any length, the engine held far more than the policy allows."""
        over = [row for row in self.rows if row.not_applied]
        if not over:
            return []
        worst = max(over, key=lambda row: row.kv_bytes / row.predicted_bytes)
        at = ", ".join(str(row.tokens) for row in over)
        return [
            f"cap or window not applied: at {at} tokens the cache holds more than "
            f"{NOT_APPLIED_RATIO}x the prediction for {self.run.policy.describe()} "
            f"(worst: {format_size(worst.kv_bytes)} vs {format_size(worst.predicted_bytes)} "
            f"at {worst.tokens} tokens)"
        ]


class _PlannedRoom:
    """The room a cache of ``capacity`` entries has after ``fed`` tokens (one evicted per token
    past it), for planning kvguard's own calls without an engine."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity, self.fed = capacity, 0

    def room(self) -> int | None:
        return None if self.capacity is None else self.capacity - min(self.fed, self.capacity)


def planned_calls(
    policy: Policy, capacity: int | None, n_tokens: int, stops: Sequence[int]
) -> dict[int, int]:
    """The size of the call that ends at each of ``stops``, when ``n_tokens`` are fed to a cache
    that holds ``capacity`` entries (None: never full), on kvguard's own schedule."""
    planned, ends = _PlannedRoom(capacity), {}
    for size in chunks(planned, policy, n_tokens, stops):  # type: ignore[arg-type]
        planned.fed += size
        ends[planned.fed] = size
    return ends


def kv_bytes_predictor(
    engine: str, arch: ModelArch, policy: Policy, n_tokens: int, stops: Sequence[int],
    element_bytes: float,
) -> Callable[[int], float]:  # fmt: skip
    """The engine's KV-size prediction at each of ``stops`` for a run of ``n_tokens`` under
    ``policy``, from the calls the policy makes when its cap (or the model's window) holds, not
    from those the engine's reported room led to: an engine that ignores the cap must not move
    its own prediction."""
    ends = planned_calls(policy, rotating_capacity(engine, policy, arch), n_tokens, stops)

    def predict(tokens: int) -> float:
        return predict_engine_kv_bytes(
            engine, arch, tokens, policy, element_bytes=element_bytes, last_call=ends[tokens]
        )

    return predict


def check_lengths(lengths: object) -> list[int]:
    """Distinct positive lengths in ascending order, or a clear error."""
    return ascending_counts(lengths, "lengths", 1, 1, "[512, 1024, 2048]")


def memory_result(
    run: StreamRun, lengths: Sequence[int], predict: Callable[[int], float]
) -> MemoryResult:
    """Rows for ``lengths`` from a run that sampled them; ``predict(n)`` gives predicted bytes."""
    rows = []
    for n in lengths:
        sample = run.sample(n)
        if "kv_bytes" not in sample.figures:
            raise KvguardError("this engine reports no kv_bytes figure; memory cannot be judged")
        rows.append(
            MemoryRow(
                tokens=n,
                held=sample.held,
                kv_bytes=sample.figures["kv_bytes"],
                predicted_bytes=predict(n),
                peak_memory_bytes=sample.figures.get("peak_memory_bytes", 0.0),
            )
        )
    return MemoryResult(run, rows)


@dataclass(frozen=True)
class MemorySpec:
    policy: Policy
    lengths: tuple[int, ...]
    text: str

    @property
    def tokens(self) -> int:
        return self.lengths[-1]


@dataclass(frozen=True)
class MemoryDetail:
    samples: list[dict[str, float]] = field(default_factory=list)
    """One row per length: tokens, held, kv_bytes, predicted_bytes, deviation_pct, ..."""
    layer_sizes: list[list[int]] = field(default_factory=list)


LENGTHS = Param(
    "lengths",
    "ints",
    list(DEFAULT_LENGTHS),
    "context lengths (tokens fed), ascending, at which KV bytes are measured and predicted",
    minimum=1,
)


class MemoryScenario(Scenario[MemorySpec]):
    name = "memory"
    summary = "KV bytes at several context lengths, measured against the predicted figure"
    # No KV precision here: bytes a quantized cache saves are only reported beside the quality
    # they cost against the full-precision cache, which the stream scenario measures.
    params = (LENGTHS, CAP, SINKS, POSITIONS, EVICT_STEP, CHUNK, TEXT)
    limits = (
        MAX_KV_ENTRIES,
        MAX_KV_BYTES,
        MAX_PEAK_MEMORY_BYTES,
        BOUNDED,
        MAX_KV_BYTES_PER_TOKEN,
        MAX_KV_DEVIATION_PCT,
    )
    engine_path = "feed_unscored"
    detail_type = MemoryDetail

    def panels(self, outcome: Any) -> list[Panel]:
        return kv_bytes_panels(outcome)

    def build(self, fields: Fields) -> MemorySpec:
        assert fields.policy is not None
        policy = fields.policy_of("policy", fields.policy)
        lengths = tuple(check_lengths(fields.params["lengths"]))
        require_text_room(fields, lengths[-1], "params.lengths")
        return MemorySpec(policy, lengths, fields.text_name())

    def check_budgets(self, spec: MemorySpec, budgets: Budgets) -> None:
        check_bounded_run(spec.policy, spec.tokens, budgets)

    def planned_runs(self, check: Check[MemorySpec]) -> list[Planned]:
        """The one unscored run; its peak memory is a figure of the check, so it decodes with
        others only where the engine's group rows report their own peak."""
        spec = check.spec
        feed = TextFeed(load_text(spec.text, check.base_dir), spec.tokens)
        return [RunRequest(check.engine, check.model, spec.policy, feed, spec.lengths, None,
                           own_figures=True)]  # fmt: skip

    def run(self, ctx: Context, check: Check[MemorySpec]) -> Measured:
        """One run sampled at each length; measured KV bytes against the engine's prediction."""
        spec, engine = check.spec, check.engine
        text = load_text(spec.text, check.base_dir)
        loaded = ctx.engine(engine, check.model)
        run, new = ctx.stream_run(engine, check.model, spec.policy, text, spec.tokens,
                                  lengths=spec.lengths, score=False)  # fmt: skip
        predict = kv_bytes_predictor(
            engine, load_arch(check.model.resolve()), spec.policy, spec.tokens, spec.lengths,
            loaded.kv_element_bytes,
        )  # fmt: skip
        result = memory_result(run, spec.lengths, predict)
        for row in result.rows:
            ctx.say(
                f"{engine} {check.model.name} {spec.policy.describe()}: {row.tokens} tokens, "
                f"KV {row.kv_bytes / 2**20:.2f} MiB measured, "
                f"{row.predicted_bytes / 2**20:.2f} MiB predicted ({row.deviation_pct:+.2f}%)",
                detail=True,
            )
        return Measured(
            policy=spec.policy.describe(),
            tokens=spec.tokens,
            text=text,
            metrics=result.metrics,
            seconds={"run": run.seconds if new else 0.0},
            tokens_per_second=run.tokens_per_second,
            detail=MemoryDetail(
                samples=[row.to_json() for row in result.rows],
                layer_sizes=[list(sizes) for sizes in run.layer_sizes],
            ),
            findings=result.findings(),
        )

    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        """One line per measured length."""
        headers = ["tokens", "held", "predicted", "measured", "deviation", "peak"]
        lines = []
        for o in outcomes:
            rows = []
            for s in o.detail.samples:
                deviation = f"{s['deviation_pct']:+.2f}%"
                if s["not_applied"]:
                    deviation += " NOT APPLIED"
                rows.append([
                    str(s["tokens"]), str(s["held"]), format_size(s["predicted_bytes"]),
                    format_size(s["kv_bytes"]), deviation, format_size(s["peak_memory_bytes"]),
                ])  # fmt: skip
            lines.append(rows)
        return headers, lines


SCENARIO = MemoryScenario()
