"""Budgets: limits on a scenario's figures, and the violations a result makes of them.

Each kind of budget is a ``Limit`` its scenario declares (``Scenario.limits``, shared ones in
``scenarios/limits.py``); the same ``Budgets`` type is built from a YAML ``budgets:`` mapping
and from ``@pytest.mark.kv_budget(...)`` (its keywords are the declared limits, so a misspelt
budget fails loudly). This module does not import pytest, nor any scenario.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.units import SIZE_SUFFIXES, format_value, parse_size


@dataclass(frozen=True)
class Limit:
    """One kind of budget, declared by the scenario that judges it (``Scenario.limits``).

    ``bound`` is max, min, or flag (a boolean: the metric must not exceed 0). Units " B" and
    " B/token" accept sizes such as "6 MiB". ``span`` is every value the metric can take: a
    max at or above its top, or a min at or below its bottom, could never fail.
    """

    name: str
    """As written in a budgets file and on the marker: ``max_kv_entries``."""
    metric: str
    """The figure it gates (``Measured.metrics``): ``kv_entries``."""
    bound: str
    unit: str
    short: str
    """Its name in the table's budget column."""
    label: str
    """What a violation says it limits."""
    doc: str
    """The reference's line (docs/reference.md)."""
    span: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        if self.bound not in ("max", "min", "flag"):
            raise KvguardError(
                f"budget {self.name}: bound {self.bound!r}", fix="declare max, min or flag"
            )


_limit_source: Callable[[], Mapping[str, Limit]] | None = None


def set_limit_source(source: Callable[[], Mapping[str, Limit]]) -> None:
    """Where the known budgets come from: the scenario registry, which sets this as it loads
    (a layer above this one), so a scenario added at run time brings its own budgets."""
    global _limit_source
    _limit_source = source


def known_limits() -> Mapping[str, Limit]:
    """Every budget the registered scenarios declare, by name, in their order."""
    if _limit_source is None:
        raise KvguardError(
            "no scenarios are loaded, so no budget is known",
            fix="import pytest_kvguard.scenarios (the plugin and every command do)",
        )
    return _limit_source()


class Budgets:
    """Limits a check's result must stay within; a limit not given (or None) is not checked.
    Built from a YAML ``budgets:`` mapping and from ``@pytest.mark.kv_budget(...)`` alike:
    the keywords are the budgets the scenarios declare, so a misspelt one fails loudly. It
    keeps the declarations it was built with, so it judges alike in an engine worker."""

    def __init__(self, **limits: Any) -> None:
        known = known_limits()
        for name in limits:
            if name not in known:
                raise unknown_key_error("budget", name, list(known))
        given = {n: v for n, v in limits.items() if v is not None}  # None: not given
        self._limits = {n: known[n] for n in known if n in given}
        self._values = {n: _read(known[n], given[n]) for n in self._limits}

    def __getattr__(self, name: str) -> Any:
        """A budget's limit by name (None where not given)."""
        if name.startswith("_"):  # pickle's probes, before __dict__ is restored
            raise AttributeError(name)
        if name in self._values:
            return self._values[name]
        if name in known_limits():
            return None
        raise AttributeError(f"no budget {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Budgets):
            return NotImplemented
        return self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return "Budgets(" + ", ".join(f"{n}={v!r}" for n, v in self._values.items()) + ")"

    @classmethod
    def names(cls) -> list[str]:
        """Every budget's name, in the scenarios' order."""
        return list(known_limits())

    @classmethod
    def gated_metrics(cls, names: Iterable[str]) -> dict[str, bool]:
        """The metric each named budget gates on, and whether it is better higher (a ``min``
        bound): the figures a baseline compares and the direction they regress in."""
        known = known_limits()
        return {known[n].metric: known[n].bound == "min" for n in names}

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Budgets:
        """Build from a YAML mapping; unknown names get a suggestion."""
        for name in raw:
            if name not in known_limits():
                raise unknown_key_error("budget", str(name), cls.names())
        return cls(**raw)

    def declared(self) -> dict[str, float]:
        """Limits set, by name (``bounded: false`` is no limit at all)."""
        return {n: v for n, v in self._values.items() if not _unset(v)}

    def check(self, metrics: Mapping[str, float]) -> list[Violation]:
        """Every declared limit the metrics break. A value equal to its limit passes."""
        violations = []
        for name, limit in self.declared().items():
            meta = self._limits[name]
            if meta.metric not in metrics:
                raise KvguardError(
                    f"budget {name} does not apply to this check",
                    fix="remove it; this check measures " + ", ".join(sorted(metrics)),
                )
            measured = metrics[meta.metric]
            if meta.bound == "flag":
                limit = 0.0
            broken = measured < limit if meta.bound == "min" else measured > limit
            if broken or math.isnan(measured):
                violations.append(
                    Violation(name, meta.label, meta.unit, limit, measured, meta.bound)
                )
        return violations

    def describe(self) -> str:
        """Compact form for tables: ``ppl+<=25%, ppl<=13.5``."""
        parts = []
        for name, limit in self.declared().items():
            meta = self._limits[name]
            if meta.bound == "flag":
                parts.append(meta.short)
                continue
            op = "<=" if meta.bound == "max" else ">="
            unit = meta.unit if meta.unit in ("%", *SIZE_SUFFIXES) else ""
            parts.append(f"{meta.short}{op}{format_value(limit, unit)}")
        return ", ".join(parts) or "-"


def _read(limit: Limit, value: Any) -> Any:
    """The value as given, checked against its limit (a size read into bytes); errors name it."""
    name = limit.name
    if value is None:
        return None
    if limit.bound == "flag":
        if not isinstance(value, bool):
            raise KvguardError(
                f"budget {name} must be true or false, got {value!r}", fix=f"write {name}: true"
            )
        return value
    if isinstance(value, str) and limit.unit in SIZE_SUFFIXES:
        value = parse_size(value, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KvguardError(
            f"budget {name} must be a number, got {value!r}", fix=f"write e.g. {name}: 20"
        )
    if math.isnan(value) or value < 0:
        raise KvguardError(f"budget {name} must be >= 0, got {value!r}")
    if math.isinf(value):
        raise KvguardError(
            f"budget {name} is infinite, so it could never fail",
            fix=f"give a finite limit, or remove {name}",
        )
    low, high = limit.span
    if (limit.bound == "max" and value >= high) or (limit.bound == "min" and value <= low):
        reach = f"at most {high:g}" if limit.bound == "max" else f"at least {low:g}"
        raise KvguardError(
            f"budget {name}: {value!r} could never fail ({limit.metric} is always {reach})",
            fix=f"tighten {name}, or remove it",
        )
    return value


def _unset(limit: object) -> bool:
    """None, or ``bounded: false`` (0 is a real limit, so no ``in (None, False)``)."""
    return limit is None or limit is False


kv_budget = Budgets
"""The marker's signature: ``@pytest.mark.kv_budget(max_ppl_increase_pct=20, ...)``."""


@dataclass(frozen=True)
class Violation:
    """One broken budget, with the figures that broke it."""

    budget: str
    label: str
    unit: str
    limit: float
    measured: float
    bound: str = "max"

    @property
    def message(self) -> str:
        if self.bound == "flag":
            amount = f" (by {format_value(self.measured, self.unit)})" if self.unit else ""
            return f"{self.budget}: {self.label}{amount}"
        return (
            f"{self.budget}: {self.label} budget {format_value(self.limit, self.unit)}, "
            f"measured {format_value(self.measured, self.unit)}"
        )


def unknown_key_error(kind: str, name: str, known: list[str]) -> KvguardError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return KvguardError(f"unknown {kind} '{name}'", fix=f"{hint}known: {', '.join(known)}")
