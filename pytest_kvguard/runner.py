"""Runs checks on real engines, once per session: engines load once, runs are memoised.

A baseline (``full``) run shared by several checks on the same model and tokens is run once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pytest_kvguard.budgets import Budgets
from pytest_kvguard.budgets_file import Check, RecallSpec, ReplaySpec
from pytest_kvguard.capacity import load_arch, predict_engine_kv_bytes
from pytest_kvguard.engines import Engine, EngineOptions, check_policy, load_engine
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.models import ModelRef, file_sha256, read_arch
from pytest_kvguard.policies import Policy, make_policy
from pytest_kvguard.scenarios.edit_replay import (
    ReplayRun,
    followup,
    history,
    load_conversation,
    run_edit_replay,
)
from pytest_kvguard.scenarios.memory import MemoryResult, memory_result
from pytest_kvguard.scenarios.parity import ParityResult, compare_parity
from pytest_kvguard.scenarios.recall import RecallResult, RecallRun, build_prompt, run_recall
from pytest_kvguard.scenarios.stream import StreamResult, StreamRun, compare, run_stream
from pytest_kvguard.scenarios.sweep import SweepResult, sweep_policy, sweep_rows
from pytest_kvguard.texts import Text, load_text


class Say(Protocol):
    """Where progress lines go (the terminal, bypassing capture); detail lines need -v."""

    def __call__(self, line: str, detail: bool = False) -> None: ...


@dataclass(frozen=True)
class CheckOutcome:
    """Everything the table and the JSON report say about one check."""

    name: str
    scenario: str
    engine: str
    """Engine name; ``a vs b`` for parity."""
    engine_version: str
    model: str
    model_path: str
    model_sha256: str
    kv_bytes_per_token: float | None
    """From GGUF metadata at f16; None for a model that is not a GGUF file."""
    policy: str
    baseline: str
    tokens: int
    text: str
    text_sha256: str
    base_ppl: float | None
    """What the table shows as the baseline's perplexity (post-eviction for stream)."""
    ppl: float | None
    delta_pct: float | None
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
    layer_sizes: list[tuple[int, int]] = field(default_factory=list)
    """(tokens seen, entries held) per layer for the candidate, where the engine exposes it."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """KV figures over the run: tokens, held, kv_bytes (memory: predicted_bytes, deviation)."""
    baseline_status: str | None = None
    """With --kvguard-baseline: within tolerance, regressed, not in baseline, not compared."""
    baseline_changes: list[str] = field(default_factory=list)
    """With --kvguard-baseline: what changed since it (engine version or build, model, text)."""

    @property
    def verdict(self) -> str:
        """PASS, FAIL (a budget broken), CAUGHT (an expected violation happened) or MISSED
        (an expected violation did not: the gate would not catch that regression)."""
        if self.expect_violation:
            return "CAUGHT" if self.violations else "MISSED"
        return "FAIL" if self.violations else "PASS"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict
        return data


@dataclass(frozen=True)
class Judging:
    """What every check has whatever its scenario: a name, budgets, and an expectation."""

    name: str
    budgets: Budgets
    expect_violation: bool = False
    """A negative control (or an expected finding): it must break a budget."""
    reason: str | None = None
    base_dir: Path = field(default_factory=Path.cwd)
    """Where relative text and chat paths start (the budgets file's or the test's folder)."""


class Runner:
    """Session-wide cache of loaded engines, token ids and stream runs."""

    def __init__(self, options: EngineOptions, say: Say | None = None) -> None:
        self.options = options
        self.say: Say = say or (lambda line, detail=False: None)
        self._engines: dict[tuple[str, Path], Engine] = {}
        self._tokens: dict[tuple[Path, str], list[int]] = {}
        self._recalls: dict[tuple[Any, ...], RecallRun] = {}
        self._runs: dict[tuple[str, Path, str, int, Policy, tuple[int, ...], bool], StreamRun] = {}

    def engine(self, name: str, model: ModelRef) -> tuple[Engine, Path]:
        path = model.resolve()
        key = (name, path)
        if key not in self._engines:
            self.say(f"loading {model.name} into {name}")
            self._engines[key] = load_engine(name, path, self.options)
        return self._engines[key], path

    def token_ids(self, engine_name: str, model: ModelRef, text: Text, count: int) -> list[int]:
        """The first ``count`` token ids of ``text``: the same ids for every engine and policy.

        Ids are cached per model file, so a second engine reuses the first one's ids (for GGUF
        models both use llama.cpp's tokenizer anyway).
        """
        engine, path = self.engine(engine_name, model)
        key = (path, text.sha256)
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
        self,
        engine_name: str,
        model: ModelRef,
        policy: Policy,
        text: Text,
        count: int,
        *,
        scenario: str = "stream",
        lengths: tuple[int, ...] = (),
    ) -> tuple[StreamRun, bool]:
        """The run, and whether it was computed now (False: reused from this session)."""
        check_policy(engine_name, policy, scenario)  # every entry point: files, fixture, tests
        engine, path = self.engine(engine_name, model)
        score = scenario != "memory"  # memory runs need the cache, not the logits
        key = (engine_name, path, text.sha256, count, policy, lengths, score)
        if key in self._runs:
            return self._runs[key], False
        ids = self.token_ids(engine_name, model, text, count)
        label = f"{engine_name} {model.name} {policy.describe()}"

        def progress(done: int, total: int) -> None:
            if done < total:
                self.say(f"{label}: {done}/{total} tokens", detail=True)

        run = run_stream(engine, policy, ids, progress, lengths, score)
        self.say(f"{label}: done in {run.seconds:.1f} s ({run.tokens_per_second:.0f} tokens/s)")
        self._runs[key] = run
        return run, True

    def _judge(
        self,
        judging: Judging,
        *,
        model_engine: str,
        model: ModelRef,
        text: Text,
        metrics: dict[str, float],
        findings: list[str] | None = None,
        **fields: Any,
    ) -> CheckOutcome:
        """The outcome: the scenario's own fields plus what every check reports and is judged on.

        ``findings`` are violations the scenario itself detects, whatever the budgets say.
        """
        loaded, path = self.engine(model_engine, model)
        # Parity names two engines; every other scenario reports the engine it ran.
        fields.setdefault("engine", model_engine)
        fields.setdefault("engine_version", loaded.version())
        fields.setdefault("engine_info", loaded.describe())
        is_gguf = path.is_file()
        budgets = judging.budgets
        return CheckOutcome(
            name=judging.name,
            expect_violation=judging.expect_violation,
            reason=judging.reason,
            model=model.name,
            model_path=str(path),
            model_sha256=file_sha256(path) if is_gguf else "",
            kv_bytes_per_token=read_arch(path).kv_bytes_per_token() if is_gguf else None,
            text=text.name,
            text_sha256=text.sha256,
            metrics=metrics,
            budgets=budgets.declared(),
            budget_text=budgets.describe(),
            violations=[*(findings or []), *(v.message for v in budgets.check(metrics))],
            **fields,
        )

    def stream_check(
        self,
        judging: Judging,
        *,
        engine: str,
        model: ModelRef,
        policy: Policy,
        baseline: Policy,
        tokens: int,
        text: str,
    ) -> tuple[CheckOutcome, StreamResult]:
        """Run candidate and baseline on the same token ids and judge the budgets."""
        loaded_text = load_text(text, judging.base_dir)
        base_run, base_new = self.stream_run(engine, model, baseline, loaded_text, tokens)
        cand_run, cand_new = self.stream_run(engine, model, policy, loaded_text, tokens)
        result = compare(cand_run, base_run)
        metrics = result.metrics
        outcome = self._judge(
            judging,
            scenario="stream",
            model_engine=engine,
            model=model,
            text=loaded_text,
            tokens=tokens,
            metrics=metrics,
            policy=policy.describe(),
            baseline=baseline.describe(),
            base_ppl=metrics["baseline_post_eviction_ppl"],
            ppl=metrics["post_eviction_ppl"],
            delta_pct=metrics["ppl_increase_pct"],
            seconds={
                "candidate": cand_run.seconds if cand_new else 0.0,
                "baseline": base_run.seconds if base_new else 0.0,
            },
            tokens_per_second=cand_run.tokens_per_second,
            layer_sizes=cand_run.layer_sizes,
            samples=[{"tokens": s.tokens, "held": s.held, **s.figures} for s in cand_run.samples],
        )
        return outcome, result

    def sweep_check(
        self,
        judging: Judging,
        *,
        engine: str,
        model: ModelRef,
        sinks: tuple[int, ...],
        positions: tuple[str, ...],
        cap: int,
        evict_step: int,
        baseline: Policy,
        tokens: int,
        text: str,
    ) -> tuple[CheckOutcome, SweepResult]:
        """Every sink count under every position handling, same cap, same token ids."""
        loaded_text = load_text(text, judging.base_dir)
        base_run, base_new = self.stream_run(engine, model, baseline, loaded_text, tokens)
        results, seconds = [], {"baseline": base_run.seconds if base_new else 0.0}
        for mode in positions:
            for count in sinks:
                policy = sweep_policy(count, cap, mode, evict_step)
                run, new = self.stream_run(engine, model, policy, loaded_text, tokens)
                results.append((mode, count, compare(run, base_run)))
                seconds[policy.describe()] = run.seconds if new else 0.0
        result = sweep_rows(results)
        metrics = result.metrics
        outcome = self._judge(
            judging,
            scenario="sweep",
            model_engine=engine,
            model=model,
            text=loaded_text,
            tokens=tokens,
            metrics=metrics,
            policy=f"sinks {list(sinks)}/{cap} {'+'.join(positions)}",
            baseline=baseline.describe(),
            base_ppl=metrics["baseline_post_eviction_ppl"],
            ppl=metrics["post_eviction_ppl"],
            delta_pct=metrics["ppl_increase_pct"],
            seconds=seconds,
            tokens_per_second=base_run.tokens_per_second,
            samples=[row.to_json() for row in result.rows],
        )
        return outcome, result

    def recall_check(
        self,
        judging: Judging,
        *,
        engine: str,
        model: ModelRef,
        policy: Policy,
        recall: RecallSpec,
        text: str,
    ) -> tuple[CheckOutcome, RecallResult]:
        """The fact, the filler and the question under the policy and under the full cache."""
        check_policy(engine, policy, "stream")
        loaded_text = load_text(text, judging.base_dir)
        loaded, path = self.engine(engine, model)
        filler = self.token_ids(engine, model, loaded_text, recall.filler_tokens + 1)
        prompt = build_prompt(loaded, recall.fact, filler, recall.question, recall.answer)
        runs, fresh = [], []
        for candidate in (policy, make_policy("full")):
            # The full-cache run is shared by every recall check of the same prompt.
            key = (engine, path, candidate, tuple(prompt.prompt), tuple(prompt.answer))
            fresh.append(key not in self._recalls)
            if fresh[-1]:
                run = run_recall(loaded, candidate, prompt)
                self.say(
                    f"{engine} {model.name} {candidate.describe()}: recall {run.answer_hits}/"
                    f"{run.answer_tokens} answer tokens after {run.prompt_tokens} prompt tokens "
                    f"in {run.seconds:.1f} s"
                )
                self._recalls[key] = run
            runs.append(self._recalls[key])
        result = RecallResult(*runs)
        metrics = result.metrics
        outcome = self._judge(
            judging,
            scenario="recall",
            model_engine=engine,
            model=model,
            text=loaded_text,
            tokens=len(prompt.prompt),
            metrics=metrics,
            policy=policy.describe(),
            baseline="full",
            base_ppl=math.exp(metrics["baseline_answer_nll"]),
            ppl=math.exp(metrics["answer_nll"]),
            delta_pct=None,
            seconds={
                "candidate": runs[0].seconds if fresh[0] else 0.0,
                "baseline": runs[1].seconds if fresh[1] else 0.0,
            },
            tokens_per_second=runs[0].prompt_tokens / runs[0].seconds if runs[0].seconds else 0.0,
        )
        return outcome, result

    def memory_check(
        self,
        judging: Judging,
        *,
        engine: str,
        model: ModelRef,
        policy: Policy,
        lengths: tuple[int, ...],
        text: str,
    ) -> tuple[CheckOutcome, MemoryResult]:
        """One run sampled at each length; measured KV bytes against the engine's prediction."""
        loaded_text = load_text(text, judging.base_dir)
        loaded, path = self.engine(engine, model)
        run, new = self.stream_run(
            engine, model, policy, loaded_text, lengths[-1], scenario="memory", lengths=lengths
        )
        arch = load_arch(path)

        def predict(n_tokens: int) -> float:
            return predict_engine_kv_bytes(
                engine, arch, n_tokens, policy, element_bytes=loaded.kv_element_bytes
            )

        result = memory_result(run, lengths, predict)
        for row in result.rows:
            self.say(
                f"{engine} {model.name} {policy.describe()}: {row.tokens} tokens, "
                f"KV {row.kv_bytes / 2**20:.2f} MiB measured, "
                f"{row.predicted_bytes / 2**20:.2f} MiB predicted ({row.deviation_pct:+.2f}%)",
                detail=True,
            )
        outcome = self._judge(
            judging,
            scenario="memory",
            model_engine=engine,
            model=model,
            text=loaded_text,
            tokens=lengths[-1],
            metrics=result.metrics,
            findings=result.findings(),
            policy=policy.describe(),
            baseline="prediction",
            base_ppl=None,
            ppl=None,
            delta_pct=None,
            seconds={"run": run.seconds if new else 0.0},
            tokens_per_second=run.tokens_per_second,
            layer_sizes=run.layer_sizes,
            samples=[row.to_json() for row in result.rows],
        )
        return outcome, result

    def parity_check(
        self,
        judging: Judging,
        *,
        engines: tuple[str, str],
        model: ModelRef,
        tokens: int,
        text: str,
    ) -> tuple[CheckOutcome, ParityResult]:
        """Full-cache runs on two engines over the same token ids; per-token NLL must agree."""
        loaded_text = load_text(text, judging.base_dir)
        full = make_policy("full")
        ref_name, other_name = engines
        ref_run, ref_new = self.stream_run(ref_name, model, full, loaded_text, tokens)
        other_run, other_new = self.stream_run(other_name, model, full, loaded_text, tokens)
        result = compare_parity(ref_run, other_run)
        metrics = result.metrics
        ref, _ = self.engine(ref_name, model)
        other, _ = self.engine(other_name, model)
        outcome = self._judge(
            judging,
            scenario="parity",
            model_engine=ref_name,
            model=model,
            text=loaded_text,
            tokens=tokens,
            metrics=metrics,
            engine=f"{ref_name} vs {other_name}",
            engine_version=f"{ref.version()} / {other.version()}",
            policy=f"full ({other_name})",
            baseline=f"full ({ref_name})",
            base_ppl=metrics["reference_ppl"],
            ppl=metrics["other_ppl"],
            delta_pct=metrics["ppl_ratio_pct"],
            seconds={
                ref_name: ref_run.seconds if ref_new else 0.0,
                other_name: other_run.seconds if other_new else 0.0,
            },
            tokens_per_second=other_run.tokens_per_second,
            engine_info={
                **{f"{ref_name}.{k}": v for k, v in ref.describe().items()},
                **{f"{other_name}.{k}": v for k, v in other.describe().items()},
            },
        )
        return outcome, result

    def replay_check(
        self,
        judging: Judging,
        *,
        engine: str,
        model: ModelRef,
        policy: Policy,
        replay: ReplaySpec,
    ) -> tuple[CheckOutcome, ReplayRun]:
        """Cache the chat under the policy, send the follow-up, count reused and re-prefilled."""
        check_policy(engine, policy, "edit_replay")
        loaded, _ = self.engine(engine, model)
        conversation = load_conversation(replay.chat, judging.base_dir)
        first_text = loaded.render_chat(history(conversation))
        second_text = loaded.render_chat(followup(conversation, replay.followup, replay.message))
        first_ids, second_ids = loaded.tokenize(first_text), loaded.tokenize(second_text)
        label = f"{engine} {model.name} {policy.describe()} {replay.followup}"
        self.say(f"{label}: prefilling {len(first_ids)} tokens, then the follow-up")
        run = run_edit_replay(loaded, policy, first_ids, second_ids)
        metrics = run.metrics
        self.say(
            f"{label}: reused {run.replay.reused}, re-prefilled {run.replay.reprefilled} "
            f"in {run.replay.seconds:.1f} s"
        )
        what = replay.followup + (f" #{replay.message}" if replay.message is not None else "")
        outcome = self._judge(
            judging,
            scenario="edit_replay",
            model_engine=engine,
            model=model,
            text=Text(replay.chat, first_text),
            tokens=run.replay.prompt_tokens,
            metrics=metrics,
            policy=policy.describe(),
            baseline=what,
            base_ppl=None,
            ppl=None,
            delta_pct=None,
            seconds={"prefill": run.prefill_seconds, "replay": run.replay.seconds},
            tokens_per_second=run.replay.reprefilled / run.replay.seconds
            if run.replay.seconds
            else 0.0,
        )
        return outcome, run

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
        self._runs.clear()
        self._recalls.clear()


def run_check(runner: Runner, check: Check) -> CheckOutcome:
    """Run one declared check from a budgets file."""
    judging = Judging(
        check.name, check.budgets, check.expect_violation, check.reason, check.path.parent
    )
    if check.scenario == "parity":
        assert check.other_engine is not None
        outcome, _ = runner.parity_check(
            judging,
            engines=(check.engine, check.other_engine),
            model=check.model,
            tokens=check.tokens,
            text=check.text,
        )
    elif check.scenario == "sweep":
        assert check.sweep is not None and check.policy.cap is not None
        outcome, _ = runner.sweep_check(
            judging,
            engine=check.engine,
            model=check.model,
            sinks=check.sweep.sinks,
            positions=check.sweep.positions,
            cap=check.policy.cap,
            evict_step=check.policy.evict_step,
            baseline=check.baseline,
            tokens=check.tokens,
            text=check.text,
        )
    elif check.scenario == "recall":
        assert check.recall is not None
        outcome, _ = runner.recall_check(
            judging,
            engine=check.engine,
            model=check.model,
            policy=check.policy,
            recall=check.recall,
            text=check.text,
        )
    elif check.scenario == "memory":
        outcome, _ = runner.memory_check(
            judging,
            engine=check.engine,
            model=check.model,
            policy=check.policy,
            lengths=check.lengths,
            text=check.text,
        )
    elif check.scenario == "edit_replay":
        assert check.replay is not None
        outcome, _ = runner.replay_check(
            judging,
            engine=check.engine,
            model=check.model,
            policy=check.policy,
            replay=check.replay,
        )
    else:
        outcome, _ = runner.stream_check(
            judging,
            engine=check.engine,
            model=check.model,
            policy=check.policy,
            baseline=check.baseline,
            tokens=check.tokens,
            text=check.text,
        )
    return outcome
