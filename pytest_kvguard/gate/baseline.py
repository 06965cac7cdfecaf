"""Baselines: compare a run with an earlier run's JSON report, figure by figure, with tolerances.

A baseline is a JSON report written by ``--kvguard-json``. Tolerances come from the budgets
file's ``baseline_tolerances:`` (metric -> ``"2%"``, a number, or ``exact``) over the defaults.
A figure that moved the wrong way by more than its tolerance is a regression; the message names
the figure, both values, the tolerance and what was upgraded between the two runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pytest_kvguard.core.budgets import Budgets, unknown_key_error
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.units import format_change, format_figure
from pytest_kvguard.gate.outcome import Outcome, Row
from pytest_kvguard.gate.report import READABLE_SCHEMAS
from pytest_kvguard.scenarios import SCENARIOS


def comparable_metrics() -> dict[str, bool]:
    """Figures a baseline tolerance can name (every figure a budget of a registered scenario
    gates on, a scenario added at run time included), and whether each regresses by falling
    (a ``min_`` budget's figure); every other one regresses by rising."""
    return Budgets.gated_metrics(Budgets.names())


DEFAULT_TOLERANCES = {
    "post_eviction_ppl": "2%",
    "mean_abs_nll_diff": "20%",
    "reuse_excess": "0.05",
    "reprefill_tokens": "0",
    "reused_tokens": "0",
    "kv_entries": "exact",
    "kv_bytes": "exact",
    "memory_bytes": "exact",
}
"""Used for a figure the budgets file's ``baseline_tolerances:`` do not mention."""


@dataclass(frozen=True)
class Tolerance:
    """How far a figure may move the wrong way: by ``amount`` percent, by ``amount``, or not at
    all in either direction (exact)."""

    metric: str
    kind: str
    """pct, abs or exact."""
    amount: float = 0.0

    def describe(self) -> str:
        if self.kind == "exact":
            return "exact"
        unit = "%" if self.kind == "pct" else ""
        sign = "-" if comparable_metrics().get(self.metric) else "+"
        return f"{sign}{self.amount:g}{unit}"

    def allows(self, old: float, new: float) -> bool:
        if self.kind == "exact":
            return new == old
        worse = old - new if comparable_metrics().get(self.metric) else new - old
        if self.kind == "abs":
            return worse <= self.amount
        return worse <= abs(old) * self.amount / 100.0


def parse_tolerance(metric: str, raw: object) -> Tolerance:
    """``"2%"`` -> 2 percent, ``0`` or ``"5"`` -> absolute, ``exact`` -> equal."""
    if metric not in comparable_metrics():
        raise unknown_key_error("baseline figure", metric, sorted(comparable_metrics()))
    text = str(raw).strip()
    if text == "exact":
        return Tolerance(metric, "exact")
    kind = "pct" if text.endswith("%") else "abs"
    try:
        amount = float(text.rstrip("%"))
    except ValueError:
        amount = math.nan
    if isinstance(raw, bool) or math.isnan(amount) or amount < 0:
        raise KvguardError(
            f"baseline tolerance for {metric} must be a percentage, a number >= 0 or exact, "
            f"got {raw!r}",
            fix=f"write e.g. {metric}: 2%",
        )
    return Tolerance(metric, kind, amount)


def tolerances(declared: Mapping[str, object]) -> dict[str, Tolerance]:
    """The defaults, overridden metric by metric by the budgets file's own tolerances."""
    merged: dict[str, object] = {**DEFAULT_TOLERANCES, **declared}
    return {metric: parse_tolerance(metric, raw) for metric, raw in merged.items()}


@dataclass(frozen=True)
class Baseline:
    """An earlier run's JSON report."""

    path: Path
    report: dict[str, Any]

    @property
    def checks(self) -> dict[str, dict[str, Any]]:
        return {row["name"]: row for row in self.report["checks"] if row["verdict"] != "ERROR"}

    def differences(self, machine: Mapping[str, Any]) -> list[str]:
        """What makes figures incomparable beyond an upgrade: machine class, CPU, Python."""
        then = self.report.get("machine", {})
        return [
            f"{key} {then.get(key)} -> {machine.get(key)}"
            for key in ("machine", "cpu", "cpu_count", "python")
            if then.get(key) != machine.get(key)
        ]


def load_baseline(path: Path) -> Baseline:
    """Read a JSON report to compare against; refuse one that is not a complete kvguard report."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KvguardError(
            f"cannot read baseline {path}: {exc.strerror}",
            fix="pass a JSON report written by --kvguard-json",
        ) from None
    except json.JSONDecodeError as exc:
        raise KvguardError(
            f"{path}:{exc.lineno}: baseline is not JSON ({exc.msg})",
            fix="pass a JSON report written by --kvguard-json",
        ) from None
    if not isinstance(report, dict) or report.get("schema") not in READABLE_SCHEMAS:
        raise KvguardError(
            f"{path} is not a kvguard report of schema "
            + " or ".join(str(v) for v in READABLE_SCHEMAS),
            fix="save a new baseline with --kvguard-json",
        )
    if not report.get("complete"):
        raise KvguardError(
            f"baseline {path} comes from an incomplete run (missing: "
            f"{', '.join(report.get('missing_checks') or []) or 'checks that errored'})",
            fix="save the baseline from a complete run",
        )
    return Baseline(path, report)


def upgrades(then: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What changed between the two runs of one check: engine, model file, text, budgets."""
    changes = []
    if then.get("engine_version") != now.get("engine_version"):
        changes.append(f"{now['engine']} {then.get('engine_version')} -> {now['engine_version']}")
    if then.get("model_sha256") != now.get("model_sha256"):
        old, new = then.get("model_sha256") or "?", now.get("model_sha256") or "?"
        model = (
            now["model"]
            if then.get("model", now["model"]) == now["model"]
            else (f"{then['model']} -> {now['model']},")
        )
        changes.append(f"model {model} sha256 {old[:12]} -> {new[:12]}")
    if then.get("text_sha256") != now.get("text_sha256"):
        changes.append(f"text {now['text']} changed")
    then_info, now_info = then.get("engine_info", {}), now.get("engine_info", {})
    build_keys = sorted(k for k in {*then_info, *now_info} if then_info.get(k) != now_info.get(k))
    if build_keys and then.get("engine_version") == now.get("engine_version"):
        changes.append("engine build changed (" + ", ".join(build_keys) + ")")
    return changes


def regressions(
    then: Mapping[str, Any],
    now: Mapping[str, Any],
    rules: Mapping[str, Tolerance],
    against: str = "baseline",
) -> list[str]:
    """One message per figure that moved the wrong way past its tolerance."""
    found = []
    old_metrics, new_metrics = then.get("metrics", {}), now.get("metrics", {})
    for metric, rule in sorted(rules.items()):
        if metric not in old_metrics or metric not in new_metrics:
            continue
        old, new = float(old_metrics[metric]), float(new_metrics[metric])
        if rule.allows(old, new):
            continue
        found.append(
            f"{metric} {format_figure(old)} -> {format_figure(new)} ({format_change(old, new)}), "
            f"tolerance {rule.describe()}"
        )
    if not found:
        return []
    what = upgrades(then, now)
    since = "; ".join(what) if what else "no engine, model or text change"
    return [f"regressed against {against}: {', '.join(found)} [since {against}: {since}]"]


def compare_with_baseline(
    outcome: Outcome, baseline: Baseline, rules: Mapping[str, Tolerance]
) -> Outcome:
    """The outcome with what changed since the baseline, and any regression as a violation."""
    then = baseline.checks.get(outcome.name)
    if then is None:
        return replace(outcome, baseline_status="not in baseline")
    return _judged_against(outcome, then, rules, "baseline")


def _judged_against(
    outcome: Outcome, then: Mapping[str, Any], rules: Mapping[str, Tolerance], label: str
) -> Outcome:
    """What changed since ``then`` (an earlier row), and any regression as a violation."""
    now = outcome.to_json()
    outcome = replace(outcome, baseline_changes=upgrades(then, now))
    if outcome.expect_violation:
        return replace(outcome, baseline_status="not compared (negative control)")
    # Only the figures this scenario's budgets judge: edit_replay's raw reuse gap holds the
    # engine's own floor, which a new model's weights move (SmolLM2 Q4_1 -> Q4_K_M: 0 -> 0.064
    # nats) while the excess beyond it, the judged figure, stays below 0.
    scenario = SCENARIOS.get(outcome.scenario)
    if scenario is not None:
        rules = {m: r for m, r in rules.items() if m in scenario.comparable_metrics}
    found = regressions(then, now, rules, against=label)
    return replace(
        outcome,
        violations=[*outcome.violations, *found],
        baseline_status="regressed" if found else "within tolerance",
    )


def compare_with_other_run(
    outcome: Outcome, other: Outcome, rules: Mapping[str, Tolerance], python: str
) -> Outcome:
    """Upgrade or model preview: the outcome judged against the same check's other run (in
    another environment, or on the model the candidate would replace)."""
    summary = {
        "python": python,
        "engine_version": other.engine_version,
        "model": other.model,
        "model_path": other.model_path,
        "model_sha256": other.model_sha256,
        "verdict": other.verdict,
        "metrics": other.metrics,
        "violations": other.violations,
    }
    if other.model_path != outcome.model_path:
        label = f"model {other.model} (model preview)"
    else:
        label = f"{other.engine} {other.engine_version} (upgrade preview)"
    return _judged_against(replace(outcome, against=summary), other.to_json(), rules, label)


def other_run_failed(
    outcome: Outcome, python: str, error: str, detail: str, model: str | None = None
) -> Outcome:
    """A preview whose other run could not run: never a pass that compared nothing. ``model``:
    the model preview's reference model (else the upgrade preview's environment failed).
    ``detail`` (the error with a worker's traceback or last words) goes to the JSON row."""
    where = f"on model {model}" if model else f"in {python}"
    preview = "model preview" if model else "upgrade preview"
    return replace(
        outcome,
        against={"python": python, "error": detail, **({"model": model} if model else {})},
        violations=[*outcome.violations, f"{preview}: the run {where} failed: {error}"],
        baseline_status="preview failed",
    )


def _same_figure(old: float, new: float) -> bool:
    """Equal, or both NaN (a run that refused, as mlx-lm a quantized rotating cache)."""
    return old == new or (math.isnan(old) and math.isnan(new))


def render_preview(rows: Sequence[Row], fmt: str = "simple") -> str:
    """The upgrade preview: each previewed check's compared figures in both environments, the
    ones that changed (a check where none did gets one line saying so)."""
    lines = []
    for row in rows:
        if not isinstance(row, Outcome) or row.against is None:
            continue
        other = row.against
        if "error" in other:
            lines.append([row.name, "-", "(run failed)", "", "", row.verdict])
            continue
        old, new = other["metrics"], row.metrics
        compared = SCENARIOS[row.scenario].comparable_metrics
        changed = [m for m in sorted(compared) if m in old and m in new
                   and not _same_figure(old[m], new[m])]  # fmt: skip
        for i, metric in enumerate(changed or ["(no compared figure changed)"]):
            cells = (
                [metric, format_figure(old[metric]), format_figure(new[metric]),
                 format_change(old[metric], new[metric])]
                if changed else [metric, "", "", ""]
            )  # fmt: skip
            lines.append([row.name if i == 0 else "", *cells, row.verdict if i == 0 else ""])
    if not lines:
        return ""
    # (this run's model and engine version, the other run's summary) per previewed row
    previewed = [(o, o.against) for o in rows if isinstance(o, Outcome) and o.against]
    versions = sorted({(o.engine, o.engine_version, other["engine_version"])
                       for o, other in previewed if other.get("model", o.model) == o.model
                       and "engine_version" in other})  # fmt: skip
    models = sorted({(other["model"], o.model) for o, other in previewed
                     if other.get("model", o.model) != o.model})  # fmt: skip
    title = "; ".join([*(f"{e} {old} -> {new}" for e, new, old in versions),
                       *(f"model {old} -> {new}" for old, new in models)])  # fmt: skip
    kind = "model preview" if models and not versions else "upgrade preview"
    table = tabulate(lines, headers=["check", "figure", "against", "this run", "change", "verdict"],
                     tablefmt=fmt, disable_numparse=True)  # fmt: skip
    return f"{kind} ({title or 'nothing changed'}):\n{table}"
