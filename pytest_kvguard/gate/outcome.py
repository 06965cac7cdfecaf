"""What a check produced: a typed outcome (or the error that stopped it), and its JSON row.

Rows travel on pytest reports as JSON (to the xdist controller, to JUnit); ``row_from_json``
turns them back into the same types, with the scenario's own detail class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pytest_kvguard.scenarios import SCENARIOS


@dataclass(frozen=True)
class Outcome:
    """Everything the table and the JSON report say about one check that ran."""

    name: str
    scenario: str
    engine: str
    """Engine name; ``a vs b`` where a check names two engines (parity)."""
    engine_version: str
    """The engine's version; ``a / b`` for two engines."""
    engine_info: dict[str, str]
    """Build and backend facts (for two engines, keys are prefixed with the engine's name)."""
    model: str
    model_path: str
    model_sha256: str
    kv_bytes_per_token: float | None
    """From GGUF metadata at f16; None for a model that is not a GGUF file."""
    policy: str
    """The policy as the table shows it."""
    tokens: int
    text: str
    text_sha256: str
    metrics: dict[str, float]
    """Every figure a budget or a baseline tolerance can gate on, by name."""
    budgets: dict[str, float]
    budget_text: str
    violations: list[str]
    expect_violation: bool
    reason: str | None
    seconds: dict[str, float]
    """Wall time per run (reported, never gated); 0.0 for a run reused from earlier."""
    tokens_per_second: float
    detail: Any
    """The scenario's own detail (``StreamDetail``, ``MemoryDetail``, ...)."""
    baseline_status: str | None = None
    """With --kvguard-baseline: within tolerance, regressed, not in baseline, not compared."""
    baseline_changes: list[str] = field(default_factory=list)
    """With --kvguard-baseline: what changed since it (engine version or build, model, text)."""
    against: dict[str, Any] | None = None
    """With --kvguard-against: the other run (python, engine_version, verdict, metrics,
    violations), or its error; None without an upgrade preview."""
    explanation: dict[str, Any] | None = None
    """A check that broke a budget: why, as its scenario's ``explain`` read it from the engine
    (for a window or sink policy: the sink heads it starves); else None."""

    @property
    def verdict(self) -> str:
        """PASS, FAIL (a budget broken), CAUGHT (an expected violation happened) or MISSED
        (an expected violation did not: the gate would not catch that regression)."""
        if self.expect_violation:
            return "CAUGHT" if self.violations else "MISSED"
        return "FAIL" if self.violations else "PASS"

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["detail"] = asdict(self.detail)
        data["verdict"] = self.verdict
        return data


@dataclass(frozen=True)
class CheckError:
    """A check that could not produce figures: a row all the same, so nothing looks like a pass."""

    name: str
    error: str
    scenario: str | None = None
    lost: bool = False
    """The engine worker died or was killed while running it (crash, hang): the check was lost,
    not refused."""

    verdict = "ERROR"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "scenario": self.scenario, "verdict": "ERROR",
                "error": self.error, "lost": self.lost}  # fmt: skip


Row = Outcome | CheckError


def row_from_json(data: Mapping[str, Any]) -> Row:
    """A report row back as the type it was written from."""
    if data["verdict"] == "ERROR":
        return CheckError(
            data["name"], data["error"], data.get("scenario"), bool(data.get("lost", False))
        )
    values = {f.name: data[f.name] for f in fields(Outcome) if f.name in data}
    values["detail"] = SCENARIOS[data["scenario"]].detail_from_json(data["detail"])
    return Outcome(**values)
