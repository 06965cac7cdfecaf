"""Runs checks on real engines, once per session: engines load once, runs are memoised.

A baseline (``full``) run shared by several checks on the same model and tokens is run once.
The runner is the ``Context`` scenarios run with; ``run_check`` runs one check's scenario and
judges its budgets into an ``Outcome``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines import (
    Engine,
    EngineOptions,
    GroupsStreams,
    check_policy,
    load_engine,
)
from pytest_kvguard.gate.outcome import Outcome
from pytest_kvguard.inputs.models import ModelRef, file_sha256, read_arch
from pytest_kvguard.inputs.texts import Text
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import Check, LaterRequest, RunRequest, TextFeed
from pytest_kvguard.scenarios.feeding import Progress, RunSpec, StreamRun, run_specs

T = TypeVar("T")

MAX_GROUP_ROWS = 16
"""The most runs decoded together in one group (llama.cpp sequences, mlx-lm batch rows)."""


class Say(Protocol):
    """Where progress lines go (the terminal, bypassing capture); detail lines need -v."""

    def __call__(self, line: str, detail: bool = False) -> None: ...


class Runner:
    """Session-wide cache of loaded engines, token ids and runs."""

    def __init__(self, options: EngineOptions, say: Say | None = None) -> None:
        self.options = options
        self._say: Say = say or (lambda line, detail=False: None)
        self._engines: dict[tuple[str, Path], Engine] = {}
        self._tokens: dict[tuple[Path, str], list[int]] = {}
        self._memo: dict[tuple[Any, ...], Any] = {}
        self._planned: dict[tuple[Any, ...], RunRequest] = {}
        self._later: list[tuple[LaterRequest, bool]] = []
        """Planned requests still to be made, and whether a peak budget judges each."""
        self.on_group: Callable[[], None] | None = None
        """Called before policies of other checks are decoded together with the one asked for."""
        self._own_figures: set[tuple[Any, ...]] = set()
        """Runs judged on figures only a stream of its own measures (a peak-memory budget, the
        memory scenario): decoded alone unless the engine's group rows report them too."""

    def say(self, line: str, detail: bool = False) -> None:
        self._say(line, detail)

    def engine(self, name: str, model: ModelRef) -> Engine:
        path = model.resolve()
        key = (name, path)
        if key not in self._engines:
            self.say(f"loading {model.name} into {name}")
            self._engines[key] = load_engine(name, model.url or path, self.options)
        return self._engines[key]

    def token_ids(self, engine_name: str, model: ModelRef, text: Text, count: int) -> list[int]:
        """The first ``count`` token ids of ``text``: the same ids for every engine and policy.

        Ids are cached per model file, so a second engine reuses the first one's ids (for GGUF
        models both use llama.cpp's tokenizer anyway).
        """
        engine = self.engine(engine_name, model)
        key = (model.resolve(), text.sha256)
        cached = self._tokens.get(key, [])
        chars = count * 8
        while len(cached) < count + 16:
            # Tokenize a prefix, not the whole text: the cut is far past the tokens kept.
            cached = engine.tokenize(text.content[:chars])
            if chars >= len(text.content):
                break  # the whole text is tokenized: there is no more to get
            chars *= 2
        self._tokens[key] = cached
        if len(cached) < count:
            raise KvguardError(
                f"text '{text.name}' has only {len(cached)} tokens on {model.name}, {count} asked",
                fix="lower the token count or use a longer text",
            )
        return cached[:count]

    def plan(self, checks: Sequence[Check[Any]]) -> None:
        """Learn the stream runs the coming checks will ask for: when one of them is computed,
        the planned runs it can decode together with are computed with it."""
        for check in checks:
            try:
                planned = SCENARIOS[check.scenario].planned_runs(check)
            except (KvguardError, OSError):
                continue  # the check reports it when it runs
            judged_on_peak = check.budgets.max_peak_memory_bytes is not None
            for run in planned:
                if isinstance(run, LaterRequest):
                    self._later.append((run, judged_on_peak))
                else:
                    self._add_planned(run, judged_on_peak)

    def _add_planned(self, run: RunRequest, judged_on_peak: bool) -> None:
        key = self._run_key(run)
        self._planned[key] = run
        if run.own_figures or judged_on_peak:
            self._own_figures.add(key)

    def _make_later(self, engine: str, model: ModelRef, group_key: Callable[[Policy], Any]) -> None:
        """Make the planned requests of this engine and model that needed its token ids; those
        whose policy can decode with no other are dropped (they are made when they run)."""
        waiting = []
        for later, judged_on_peak in self._later:
            if (later.engine, later.model.resolve()) != (engine, model.resolve()):
                waiting.append((later, judged_on_peak))
            elif group_key(later.policy) is not None:
                with contextlib.suppress(KvguardError):  # the check reports it when it runs
                    self._add_planned(later.make(self), judged_on_peak)
        self._later = waiting

    @staticmethod
    def _run_key(request: RunRequest) -> tuple[Any, ...]:
        return ("run", request.engine, request.model.resolve(), request.feed.key,
                request.policy, request.lengths, request.score_from)  # fmt: skip

    def ids(self, request: RunRequest) -> list[int]:
        """The token ids a request feeds, got once per session."""
        key = ("ids", request.engine, request.model.resolve(), request.feed.key)
        ids, _ = self.memo(key, lambda: request.feed.ids(self, request.engine, request.model))
        return ids

    def _companions(self, request: RunRequest, key: tuple[Any, ...]) -> list[RunRequest]:
        """Planned, not yet computed runs that can decode together with ``request``."""
        loaded = self.engine(request.engine, request.model)
        if not isinstance(loaded, GroupsStreams) or loaded.group_key(request.policy) is None:
            return []
        group_key = loaded.group_key
        rows_keep_figures = loaded.group_figures_own
        own = request.own_figures or key in self._own_figures
        if own and not rows_keep_figures:
            return []
        self._make_later(request.engine, request.model, group_key)
        found: list[RunRequest] = []
        for other_key, run in self._planned.items():
            if len(found) == MAX_GROUP_ROWS - 1:
                break
            free = other_key != key and other_key not in self._memo and (
                rows_keep_figures or other_key not in self._own_figures)  # fmt: skip
            same_model = (run.engine, run.model.resolve()) == (request.engine,
                                                               request.model.resolve())  # fmt: skip
            if free and same_model and group_key(run.policy) == group_key(request.policy):
                found.append(run)
        return found

    def stream_run(
        self,
        engine: str,
        model: ModelRef,
        policy: Policy,
        text: Text,
        count: int,
        *,
        lengths: tuple[int, ...] = (),
        score: bool = True,
    ) -> tuple[StreamRun, bool]:
        """The run, and whether it was computed now (False: reused from this session)."""
        check_policy(engine, policy, "feed" if score else "feed_unscored")  # direct callers too
        # An unscored run is a memory run: its peak is a figure of its check, planned or not.
        request = RunRequest(engine, model, policy, TextFeed(text, count), tuple(lengths),
                             0 if score else None, own_figures=not score)  # fmt: skip
        return self.run(request)

    def run(self, request: RunRequest) -> tuple[StreamRun, bool]:
        """The run a request names, and whether it was computed now. Planned runs it can
        decode together with are computed with it (``run_specs``) and kept for their checks."""
        key = self._run_key(request)
        engine, model = request.engine, request.model

        def progress_of(label: str) -> Progress:
            def progress(done: int, total: int) -> None:
                if done < total:
                    self.say(f"{label}: {done}/{total} tokens", detail=True)

            return progress

        def spec_of(run: RunRequest) -> RunSpec:
            return RunSpec(run.policy, self.ids(run), run.lengths, run.score_from)

        def compute() -> StreamRun:
            loaded = self.engine(engine, model)
            ready = []
            for other in self._companions(request, key):
                try:
                    ready.append((other, spec_of(other)))
                except KvguardError:
                    continue  # its own check reports it when it runs
            if not ready:
                label = f"{engine} {model.name} {request.policy.describe()}"
                run = run_specs(loaded, [spec_of(request)], progress_of(label))[0]
                self.say(f"{label}: done in {run.seconds:.1f} s "
                         f"({run.tokens_per_second:.0f} tokens/s)")  # fmt: skip
                return run
            if self.on_group is not None:
                self.on_group()
            names = ", ".join(r.policy.describe() for r in [request, *(o for o, _ in ready)])
            label = f"{engine} {model.name}: {len(ready) + 1} runs"
            specs = [spec_of(request), *(spec for _, spec in ready)]
            runs = run_specs(loaded, specs, progress_of(label))
            for (other, _), other_run in zip(ready, runs[1:], strict=True):
                self._memo[self._run_key(other)] = other_run
            self.say(f"{label} ({names}) decoded together in {runs[0].seconds:.1f} s")
            return runs[0]

        return self.memo(key, compute)

    def saved(self, key: tuple[Any, ...]) -> Any:
        return self._memo.get(key)

    def save(self, key: tuple[Any, ...], value: Any) -> None:
        self._memo[key] = value

    def memo(self, key: tuple[Any, ...], compute: Callable[[], T]) -> tuple[T, bool]:
        if key in self._memo:
            return self._memo[key], False
        value = compute()
        self._memo[key] = value
        return value, True

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
        self._memo.clear()


def run_check(runner: Runner, check: Check[Any]) -> Outcome:
    """Run a check's scenario and judge its budgets. Engine, version and build facts come from
    the engines the check names; a finding of the scenario is a violation whatever the budgets."""
    scenario = SCENARIOS[check.scenario]
    measured = scenario.run(runner, check)
    violations = [*measured.findings, *(v.message for v in check.budgets.check(measured.metrics))]
    explanation = None
    if violations:
        try:
            explanation = scenario.explain(runner, check)
        except Exception as exc:  # the red verdict stands whatever the explanation does
            runner.say(f"{check.name}: not explained ({type(exc).__name__}: {exc})")
    loaded = [runner.engine(name, check.model) for name in check.engines]
    path = check.model.resolve()
    is_gguf = path.is_file()
    if len(loaded) == 1:
        info = loaded[0].describe()
    else:
        info = {f"{n}.{k}": v for n, e in zip(check.engines, loaded, strict=True)
                for k, v in e.describe().items()}  # fmt: skip
    return Outcome(
        name=check.name,
        scenario=check.scenario,
        engine=" vs ".join(check.engines),
        engine_version=" / ".join(e.version() for e in loaded),
        engine_info=info,
        model=check.model.name,
        model_path=str(path),
        model_sha256=file_sha256(path) if is_gguf else "",
        kv_bytes_per_token=read_arch(path).kv_bytes_per_token() if is_gguf else None,
        policy=measured.policy,
        tokens=measured.tokens,
        text=measured.text.name,
        text_sha256=measured.text.sha256,
        metrics=measured.metrics,
        budgets=check.budgets.declared(),
        budget_text=check.budgets.describe(),
        violations=violations,
        expect_violation=check.expect_violation,
        reason=check.reason,
        seconds=measured.seconds,
        tokens_per_second=measured.tokens_per_second,
        detail=measured.detail,
        explanation=explanation,
    )
