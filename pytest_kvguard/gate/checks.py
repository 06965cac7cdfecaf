"""One way to build a check, whoever writes it: a budgets-file entry or a ``kvguard`` fixture call.

Both arrive as a mapping of check keys (``engine``, ``model``, ``policy``, ``params``, ...);
``build_check`` validates it against the scenario's own parameter table and spec, so a check
means the same thing whichever way it is written. Every error is a ``KvguardError`` pinned to
the line of the key at fault (budgets file) or left for the caller to place (fixture).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pytest_kvguard.core.budgets import Budgets, unknown_key_error
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import ENGINES, engine_info, require_installed
from pytest_kvguard.inputs.models import parse_model
from pytest_kvguard.scenarios import DEFAULT_SCENARIO, SCENARIOS, all_param_names
from pytest_kvguard.scenarios.base import Check, Fields

CHECK_KEYS = [
    "name", "scenario", "engine", "engines", "model", "policy", "baseline", "params", "budgets",
    "expect", "reason", "timeout",
]  # fmt: skip
DEFAULT_KEYS = [
    "scenario", "engine", "engines", "model", "baseline", "params", "budgets", "timeout",
]  # fmt: skip
EXPECTATIONS = ("pass", "violation")


class Written(dict[Any, Any]):
    """A mapping as the user wrote it: with the line of itself and of each key (YAML), or none
    (fixture keywords)."""

    line: int | None = None
    key_lines: dict[Any, int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_lines = {}

    @classmethod
    def plain(cls, mapping: Mapping[str, Any]) -> Written:
        """A mapping with no lines; nested mappings become ``Written`` too."""

        def value(v: Any) -> Any:
            if isinstance(v, Mapping):
                return cls.plain(v)
            return list(v) if isinstance(v, tuple) else v

        return cls({k: value(v) for k, v in mapping.items()})


class _Lines:
    """Where each key of a check was written: ``policy``, ``params.cap``, ``budgets.bounded``."""

    def __init__(self, entry: Written, defaults: Written) -> None:
        self.entry_line = entry.line
        self.lines: dict[str, int] = {**defaults.key_lines, **entry.key_lines}

    def add(self, prefix: str, mapping: Written) -> None:
        self.lines.update({f"{prefix}.{k}": line for k, line in mapping.key_lines.items()})

    def of(self, key: str | None) -> int | None:
        """The key's line, else its parent's (``params.x`` -> ``params``), else the check's."""
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key.rpartition(".")[0]
        return self.entry_line


def build_check(
    entry: Written,
    defaults: Written,
    *,
    base_dir: Path,
    path: Path | None = None,
    where: str = "",
    marker_budgets: Budgets | None = None,
    installed_elsewhere: frozenset[str] = frozenset(),
) -> Check[Any]:
    """Validate one check. With ``path`` errors carry its file and line; ``marker_budgets``
    (a test's ``kv_budget`` marker) replaces the ``budgets:`` key and may be empty. Engines in
    ``installed_elsewhere`` run in another environment, so they need not be installed here."""
    lines = _Lines(entry, defaults)
    try:
        return _build(entry, defaults, base_dir, where, marker_budgets, lines, installed_elsewhere)
    except KvguardError as exc:
        if path is None:
            raise
        raise exc.located(path, lines.of(exc.key)) from None


def _build(
    entry: Written,
    defaults: Written,
    base_dir: Path,
    where: str,
    marker_budgets: Budgets | None,
    lines: _Lines,
    installed_elsewhere: frozenset[str],
) -> Check[Any]:
    for key in entry:
        if key not in CHECK_KEYS:
            raise unknown_key_error("check key", str(key), CHECK_KEYS).keyed(str(key))

    def text(key: str, default: str | None = None, from_defaults: bool = True) -> str | None:
        value = entry.get(key, defaults.get(key, default) if from_defaults else default)
        if value is not None and not isinstance(value, str):
            raise _type_error(key, "a string", value)
        return value

    def required(key: str, fix: str | None = None) -> str:
        value = text(key)
        if value is None:
            raise KvguardError(f"check is missing '{key}'", fix=fix or f"add '{key}: ...'")
        return value

    name = required("name")
    kind = text("scenario", DEFAULT_SCENARIO)
    assert kind is not None
    if kind not in SCENARIOS:
        raise unknown_key_error("scenario", kind, list(SCENARIOS)).keyed("scenario")
    scenario = SCENARIOS[kind]
    engines = _engines(entry, defaults, scenario.engines, kind, installed_elsewhere)
    model_name = required("model")
    try:
        model = parse_model(model_name, base_dir)
        for engine in engines:
            if model.form not in ENGINES[engine].model_forms:
                raise KvguardError(
                    f"engine '{engine}' cannot load a model {model.form} ('{model.name}')",
                    fix="give a bundled model or a .gguf file"
                    + (
                        " (a URL is for engines llama_server and openai)"
                        if model.form == "url"
                        else ""
                    ),
                )
        if model.form == "url" and not scenario.serves_running_server:
            served = " and ".join(n for n, s in SCENARIOS.items() if s.serves_running_server)
            raise KvguardError(
                f"a running server (model: {model.name}) can serve {served} checks only",
                fix="give the model file instead, so kvguard starts the server for this check",
            )
    except KvguardError as exc:
        raise exc.keyed("model") from None

    policy: str | None = None
    if not scenario.takes_policy:
        for key in ("policy", "baseline") if not scenario.takes_baseline else ("policy",):
            if key in entry:
                why, fix = scenario.no_policy
                raise KvguardError(why, fix=fix.format(key=key), key=key)
    else:
        policy = text("policy", from_defaults=False)
        if policy is None:
            raise KvguardError("check is missing 'policy'", fix="add 'policy: ...'")
    baseline = text("baseline") if scenario.takes_baseline else None
    if scenario.takes_policy and not scenario.takes_baseline and "baseline" in entry:
        raise KvguardError(
            f"a {kind} check has no baseline policy",
            fix="remove 'baseline' (it belongs to stream and sweep checks)",
            key="baseline",
        )

    table = {p.name: p for p in scenario.params}
    others = all_param_names() - set(table)
    params = _merged(defaults, entry, "params", lambda key: key in others)
    lines.add("params", params)
    for key in params:
        if key not in table:
            raise unknown_key_error(f"{kind} parameter", str(key), list(table)).keyed(
                f"params.{key}"
            )
    values = {n: p.read(params[n]) if n in params else p.default for n, p in table.items()}
    fields = Fields(engines, policy, baseline, values, base_dir, kind, scenario.engine_path)
    spec = scenario.build(fields)

    if marker_budgets is None:
        budgets = _file_budgets(entry, defaults, kind, scenario.budgets, lines)
    else:
        budgets = marker_budgets
        for key in budgets.declared():
            if key not in scenario.budgets:
                raise _not_applying(key, kind, scenario.budgets)
    scenario.check_budgets(spec, budgets)
    if model.form == "url" and budgets.max_memory_bytes is not None:
        raise KvguardError(
            "memory is read from the log of a server kvguard starts, and this one runs elsewhere",
            fix="remove max_memory_bytes, or give the model file so kvguard starts the server",
            key="budgets.max_memory_bytes",
        )

    expect = text("expect", "pass", from_defaults=False)
    if expect not in EXPECTATIONS:
        raise KvguardError(
            f"expect must be one of {', '.join(EXPECTATIONS)}, got '{expect}'", key="expect"
        )
    reason = entry.get("reason")
    if expect == "violation" and not reason:
        raise KvguardError(
            "a negative control needs a reason",
            fix="add reason: why this check must break its budget",
            key="expect",
        )
    return Check(
        name=name,
        scenario=kind,
        engines=engines,
        model=model,
        spec=spec,
        budgets=budgets,
        expect_violation=expect == "violation",
        reason=str(reason) if reason else None,
        base_dir=base_dir,
        where=where,
        timeout=_timeout(entry.get("timeout", defaults.get("timeout"))),
    )


def _timeout(value: Any) -> float | None:
    """A check's time limit in seconds (None: the session's, from --kvguard-timeout)."""
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0 < value < math.inf:  # nan fails both comparisons
        raise KvguardError(
            f"timeout must be a finite number of seconds above 0, got {value!r}",
            fix="write e.g. timeout: 900",
            key="timeout",
        )
    return float(value)


def _engines(
    entry: Written, defaults: Written, count: int, kind: str, installed_elsewhere: frozenset[str]
) -> tuple[str, ...]:
    """The check's engine (``engine:``), or its two engines (``engines:``, parity)."""
    if count == 2 and "engine" in entry:
        raise KvguardError(
            f"a {kind} check names its two engines under 'engines', not 'engine'",
            fix="write engines: [llama_cpp, mlx]",
            key="engine",
        )
    if count == 1:
        if "engines" in entry:
            raise KvguardError(
                "'engines' is for parity checks",
                fix=f"use 'engine: NAME' for a {kind} check",
                key="engines",
            )
        value = entry.get("engine", defaults.get("engine"))
        if not isinstance(value, str):
            raise KvguardError(
                "check is missing 'engine'" if value is None else f"engine must be a name, got "
                f"{value!r}",
                fix="add 'engine: llama_cpp' (or mlx)",
                key=None if value is None else "engine",
            )  # fmt: skip
        names: tuple[str, ...] = (value,)
        key = "engine"
    else:
        value = entry.get("engines", defaults.get("engines"))
        if not (isinstance(value, list) and len(value) == count
                and all(isinstance(v, str) for v in value)):  # fmt: skip
            raise KvguardError(
                f"a {kind} check needs 'engines' with exactly {count} engine names",
                fix="write engines: [llama_cpp, mlx]",
                key="engines",
            )
        names, key = tuple(value), "engines"
    for engine in names:
        try:
            engine_info(engine)
            if engine not in installed_elsewhere:
                require_installed(engine)
        except KvguardError as exc:
            raise exc.keyed(key) from None
    return names


def _file_budgets(
    entry: Written, defaults: Written, kind: str, applies: tuple[str, ...], lines: _Lines
) -> Budgets:
    """The ``budgets:`` of a budgets-file check, over the defaults that apply to its scenario."""
    everything = set(Budgets.names())
    raw = _merged(defaults, entry, "budgets", lambda key: key in everything and key not in applies)
    lines.add("budgets", raw)
    for key, value in raw.items():
        try:
            Budgets.from_mapping({key: value})  # one at a time, so an error names its line
        except KvguardError as exc:
            raise exc.keyed(f"budgets.{key}") from None
        if key not in applies:
            raise _not_applying(str(key), kind, applies)
    try:
        budgets = Budgets.from_mapping(raw)
    except KvguardError as exc:
        raise exc.keyed("budgets") from None
    if not budgets.declared():
        raise KvguardError(
            "check declares no budgets, so it could never fail",
            fix="add budgets: e.g. max_ppl_increase_pct: 25",
        )
    return budgets


def _not_applying(key: str, kind: str, applies: tuple[str, ...]) -> KvguardError:
    return KvguardError(
        f"budget {key} does not apply to a {kind} check",
        fix="use one of " + ", ".join(applies),
        key=f"budgets.{key}",
    )


def _merged(
    defaults: Written, entry: Written, key: str, meant_elsewhere: Callable[[Any], bool]
) -> Written:
    """defaults[key] overlaid with entry[key], remembering each key's own line.

    A default that is ``meant_elsewhere`` (it belongs to checks of another scenario) is left
    out; the same name written on the check itself stays, so its check can refuse it.
    """
    merged = Written()
    merged.line = entry.line
    for source in (defaults, entry):
        value = source.get(key)
        if value is None:
            continue
        if not isinstance(value, Written):
            raise _type_error(key, "a mapping", value)
        for name, item in value.items():
            if source is defaults and meant_elsewhere(name):
                continue
            merged[name] = item
            if name in value.key_lines:
                merged.key_lines[name] = value.key_lines[name]
    return merged


def _type_error(key: str, wanted: str, value: Any) -> KvguardError:
    return KvguardError(
        f"{key} must be {wanted}, got {value!r}", fix=f"write {key} as {wanted}", key=key
    )
