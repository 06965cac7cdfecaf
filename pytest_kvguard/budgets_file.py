"""The budgets file: a versioned YAML list of checks, validated with file:line errors.

Schema (version 1)::

    version: 1
    defaults:            # optional; merged under every check (params and budgets key by key)
      engine: llama_cpp
      model: smollm2-135m
    checks:
      - name: smollm2-sink4          # unique; becomes the pytest item name
        scenario: stream             # default: stream
        engine: llama_cpp
        model: smollm2-135m          # bundled name, or a .gguf path (relative to this file)
        policy: sink                 # full | window | sink
        baseline: full               # the policy the delta is measured against (default: full)
        params: {tokens: 1500, cap: 256, sinks: 4, positions: reindexed, evict_step: 1, text: pydoc}
        budgets: {max_ppl_increase_pct: 25, max_post_eviction_ppl: 14}
        expect: pass                 # or "violation": a negative control that must break a budget
        reason: why a violation is expected (required with expect: violation)
    baseline_tolerances:   # optional; with --kvguard-baseline: how far a figure may regress
      post_eviction_ppl: 2%          # may rise 2%; a number: by that much; exact: not change
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pytest_kvguard.baseline import Tolerance, parse_tolerance, tolerances
from pytest_kvguard.budgets import Budgets, unknown_key_error
from pytest_kvguard.engines import ENGINES, check_policy, check_policy_kind, require_installed
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.models import ModelRef, parse_model
from pytest_kvguard.policies import DEFAULT_CHECKPOINT_STEP, POLICY_KINDS, Policy, make_policy
from pytest_kvguard.scenarios.edit_replay import (
    DEFAULT_CHAT,
    FOLLOWUPS,
    followup,
    load_conversation,
)
from pytest_kvguard.scenarios.memory import DEFAULT_LENGTHS, check_lengths
from pytest_kvguard.scenarios.recall import (
    DEFAULT_ANSWER,
    DEFAULT_FACT,
    DEFAULT_FILLER_TOKENS,
    DEFAULT_QUESTION,
)
from pytest_kvguard.scenarios.stream import check_reaches_eviction
from pytest_kvguard.scenarios.sweep import DEFAULT_SINKS as DEFAULT_SWEEP
from pytest_kvguard.scenarios.sweep import check_sinks, sweep_policy
from pytest_kvguard.texts import DEFAULT_TEXT, load_text

SCHEMA_VERSION = 1
SCENARIOS = {
    "stream": "feed a long text far past the cache's capacity, score every next token",
    "parity": "full cache on two engines, same token ids: per-token NLL must agree",
    "edit_replay": "a cached chat gets a follow-up: count reused and re-prefilled prompt tokens",
    "memory": "KV bytes at several context lengths, measured against the predicted figure",
    "sweep": "one cap, 0/1/2/4/8 sinks, re-indexed and absolute positions side by side",
    "recall": "a fact before the window, asked about after a long filler: recalled or lost",
}
CHECK_KEYS = [
    "name", "scenario", "engine", "engines", "model", "policy", "baseline", "params", "budgets",
    "expect", "reason",
]  # fmt: skip
TOP_KEYS = ["version", "defaults", "checks", "baseline_tolerances"]
DEFAULT_KEYS = ["scenario", "engine", "engines", "model", "baseline", "params", "budgets"]
STREAM_PARAMS = {
    "tokens": "token ids fed (default 1500)",
    "cap": "KV entries kept per layer, sinks included",
    "sinks": "pinned leading tokens (sink policy; default 4)",
    "positions": "reindexed (llama.cpp context shift) or absolute (mlx-lm); default: the "
    "engine's own (llama_cpp reindexed, mlx absolute)",
    "evict_step": "tokens dropped per eviction (default 1)",
    "text": f"'{DEFAULT_TEXT}' (CPython's pydoc topics) or a UTF-8 file (default {DEFAULT_TEXT})",
}
REPLAY_PARAMS = {
    "chat": f"'{DEFAULT_CHAT}' (the bundled 4k-token chat) or a JSON chat file (default)",
    "followup": "edit, regenerate, append or trim_reasoning",
    "message": "edit: index of the edited message (negative counts from the end)",
    "checkpoints": "swa: keep at most this many sliding-layer checkpoints (default 0: none)",
    "checkpoint_step": f"swa: tokens between checkpoints (default {DEFAULT_CHECKPOINT_STEP})",
}
MEMORY_PARAMS = {
    "lengths": "context lengths (tokens fed) at which KV bytes are measured and predicted "
    f"(default {list(DEFAULT_LENGTHS)})",
    **{key: STREAM_PARAMS[key] for key in ("cap", "sinks", "positions", "evict_step", "text")},
}
SWEEP_PARAMS = {
    **{key: STREAM_PARAMS[key] for key in ("tokens", "cap", "evict_step", "text")},
    "sinks": f"sweep: the sink counts run under the same cap (default {list(DEFAULT_SWEEP)}; "
    "0 is a pure window)",
    "positions": "sweep: a list of position handlings run side by side, e.g. [reindexed, "
    "absolute] (default: the engine's own)",
}
RECALL_PARAMS = {
    **{key: STREAM_PARAMS[key] for key in ("cap", "sinks", "positions", "evict_step")},
    "text": "where the filler comes from: 'pydoc' or a UTF-8 file (default pydoc)",
    "filler_tokens": f"recall: tokens of filler between the fact and the question "
    f"(default {DEFAULT_FILLER_TOKENS})",
    "fact": "recall: the sentence placed first (default: a vault password, PAPAYA-7)",
    "question": "recall: the question placed after the filler",
    "answer": "recall: the expected answer, teacher-forced; start it with a space",
}
SCENARIO_PARAMS: dict[str, dict[str, str]] = {
    "stream": STREAM_PARAMS,
    "parity": {key: STREAM_PARAMS[key] for key in ("tokens", "text")},
    "edit_replay": REPLAY_PARAMS,
    "memory": MEMORY_PARAMS,
    "sweep": SWEEP_PARAMS,
    "recall": RECALL_PARAMS,
}
EXPECTATIONS = ("pass", "violation")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _Located(dict[Any, Any]):
    """A YAML mapping that remembers the line of itself and of each key."""

    line: int
    key_lines: dict[Any, int]


class _LineLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        mapping = _Located(super().construct_mapping(node, deep=True))
        mapping.line = node.start_mark.line + 1
        mapping.key_lines = {
            self.construct_object(key, deep=True): key.start_mark.line + 1 for key, _ in node.value
        }
        return mapping


_LineLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _LineLoader.construct_mapping
)


@dataclass(frozen=True)
class ReplaySpec:
    """The conversation an edit_replay check caches and the follow-up it sends."""

    chat: str
    followup: str
    message: int | None


@dataclass(frozen=True)
class RecallSpec:
    fact: str = DEFAULT_FACT
    question: str = DEFAULT_QUESTION
    answer: str = DEFAULT_ANSWER
    filler_tokens: int = DEFAULT_FILLER_TOKENS


@dataclass(frozen=True)
class SweepSpec:
    sinks: tuple[int, ...]
    positions: tuple[str, ...]


@dataclass(frozen=True)
class Check:
    """One declared check: a scenario on an engine and model, under a policy, with budgets."""

    name: str
    scenario: str
    engine: str
    """The engine; for parity, the reference engine."""
    model: ModelRef
    policy: Policy
    baseline: Policy
    tokens: int
    text: str
    budgets: Budgets
    expect_violation: bool
    reason: str | None
    path: Path
    line: int
    other_engine: str | None = None
    """Parity only: the engine compared against ``engine``."""
    replay: ReplaySpec | None = None
    """edit_replay only: the chat and its follow-up."""
    lengths: tuple[int, ...] = ()
    """memory only: the context lengths measured."""
    sweep: SweepSpec | None = None
    """sweep only: the sink counts and position handlings."""
    recall: RecallSpec | None = None
    """recall only: the fact, question, answer and filler length."""

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class BudgetsFile:
    path: Path
    sha256: str
    checks: tuple[Check, ...]
    baseline_tolerances: dict[str, Tolerance] = field(default_factory=lambda: tolerances({}))
    """How far each figure may move against --kvguard-baseline (defaults + the file's own)."""


def load_budgets_file(path: Path) -> BudgetsFile:
    """Parse and validate a budgets file; every problem is a KvguardError naming file and line."""
    try:
        raw_bytes = path.read_bytes()
    except OSError as exc:
        raise KvguardError(
            f"cannot read budgets file: {exc.strerror}", path=path, fix="pass an existing YAML file"
        ) from None
    try:
        document = yaml.load(raw_bytes.decode("utf-8"), Loader=_LineLoader)  # noqa: S506
    except UnicodeDecodeError:
        raise KvguardError("budgets file is not UTF-8 text", path=path) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise KvguardError(
            f"malformed YAML: {problem}",
            path=path,
            line=mark.line + 1 if mark else None,
            fix="check indentation, colons and quoting on this line",
        ) from None
    if not isinstance(document, _Located):
        raise KvguardError(
            "a budgets file must be a mapping with 'version' and 'checks'",
            path=path,
            line=1,
            fix="start the file with 'version: 1' and a 'checks:' list",
        )
    _reject_unknown(
        document, ["version", "defaults", "checks", "baseline_tolerances"], "top-level key", path
    )
    version = document.get("version")
    if version != SCHEMA_VERSION:
        raise KvguardError(
            f"unsupported budgets file version {version!r}",
            path=path,
            line=document.key_lines.get("version", document.line),
            fix=f"set version: {SCHEMA_VERSION}",
        )
    defaults = document.get("defaults") or _Located()
    if not isinstance(defaults, _Located):
        raise _type_error("defaults", "a mapping", defaults, path, document.key_lines["defaults"])
    _reject_unknown(defaults, DEFAULT_KEYS, "defaults key", path)
    checks = document.get("checks")
    if not isinstance(checks, list) or not checks:
        raise KvguardError(
            "'checks' must be a non-empty list",
            path=path,
            line=document.key_lines.get("checks", document.line),
            fix="add at least one check under 'checks:'",
        )
    parsed: list[Check] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(checks):
        if not isinstance(entry, _Located):
            raise KvguardError(
                f"check #{index + 1} must be a mapping",
                path=path,
                line=document.key_lines["checks"],
            )
        check = _parse_check(entry, defaults, path)
        if check.name in seen:
            raise KvguardError(
                f"duplicate check name '{check.name}' (first on line {seen[check.name]})",
                path=path,
                line=check.line,
                fix="give every check a unique name",
            )
        seen[check.name] = check.line
        parsed.append(check)
    return BudgetsFile(
        path,
        hashlib.sha256(raw_bytes).hexdigest(),
        tuple(parsed),
        _baseline_tolerances(document, path),
    )


def _baseline_tolerances(document: _Located, path: Path) -> dict[str, Tolerance]:
    """The ``baseline_tolerances:`` section: how far each figure may move against a saved run."""
    key = "baseline_tolerances"
    section = document.get(key) or _Located()
    if not isinstance(section, _Located):
        raise _type_error(key, "a mapping", section, path, document.key_lines[key])
    declared: dict[str, object] = {}
    for metric, raw in section.items():
        try:
            parse_tolerance(str(metric), raw)
        except KvguardError as exc:
            raise exc.located(path, section.key_lines[metric]) from None
        declared[str(metric)] = raw
    return tolerances(declared)


def _reject_unknown(mapping: _Located, known: list[str], kind: str, path: Path) -> None:
    for key in mapping:
        if key not in known:
            raise unknown_key_error(kind, str(key), known).located(path, mapping.key_lines[key])


def _type_error(key: str, wanted: str, value: Any, path: Path, line: int) -> KvguardError:
    return KvguardError(
        f"{key} must be {wanted}, got {value!r}",
        path=path,
        line=line,
        fix=f"write {key} as {wanted}",
    )


def _merged(
    defaults: _Located,
    entry: _Located,
    key: str,
    path: Path,
    meant_elsewhere: Callable[[Any], bool],
) -> _Located:
    """defaults[key] overlaid with entry[key], remembering each key's own line.

    A default that is ``meant_elsewhere`` (it belongs to checks of another scenario) is left
    out; the same name written on the check itself stays, so its check can refuse it.
    """
    merged = _Located()
    merged.line, merged.key_lines = entry.line, {}
    for source in (defaults, entry):
        value = source.get(key)
        if value is None:
            continue
        if not isinstance(value, _Located):
            raise _type_error(key, "a mapping", value, path, source.key_lines[key])
        for name, item in value.items():
            if source is defaults and meant_elsewhere(name):
                continue
            merged[name] = item
            merged.key_lines[name] = value.key_lines[name]
    return merged


def _parse_check(entry: _Located, defaults: _Located, path: Path) -> Check:
    _reject_unknown(entry, CHECK_KEYS, "check key", path)

    def line_of(key: str, mapping: _Located = entry) -> int:
        return mapping.key_lines.get(key, entry.line)

    def text_field(key: str, default: str | None = None) -> str:
        value = entry.get(key, defaults.get(key, default))
        if value is None:
            raise KvguardError(
                f"check is missing '{key}'", path=path, line=entry.line, fix=f"add '{key}: ...'"
            )
        if not isinstance(value, str):
            raise _type_error(key, "a string", value, path, line_of(key))
        return value

    name = text_field("name")
    if not NAME_PATTERN.match(name):
        raise KvguardError(
            f"check name '{name}' has characters pytest ids cannot carry",
            path=path,
            line=line_of("name"),
            fix="use letters, digits, '.', '_' and '-'",
        )
    scenario = text_field("scenario", "stream")
    if scenario not in SCENARIOS:
        raise unknown_key_error("scenario", scenario, list(SCENARIOS)).located(
            path, line_of("scenario")
        )
    engines = _engine_names(entry, defaults, scenario, path)
    for engine_name, engine_line in engines:
        try:
            require_installed(engine_name)
        except KvguardError as exc:
            raise exc.located(path, engine_line) from None
    engine = engines[0][0]
    try:
        model = parse_model(text_field("model"), path.parent)
        for engine_name, _ in engines:
            if model.form not in ENGINES[engine_name].model_forms:
                raise KvguardError(
                    f"engine '{engine_name}' cannot load a model {model.form} ('{model.name}')",
                    fix="give a bundled model or a .gguf file",
                )
    except KvguardError as exc:
        raise exc.located(path, line_of("model")) from None

    known = SCENARIO_PARAMS[scenario]
    any_scenario = {name for names in SCENARIO_PARAMS.values() for name in names}
    params = _merged(
        defaults, entry, "params", path, lambda key: key in any_scenario and key not in known
    )
    for key in params:
        if key not in known:
            raise unknown_key_error(f"{scenario} parameter", str(key), list(known)).located(
                path, params.key_lines[key]
            )

    def int_param(key: str, default: int | None) -> int | None:
        value = params.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _type_error(f"params.{key}", "an integer", value, path, params.key_lines[key])
        return value

    def str_param(key: str, default: str) -> str:
        value = params.get(key, default)
        if not isinstance(value, str):
            raise _type_error(f"params.{key}", "a string", value, path, params.key_lines[key])
        return value

    tokens = int_param("tokens", 1500) if "tokens" in known else 0
    assert tokens is not None

    def policy_for(key: str, default: str | None) -> Policy:
        kind = text_field(key, default)
        engine_scenario = "stream" if scenario in ("parity", "recall") else scenario
        try:
            if kind in POLICY_KINDS:
                for engine_name, _ in engines:
                    check_policy_kind(engine_name, kind, engine_scenario)
            policy = make_policy(
                kind,
                cap=int_param("cap", None),
                sinks=int_param("sinks", None),
                positions=str_param("positions", ENGINES[engine].native_positions),
                evict_step=int_param("evict_step", 1) or 1,
                checkpoints=int_param("checkpoints", 0) or 0,
                checkpoint_step=int_param("checkpoint_step", None) or DEFAULT_CHECKPOINT_STEP,
            )
            for engine_name, _ in engines:
                check_policy(engine_name, policy, engine_scenario)
            return policy
        except KvguardError as exc:
            raise exc.located(path, line_of(key)) from None

    lengths: tuple[int, ...] = ()
    sweep: SweepSpec | None = None
    recall: RecallSpec | None = None
    if scenario == "parity":
        for key in ("policy", "baseline"):
            if key in entry:
                raise KvguardError(
                    "parity runs the full cache on both engines",
                    path=path,
                    line=line_of(key),
                    fix=f"remove '{key}'",
                )
        policy = baseline = policy_for("policy", "full")
        replay = None
    elif scenario == "edit_replay":
        policy = baseline = policy_for("policy", None)
        followup_kind = str_param("followup", "")
        if followup_kind not in FOLLOWUPS:
            raise unknown_key_error("follow-up", followup_kind, list(FOLLOWUPS)).located(
                path, params.key_lines.get("followup", entry.line)
            )
        message = int_param("message", None)
        if (followup_kind == "edit") != (message is not None):
            raise KvguardError(
                "params.message goes with followup: edit, and only with it",
                path=path,
                line=params.key_lines.get("message", params.key_lines["followup"]),
                fix="give the index of the edited message with edit; drop it otherwise",
            )
        chat = str_param("chat", DEFAULT_CHAT)
        try:
            # Parse the chat now: a bad file or index fails before any engine loads.
            followup(load_conversation(chat, path.parent), followup_kind, message)
        except KvguardError as exc:
            raise exc.located(path, params.key_lines.get("chat", line_of("policy"))) from None
        replay = ReplaySpec(chat, followup_kind, message)
    elif scenario == "sweep":
        replay = None
        if "policy" in entry:
            raise KvguardError(
                "a sweep chooses its policies (0 sinks: window; more: sink)",
                path=path,
                line=line_of("policy"),
                fix="remove 'policy'; list the sink counts in params.sinks",
            )
        cap = int_param("cap", None)
        try:
            counts = check_sinks(params.get("sinks", list(DEFAULT_SWEEP)), cap)
        except KvguardError as exc:
            raise exc.located(path, params.key_lines.get("sinks", entry.line)) from None
        modes = params.get("positions", [ENGINES[engine].native_positions])
        if not (isinstance(modes, list) and modes and all(isinstance(m, str) for m in modes)):
            raise _type_error(
                "params.positions", "a list of position handlings", modes, path,
                params.key_lines["positions"],
            )  # fmt: skip
        try:
            if cap is None:
                raise KvguardError("a sweep needs a cap", fix="set params.cap, e.g. cap: 256")
            evict_step = int_param("evict_step", 1) or 1
            for mode in modes:
                for count in counts:
                    check_policy(engine, sweep_policy(count, cap, mode, evict_step), "stream")
            policy = sweep_policy(counts[-1], cap, modes[0], evict_step)
            check_reaches_eviction(policy, tokens)
        except KvguardError as exc:
            raise exc.located(path, params.key_lines.get("positions", entry.line)) from None
        try:
            baseline = make_policy(text_field("baseline", "full"))
            check_policy(engine, baseline, "stream")
        except KvguardError as exc:
            raise exc.located(path, line_of("baseline")) from None
        sweep = SweepSpec(counts, tuple(dict.fromkeys(modes)))
    elif scenario == "recall":
        replay = None
        policy = baseline = policy_for("policy", None)
        filler = int_param("filler_tokens", DEFAULT_FILLER_TOKENS)
        assert filler is not None
        if filler < 1:
            raise KvguardError(
                "filler_tokens must be >= 1", path=path, line=params.key_lines["filler_tokens"]
            )
        recall = RecallSpec(
            str_param("fact", DEFAULT_FACT),
            str_param("question", DEFAULT_QUESTION),
            str_param("answer", DEFAULT_ANSWER),
            filler,
        )
        tokens = filler
    elif scenario == "memory":
        replay = None
        policy = baseline = policy_for("policy", None)
        try:
            lengths = tuple(check_lengths(params.get("lengths", list(DEFAULT_LENGTHS))))
        except KvguardError as exc:
            raise exc.located(path, params.key_lines.get("lengths", entry.line)) from None
        tokens = lengths[-1]
    else:
        replay = None
        policy = policy_for("policy", None)
        baseline = policy_for("baseline", "full")
        try:
            check_reaches_eviction(policy, tokens)
        except KvguardError as exc:
            raise exc.located(path, params.key_lines.get("tokens", line_of("policy"))) from None

    applies = Budgets.names(scenario)
    budgets_raw = _merged(
        defaults, entry, "budgets", path, lambda key: key in Budgets.names() and key not in applies
    )
    for key, value in budgets_raw.items():
        try:
            Budgets.from_mapping({key: value})  # one at a time, so an error names its line
            if key not in applies:
                raise KvguardError(
                    f"budget {key} does not apply to a {scenario} check",
                    fix="use one of " + ", ".join(applies),
                )
        except KvguardError as exc:
            raise exc.located(path, budgets_raw.key_lines[key]) from None
    budgets = Budgets.from_mapping(budgets_raw)
    if budgets.bounded and (policy.cap is None or tokens <= policy.cap):
        raise KvguardError(
            "bounded needs a policy with a cap and a run that goes past it"
            if policy.cap is None
            else f"bounded: the run ({tokens} tokens) never goes past the cap {policy.cap}",
            path=path,
            line=budgets_raw.key_lines["bounded"],
            fix="use window, sink or engine_default with a cap below the tokens fed",
        )
    if not budgets.declared():
        raise KvguardError(
            "check declares no budgets, so it could never fail",
            path=path,
            line=entry.line,
            fix="add budgets: e.g. max_ppl_increase_pct: 25",
        )
    text = str_param("text", DEFAULT_TEXT)
    if text != DEFAULT_TEXT:
        try:
            load_text(
                text, path.parent
            )  # a missing or non-UTF-8 file fails before any engine loads
        except KvguardError as exc:
            raise exc.located(path, params.key_lines["text"]) from None
    expect = text_field("expect", "pass")
    if expect not in EXPECTATIONS:
        raise KvguardError(
            f"expect must be one of {', '.join(EXPECTATIONS)}, got '{expect}'",
            path=path,
            line=line_of("expect"),
        )
    reason = entry.get("reason")
    if expect == "violation" and not reason:
        raise KvguardError(
            "a negative control needs a reason",
            path=path,
            line=line_of("expect"),
            fix="add reason: why this check must break its budget",
        )
    return Check(
        name=name,
        scenario=scenario,
        engine=engine,
        model=model,
        policy=policy,
        baseline=baseline,
        tokens=tokens,
        text=text,
        budgets=budgets,
        expect_violation=expect == "violation",
        reason=str(reason) if reason else None,
        path=path,
        line=entry.line,
        other_engine=engines[1][0] if scenario == "parity" else None,
        replay=replay,
        lengths=lengths,
        sweep=sweep,
        recall=recall,
    )


def _engine_names(
    entry: _Located, defaults: _Located, scenario: str, path: Path
) -> list[tuple[str, int]]:
    """(engine, line) for the check: one for stream, exactly two (``engines:``) for parity."""
    if scenario != "parity":
        if "engines" in entry:
            raise KvguardError(
                "'engines' is for parity checks",
                path=path,
                line=entry.key_lines["engines"],
                fix="use 'engine: NAME' for a stream check",
            )
        source = entry if "engine" in entry else defaults
        value = source.get("engine")
        line = source.key_lines.get("engine", entry.line) if value is not None else entry.line
        if not isinstance(value, str):
            raise KvguardError(
                "check is missing 'engine'"
                if value is None
                else f"engine must be a name, got {value!r}",
                path=path,
                line=line,
                fix="add 'engine: llama_cpp' (or mlx)",
            )
        return [(value, line)]
    source = entry if "engines" in entry else defaults
    value = source.get("engines")
    line = source.key_lines.get("engines", entry.line)
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise KvguardError(
            "a parity check needs 'engines' with exactly two engine names",
            path=path,
            line=line,
            fix="write engines: [llama_cpp, mlx]",
        )
    return [(value[0], line), (value[1], line)]
