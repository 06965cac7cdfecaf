"""What a scenario slice is made of, and what it is given to run with.

A slice (one module under ``pytest_kvguard/scenarios/``) owns, for its scenario: the parameter
table (name, type, default, one-line doc), a frozen spec built and validated from it, the run,
a typed detail for the report, its table, and the budgets that apply. The budgets file and the
``kvguard`` fixture both build specs through the same ``Scenario.build``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pytest_kvguard.core.budgets import Budgets, Limit
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import DEFAULT_CHECKPOINT_STEP, POLICY_KINDS, Policy, make_policy
from pytest_kvguard.engines import (
    Engine,
    check_chunk,
    check_policy,
    check_policy_kind,
    engine_info,
)
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import DEFAULT_TEXT, Text, load_text
from pytest_kvguard.scenarios.feeding import StreamRun

SpecT = TypeVar("SpecT")
T = TypeVar("T")

PARAM_KINDS = {"int": "an integer", "str": "a string", "bool": "true or false",
               "ints": "a list of integers", "strs": "a list of names"}  # fmt: skip


@dataclass(frozen=True)
class Param:
    """One scenario parameter: what the YAML ``params:`` key and the fixture keyword take."""

    name: str
    kind: str
    """int, str, ints (a list of integers) or strs (a list of names)."""
    default: Any
    """The value when not given; None: not given (the slice decides what that means)."""
    doc: str
    """One line for README and --help-style listings."""
    minimum: int | None = None
    """Integers (and list items) below this are refused."""

    def read(self, value: Any) -> Any:
        """``value`` checked against the kind and minimum; errors name ``params.NAME``.
        A list parameter given as an empty list is refused: it would ask for nothing."""
        key = f"params.{self.name}"
        is_list = self.kind in ("ints", "strs")
        items = value if is_list else [value]
        wanted = {"int": int, "ints": int, "bool": bool}.get(self.kind, str)
        if is_list and value == []:
            raise KvguardError(f"{key} is an empty list", fix="name one value or more", key=key)
        if (is_list and not isinstance(value, (list, tuple))) or any(
            isinstance(v, bool) != (wanted is bool) or not isinstance(v, wanted) for v in items
        ):
            raise KvguardError(
                f"{key} must be {PARAM_KINDS[self.kind]}, got {value!r}",
                fix=f"write {key} as {PARAM_KINDS[self.kind]}",
                key=key,
            )
        if self.minimum is not None and any(v < self.minimum for v in items):
            raise KvguardError(
                f"{key} must be >= {self.minimum}, got {value!r}",
                fix=f"use {self.name}: {self.minimum} or more",
                key=key,
            )
        return list(value) if is_list else value


# Parameters several scenarios share, documented once.
TOKENS = Param("tokens", "int", 1500, "token ids fed", minimum=2)
CAP = Param("cap", "int", None, "KV entries kept per layer, sinks included", minimum=2)
SINKS = Param("sinks", "int", None, "pinned leading tokens (sink policy; default 4)", minimum=0)
POSITIONS = Param(
    "positions",
    "str",
    None,
    "reindexed (llama.cpp context shift) or absolute (mlx-lm); default: the engine's own "
    "(llama_cpp reindexed, mlx absolute)",
)
EVICT_STEP = Param("evict_step", "int", 1, "tokens dropped per eviction", minimum=1)
CHUNK = Param(
    "chunk",
    "int",
    1,
    "tokens fed per engine call once the cache is full: 1 is the decode path, more the "
    "engine's batched path (at most cap - sinks)",
    minimum=1,
)
KV_BITS = Param(
    "kv_bits", "int", None,
    "mlx-lm: quantize the KV cache to this many bits (2, 3, 4, 5, 6, 8), as generate_step's "
    "kv_bits; default: unquantized",
)  # fmt: skip
KV_GROUP_SIZE = Param(
    "kv_group_size", "int", 64, "mlx-lm: elements per quantization group (32, 64, 128)"
)
QUANTIZED_KV_START = Param(
    "quantized_kv_start", "int", 0,
    "mlx-lm: quantize once the cache holds this many tokens (generate_step's default, 0)",
    minimum=0,
)  # fmt: skip
CACHE_TYPE_K = Param(
    "cache_type_k", "str", "f16",
    "llama.cpp: the K cache's type (f16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, f32, bf16)",
)  # fmt: skip
CACHE_TYPE_V = Param(
    "cache_type_v", "str", "f16",
    "llama.cpp: the V cache's type, as cache_type_k (a quantized V needs flash attention, "
    "which kvguard then turns on)",
)  # fmt: skip
KV_PRECISION = (KV_BITS, KV_GROUP_SIZE, QUANTIZED_KV_START, CACHE_TYPE_K, CACHE_TYPE_V)
"""The candidate policy's KV precision, on each engine's terms; a baseline keeps the engine's
default precision unless it is ``unquantized`` (the candidate's policy at default precision)."""
TEXT = Param(
    "text",
    "str",
    DEFAULT_TEXT,
    f"'{DEFAULT_TEXT}' (CPython's pydoc topics) or a UTF-8 file, relative to the budgets file",
)


@dataclass(frozen=True)
class Fields:
    """A check's settings as written (YAML or fixture keywords), parameters read and typed."""

    engines: tuple[str, ...]
    policy: str | None
    """The policy kind as written; None where not given."""
    baseline: str | None
    params: Mapping[str, Any]
    """Every parameter of the scenario's table: the value given, or the table's default."""
    base_dir: Path
    """Where relative text and chat files are found."""
    scenario: str = ""
    """The check's scenario, for messages."""
    engine_path: str = "feed"
    """How the scenario drives the engine (``Scenario.engine_path``)."""

    @property
    def engine(self) -> str:
        return self.engines[0]

    def positions(self) -> str:
        """The position handling asked for, or the engine's own."""
        value: str | None = self.params.get("positions")
        return engine_info(self.engine).native_positions if value is None else value

    def policy_of(
        self, key: str, kind: str, *, with_params: bool = True, checkpoints: int = 0,
        checkpoint_step: int = DEFAULT_CHECKPOINT_STEP,
    ) -> Policy:  # fmt: skip
        """The policy ``kind`` with this check's cap, sinks, positions and eviction step (with
        ``with_params=False``: none of them), and the SWA checkpoints a scenario that keeps
        them passes, which every engine of the check must implement on the scenario's engine
        path; errors point at ``key``."""
        p = self.params if with_params else {}
        # Only the judged policy takes the KV precision: a baseline keeps full precision.
        precision = {q.name: p[q.name] for q in KV_PRECISION if key == "policy" and q.name in p}
        try:
            if kind in POLICY_KINDS:  # the engine's refusal says more than make_policy's
                for engine in self.engines:
                    check_policy_kind(engine, kind, self.engine_path, self.scenario)
            policy = make_policy(
                kind, cap=p.get("cap"), sinks=p.get("sinks"),
                positions=self.positions() if with_params else "reindexed",
                evict_step=p.get("evict_step", 1), checkpoints=checkpoints,
                checkpoint_step=checkpoint_step, chunk=p.get("chunk", 1), **precision,
            )  # fmt: skip
            for engine in self.engines:
                check_policy(engine, policy, self.engine_path, self.scenario)
        except KvguardError as exc:
            raise exc.keyed(key) from None
        # A baseline of full may share the check's chunk; a candidate that drops it may not.
        check_chunk(p.get("chunk", 1), policy, candidate=key == "policy")
        return policy

    @cached_property
    def loaded_text(self) -> Text:
        """The text parameter, read once at parse time (a missing file fails before any engine
        loads); runs read it again from ``spec.text``."""
        try:
            return load_text(self.params["text"], self.base_dir)
        except KvguardError as exc:
            raise exc.keyed("params.text") from None

    def text_name(self) -> str:
        """The text parameter, once it was read."""
        return self.loaded_text.name


@dataclass(frozen=True)
class Check(Generic[SpecT]):
    """One check, from a budgets file or a test: a scenario's spec, on engines, with budgets."""

    name: str
    scenario: str
    engines: tuple[str, ...]
    """The engine; two for parity (the reference first)."""
    model: ModelRef
    spec: SpecT
    budgets: Budgets
    expect_violation: bool = False
    """A negative control (or an expected finding): it must break a budget."""
    reason: str | None = None
    base_dir: Path = field(default_factory=Path.cwd)
    where: str = ""
    """``budgets.yaml:25``, or the test's node id: where the check was declared."""
    timeout: float | None = None
    """Seconds the check may run before its engine worker is killed; None: the session's."""

    @property
    def engine(self) -> str:
        return self.engines[0]


class Feed(Protocol):
    """The token ids a run feeds; with the engine and model, ``key`` names them in memo keys."""

    @property
    def key(self) -> tuple[Any, ...]: ...

    def ids(self, ctx: Context, engine: str, model: ModelRef) -> list[int]:
        """The ids, as the context gets them (tokenized once per session)."""
        ...


@dataclass(frozen=True)
class TextFeed:
    """The first ``count`` token ids of ``text``: the same for every engine and policy."""

    text: Text
    count: int

    @property
    def key(self) -> tuple[Any, ...]:
        return ("text", self.text.sha256, self.count)

    def ids(self, ctx: Context, engine: str, model: ModelRef) -> list[int]:
        return ctx.token_ids(engine, model, self.text, self.count)


@dataclass(frozen=True)
class RunRequest:
    """A stream run a scenario asks the context for, and tells it of before any check runs
    (``Scenario.planned_runs``), so that runs of several checks can decode together."""

    engine: str
    model: ModelRef
    policy: Policy
    """The cache policy the run feeds through."""
    feed: Feed
    """The token ids it feeds."""
    lengths: tuple[int, ...] = ()
    """Token counts at which the engine's figures are sampled (besides the cap and the end)."""
    score_from: int | None = 0
    """The first index whose next-token score is wanted (see ``feeding.RunSpec``); None: none."""
    own_figures: bool = False
    """The check judges figures only a stream of its own measures on every engine (peak
    memory): it decodes in a group only where a group's rows still report them."""


@dataclass(frozen=True)
class LaterRequest:
    """A planned run whose request depends on token ids only the engine can make (a recall
    prompt's length): ``make`` builds it once the engine is loaded."""

    engine: str
    model: ModelRef
    policy: Policy
    """The request's policy: whether it can decode with others is known before it is made."""
    make: Callable[[Context], RunRequest]
    """Builds the request from the context (its engine loaded)."""


Planned = RunRequest | LaterRequest
"""What ``Scenario.planned_runs`` lists."""


@dataclass(frozen=True)
class Measured:
    """What a scenario's run gives the judge: figures, findings and what the report shows."""

    policy: str
    """The policy as the table shows it: ``sink4/256 reidx step1``."""
    tokens: int
    text: Text
    metrics: dict[str, float]
    """Every figure a budget or a baseline tolerance can gate on, by name."""
    seconds: dict[str, float]
    """Wall time per run (reported, never gated); 0.0 for a run reused from earlier."""
    tokens_per_second: float
    detail: Any
    """The scenario's own dataclass of what its table and plots need."""
    findings: list[str] = field(default_factory=list)
    """Violations the scenario detects itself, whatever the budgets say."""


class Context(Protocol):
    """What a scenario runs with: the session's engines and its memoised runs."""

    def engine(self, name: str, model: ModelRef) -> Engine: ...

    def token_ids(self, engine: str, model: ModelRef, text: Text, count: int) -> list[int]: ...

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
        ...

    def run(self, request: RunRequest) -> tuple[StreamRun, bool]:
        """The run a request names, and whether it was computed now; ``stream_run`` is this
        with a ``TextFeed``."""
        ...

    def memo(self, key: tuple[Any, ...], compute: Callable[[], T]) -> tuple[T, bool]:
        """``compute()``'s result, computed once per session for ``key``; and whether now."""
        ...

    def saved(self, key: tuple[Any, ...]) -> Any:
        """What ``save`` kept under ``key`` this session; None if nothing was."""
        ...

    def save(self, key: tuple[Any, ...], value: Any) -> None:
        """Keep ``value`` for later checks of this session (an engine snapshot, say)."""
        ...

    def say(self, line: str, detail: bool = False) -> None: ...


class Scenario(ABC, Generic[SpecT]):
    """A scenario slice. Subclasses set the class attributes and implement the four methods."""

    name: ClassVar[str]
    summary: ClassVar[str]
    """One line: what the scenario does."""
    params: ClassVar[tuple[Param, ...]]
    limits: ClassVar[tuple[Limit, ...]]
    """The budgets that apply to this scenario, declared here or shared (``limits.py``)."""
    detail_type: ClassVar[type]
    engines: ClassVar[int] = 1
    """How many engines a check names (parity: two, under ``engines:``)."""
    takes_policy: ClassVar[bool] = True
    """Whether a check names its policy (required); otherwise a ``policy`` key is refused."""
    no_policy: ClassVar[tuple[str, str]] = ("", "")
    """Where no policy is taken: why a ``policy`` key is refused, and the fix."""
    takes_baseline: ClassVar[bool] = False
    """Whether the check names a baseline policy (default ``full``)."""
    engine_path: ClassVar[str] = "feed"
    """How the scenario drives the engine (``engines.registry.ENGINE_PATHS``): which of the
    engine's policy kinds a check may name."""
    serves_running_server: ClassVar[bool] = False
    """Whether a check may name a running server's URL as its model: the HTTP API gives what
    the scenario needs (no logits, no cache access, no restart with another context)."""

    @abstractmethod
    def build(self, fields: Fields) -> SpecT:
        """The frozen spec; every inconsistency is a KvguardError whose ``key`` points at it."""

    def check_budgets(self, spec: SpecT, budgets: Budgets) -> None:
        """Refuse budgets that cannot mean anything for this spec (none by default)."""

    @abstractmethod
    def run(self, ctx: Context, check: Check[SpecT]) -> Measured:
        """Run the check on the engines; the caller judges the budgets."""

    def planned_runs(self, check: Check[SpecT]) -> list[Planned]:
        """The stream runs ``run`` will ask for, told to the context before any check runs, so
        that runs of several checks can decode together. None by default; a run left out is
        still made, alone."""
        return []

    @abstractmethod
    def table(self, outcomes: Sequence[Any]) -> tuple[list[str], list[list[list[str]]]]:
        """The columns between check/engine/model/policy and budget/verdict, and for each
        outcome its lines of cells (the first line carries the check's name)."""

    def detail_from_json(self, data: Mapping[str, Any]) -> Any:
        return self.detail_type(**data)

    # Optional hooks: what a scenario adds to the report beyond its table. The modules that
    # draw the report call these for every scenario and never name one.

    footnote: ClassVar[str] = ""
    """A line printed under the terminal tables when a check of this scenario ran."""
    explanation_schema: ClassVar[dict[str, Any] | None] = None
    """The JSON schema of what ``explain`` returns (None: it returns nothing)."""

    def explain(self, ctx: Context, check: Check[SpecT]) -> dict[str, Any] | None:
        """Why a check that broke a budget broke it, read from the engine (JSON-ready, kept
        as the row's ``explanation``); None: nothing to say. Called only for a check with
        violations; if it raises, the error is said and the verdict stands."""
        return None

    def report_sections(self, outcome: Any) -> list[tuple[str, str]]:
        """(title, text) sections added to the test's report (shown with its failure)."""
        return []

    def panels(self, outcome: Any) -> list[Panel]:
        """What this check draws in the plots next to the JSON report (``--kvguard-plot``)."""
        return []

    @property
    def budgets(self) -> tuple[str, ...]:
        """The names of the budgets that apply (``limits``)."""
        return tuple(limit.name for limit in self.limits)

    @property
    def comparable_metrics(self) -> dict[str, bool]:
        """The figures a baseline or an upgrade preview compares for this scenario's checks,
        and whether each is better higher: those its budgets gate on, in the budgets' own
        direction (a ``min_`` budget's figure regresses by falling)."""
        return {limit.metric: limit.bound == "min" for limit in self.limits}


@dataclass(frozen=True)
class Panel:
    """One thing a check draws into a plot file: panels of a file that share a ``group``
    share axes (a line per check); the file's first panel sets its grid."""

    file: str
    """The plot's name: ``kvguard-report.<file>.png`` beside the JSON report."""
    group: str
    """Panels with the same group draw on the same axes."""
    draw: Callable[[Any], int]
    """Draws on a matplotlib ``Axes`` (titles and labels included); returns what it drew
    (lines or images; 0: nothing)."""
    columns: int = 2
    """Axes per row of the file's grid."""
    size: tuple[float, float] = (7.0, 4.5)
    """Inches per axes, width and height."""
