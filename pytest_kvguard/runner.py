"""Runs checks on real engines, once per session: engines load once, runs are memoised.

A baseline (``full``) run shared by several checks on the same model and tokens is run once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pytest_kvguard.budgets import Budgets
from pytest_kvguard.engines import Engine, EngineOptions, load_engine
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.models import ModelRef, file_sha256, read_arch
from pytest_kvguard.policies import Policy
from pytest_kvguard.scenarios.stream import StreamResult, StreamRun, compare, run_stream
from pytest_kvguard.texts import Text, load_text


class Say(Protocol):
    """Where progress lines go (the terminal, bypassing capture); detail lines need -v."""

    def __call__(self, line: str, detail: bool = False) -> None: ...


VERDICTS = {
    "PASS": "within every budget",
    "FAIL": "broke a budget",
    "CAUGHT": "negative control broke a budget, as it must",
    "MISSED": "negative control stayed within budget: the gate would not catch this regression",
    "ERROR": "the check could not run",
}


@dataclass(frozen=True)
class CheckOutcome:
    """Everything the table and the JSON report say about one check."""

    name: str
    scenario: str
    engine: str
    engine_version: str
    model: str
    model_path: str
    model_sha256: str
    kv_bytes_per_token: float
    policy: str
    baseline: str
    tokens: int
    text: str
    text_sha256: str
    metrics: dict[str, float]
    budgets: dict[str, float]
    budget_text: str
    violations: list[str]
    expect_violation: bool
    reason: str | None
    seconds: dict[str, float]
    """Wall time per run (reported, never gated); 0.0 for a run reused from earlier."""
    tokens_per_second: float
    engine_info: dict[str, str] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        if self.expect_violation:
            return "CAUGHT" if self.violations else "MISSED"
        return "FAIL" if self.violations else "PASS"

    @property
    def ok(self) -> bool:
        return self.verdict in ("PASS", "CAUGHT")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict
        return data


class Runner:
    """Session-wide cache of loaded engines, token ids and stream runs."""

    def __init__(self, options: EngineOptions, say: Say | None = None) -> None:
        self.options = options
        self.say: Say = say or (lambda line, detail=False: None)
        self._engines: dict[tuple[str, Path], Engine] = {}
        self._tokens: dict[tuple[str, Path, str], list[int]] = {}
        self._runs: dict[tuple[str, Path, str, int, Policy], StreamRun] = {}

    def engine(self, name: str, model: ModelRef) -> tuple[Engine, Path]:
        path = model.resolve()
        key = (name, path)
        if key not in self._engines:
            self.say(f"loading {model.name} into {name}")
            self._engines[key] = load_engine(name, path, self.options)
        return self._engines[key], path

    def token_ids(self, engine_name: str, model: ModelRef, text: Text, count: int) -> list[int]:
        """The first ``count`` token ids of ``text``; identical for every policy on this model."""
        engine, path = self.engine(engine_name, model)
        key = (engine_name, path, text.sha256)
        cached = self._tokens.get(key, [])
        chars = count * 8
        while len(cached) < count + 16 and chars < 2 * len(text.content):
            # Tokenize a prefix, not the whole text: the cut is far past the tokens kept.
            cached = engine.tokenize(text.content[:chars])
            chars *= 2
        self._tokens[key] = cached
        if len(cached) < count:
            raise KvguardError(
                f"text '{text.name}' has only {len(cached)} tokens on {model.name}, {count} asked",
                fix="lower tokens or use a longer text",
            )
        return cached[:count]

    def stream_run(
        self, engine_name: str, model: ModelRef, policy: Policy, text: Text, count: int
    ) -> tuple[StreamRun, bool]:
        """The run, and whether it was computed now (False: reused from this session)."""
        engine, path = self.engine(engine_name, model)
        key = (engine_name, path, text.sha256, count, policy)
        if key in self._runs:
            return self._runs[key], False
        ids = self.token_ids(engine_name, model, text, count)
        label = f"{engine_name} {model.name} {policy.describe()}"

        def progress(done: int, total: int) -> None:
            if done < total:
                self.say(f"{label}: {done}/{total} tokens", detail=True)

        run = run_stream(engine, policy, ids, progress)
        self.say(f"{label}: done in {run.seconds:.1f} s ({run.tokens_per_second:.0f} tokens/s)")
        self._runs[key] = run
        return run, True

    def stream_check(
        self,
        *,
        name: str,
        engine: str,
        model: ModelRef,
        policy: Policy,
        baseline: Policy,
        tokens: int,
        text: str,
        budgets: Budgets,
        expect_violation: bool = False,
        reason: str | None = None,
        text_base: Path | None = None,
    ) -> tuple[CheckOutcome, StreamResult]:
        """Run candidate and baseline on the same token ids and judge the budgets."""
        loaded_text = load_text(text, text_base or Path.cwd())
        base_run, base_new = self.stream_run(engine, model, baseline, loaded_text, tokens)
        cand_run, cand_new = self.stream_run(engine, model, policy, loaded_text, tokens)
        result = compare(cand_run, base_run)
        metrics = result.metrics
        violations = budgets.check(metrics)
        loaded, path = self.engine(engine, model)
        outcome = CheckOutcome(
            name=name,
            scenario="stream",
            engine=engine,
            engine_version=loaded.version(),
            model=model.name,
            model_path=str(path),
            model_sha256=file_sha256(path),
            kv_bytes_per_token=read_arch(path).kv_bytes_per_token(),
            policy=policy.describe(),
            baseline=baseline.describe(),
            tokens=tokens,
            text=loaded_text.name,
            text_sha256=loaded_text.sha256,
            metrics=metrics,
            budgets=budgets.declared(),
            budget_text=budgets.describe(),
            violations=[v.message for v in violations],
            expect_violation=expect_violation,
            reason=reason,
            seconds={
                "candidate": cand_run.seconds if cand_new else 0.0,
                "baseline": base_run.seconds if base_new else 0.0,
            },
            tokens_per_second=cand_run.tokens_per_second,
            engine_info=loaded.describe(),
        )
        return outcome, result

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
        self._runs.clear()
