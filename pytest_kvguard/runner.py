"""Runs checks on real engines, once per session: engines load once, runs are memoised.

A baseline (``full``) run shared by several checks on the same model and tokens is run once.
The runner is the ``Context`` scenarios run with; ``run_check`` runs one check's scenario and
judges its budgets into an ``Outcome``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pytest_kvguard.engines import Engine, EngineOptions, check_policy, load_engine
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.models import ModelRef, file_sha256, read_arch
from pytest_kvguard.outcome import Outcome
from pytest_kvguard.policies import Policy
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import Check
from pytest_kvguard.scenarios.feeding import StreamRun, run_stream
from pytest_kvguard.texts import Text

T = TypeVar("T")


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

    def say(self, line: str, detail: bool = False) -> None:
        self._say(line, detail)

    def engine(self, name: str, model: ModelRef) -> Engine:
        path = model.resolve()
        key = (name, path)
        if key not in self._engines:
            self.say(f"loading {model.name} into {name}")
            self._engines[key] = load_engine(name, path, self.options)
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
        check_policy(engine, policy, "stream" if score else "memory")  # direct callers too
        key = ("stream", engine, model.resolve(), text.sha256, count, policy, lengths, score)
        label = f"{engine} {model.name} {policy.describe()}"

        def compute() -> StreamRun:
            ids = self.token_ids(engine, model, text, count)

            def progress(done: int, total: int) -> None:
                if done < total:
                    self.say(f"{label}: {done}/{total} tokens", detail=True)

            run = run_stream(self.engine(engine, model), policy, ids, progress, lengths, score)
            self.say(f"{label}: done in {run.seconds:.1f} s ({run.tokens_per_second:.0f} tokens/s)")
            return run

        return self.memo(key, compute)

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
    measured = SCENARIOS[check.scenario].run(runner, check)
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
        violations=[
            *measured.findings,
            *(v.message for v in check.budgets.check(measured.metrics)),
        ],
        expect_violation=check.expect_violation,
        reason=check.reason,
        seconds=measured.seconds,
        tokens_per_second=measured.tokens_per_second,
        detail=measured.detail,
    )
