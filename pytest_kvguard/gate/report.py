"""The end-of-run tables, the JSON report and the GitHub step summary, from typed rows.

Each scenario draws its own table (``Scenario.table``); this module adds the columns every
check has (check, engine, model, policy ... budget, verdict) and one table per scenario.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pytest_kvguard import __version__
from pytest_kvguard.gate.outcome import CheckError, Outcome, Row
from pytest_kvguard.scenarios import SCENARIOS

REPORT_SCHEMA = 2
"""The JSON report's schema version; ``report_schema()`` describes it."""
READABLE_SCHEMAS = (1, 2)
"""Report schemas a baseline may come from (1 kept its figures under the same names)."""


def render_table(rows: Sequence[Row], fmt: str = "simple") -> str:
    """One table per scenario, in registry order; checks that errored in a table of their own."""
    parts = []
    for name, scenario in SCENARIOS.items():
        outcomes = [r for r in rows if isinstance(r, Outcome) and r.scenario == name]
        if not outcomes:
            continue
        middle, cells = scenario.table(outcomes)
        headers = ["check", "engine", "model", "policy", *middle, "budget", "verdict"]
        lines = []
        for outcome, own in zip(outcomes, cells, strict=True):
            for i, line in enumerate(own):
                first = i == 0
                lines.append([
                    outcome.name if first else "",
                    f"{outcome.engine} {outcome.engine_version}" if first else "",
                    outcome.model if first else "", outcome.policy if first else "", *line,
                    outcome.budget_text if first else "", outcome.verdict if first else "",
                ])  # fmt: skip
        parts.append(tabulate(lines, headers=headers, tablefmt=fmt, disable_numparse=True))
    errors = [r for r in rows if isinstance(r, CheckError)]
    if errors:
        lines = [[e.name, e.scenario or "-", e.error, e.verdict] for e in errors]
        parts.append(tabulate(lines, headers=["check", "scenario", "error", "verdict"],
                              tablefmt=fmt, disable_numparse=True))  # fmt: skip
    return "\n\n".join(parts)


def machine() -> dict[str, Any]:
    """Enough to tell whether two reports came from the same kind of machine."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def passed(rows: Sequence[Row], exitstatus: int, missing: Sequence[str]) -> bool:
    """A run passes only when complete, pytest passed, and every check passed or caught."""
    return not missing and exitstatus == 0 and all(r.verdict in ("PASS", "CAUGHT") for r in rows)


def build_report(
    rows: Sequence[Row],
    *,
    budgets_file: str | None,
    budgets_sha256: str | None,
    missing_checks: Sequence[str],
    exitstatus: int,
    baseline: dict[str, Any] | None = None,
    model_preview: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON report. ``complete`` is false when a collected check left no figures.
    ``model_preview``: each model swap's facts diff (``model_preview.FactsDiff``)."""
    complete = not missing_checks and not any(isinstance(r, CheckError) for r in rows)
    return {
        "schema": REPORT_SCHEMA,
        "kvguard_version": __version__,
        "verdict": "pass" if passed(rows, exitstatus, missing_checks) else "fail",
        "complete": complete,
        "pytest_exitstatus": exitstatus,
        "missing_checks": list(missing_checks),
        "lost_checks": [r.name for r in rows if isinstance(r, CheckError) and r.lost],
        "budgets_file": budgets_file,
        "budgets_sha256": budgets_sha256,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "baseline": baseline,
        "model_preview": model_preview,
        "checks": [r.to_json() for r in rows],
    }


def step_summary(
    rows: Sequence[Row],
    *,
    exitstatus: int,
    missing: Sequence[str],
    warning: str | None = None,
    preview: str = "",
) -> str:
    """Markdown for $GITHUB_STEP_SUMMARY: the verdict, the tables (``preview``: the upgrade
    preview's, drawn by ``baseline.render_preview``), and what went wrong."""
    verdict = "pass" if passed(rows, exitstatus, missing) else "FAIL"
    lines = [f"## kvguard: {verdict}", ""]
    if warning:
        lines += [f"> **{warning}**", ""]
    lines += [render_table(rows, fmt="github"), ""]
    if preview:
        lines += [preview, ""]
    problems = [
        f"- **{r.name}** ({r.verdict}): "
        + (r.error if isinstance(r, CheckError) else "; ".join(r.violations) or "no violation")
        for r in rows
        if r.verdict in ("FAIL", "MISSED", "ERROR")
    ]
    problems += [f"- **{name}**: collected but never ran (incomplete run)" for name in missing]
    if problems:
        lines += ["### Failed checks", "", *problems, ""]
    return "\n".join(lines) + "\n"


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)  # never leave a half-written report behind


_DETAIL_TYPES = {
    "str": {"type": "string"},
    "float": {"type": "number"},
    "int": {"type": "integer"},
    "int | None": {"type": ["integer", "null"]},
    "str | None": {"type": ["string", "null"]},
    "list[int]": {"type": "array", "items": {"type": "integer"}},
    "list[float]": {"type": "array", "items": {"type": "number"}},
    "list[list[float]]": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    "list[list[list[float]]]": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    },
    "list[list[int]]": {"$ref": "#/$defs/layer_sizes"},
    "list[dict[str, float]]": {"$ref": "#/$defs/samples"},
    "list[dict[str, Any]]": {"$ref": "#/$defs/samples"},
}


def report_schema() -> dict[str, Any]:
    """The JSON report's complete schema: the frame in ``data/report.schema.json``, each
    registered scenario's name, its detail's schema derived from the detail dataclass, and
    its explanation's (``Scenario.explanation_schema``)."""
    schema: dict[str, Any] = json.loads(
        resources.files("pytest_kvguard").joinpath("data/report.schema.json").read_text("utf-8")
    )
    outcome = schema["$defs"]["outcome"]
    outcome["properties"]["scenario"] = {"enum": list(SCENARIOS)}
    details: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        fields = dataclasses.fields(scenario.detail_type)
        unknown = [f"{f.name}: {f.type}" for f in fields if str(f.type) not in _DETAIL_TYPES]
        if unknown:
            raise TypeError(f"{name} detail fields with no JSON schema: {', '.join(unknown)}")
        details[name] = {
            "type": "object",
            "required": [f.name for f in fields],
            "additionalProperties": False,
            "properties": {f.name: _DETAIL_TYPES[str(f.type)] for f in fields},
        }
    schema["$defs"]["details"] = details
    outcome["allOf"] = [
        {
            "if": {"properties": {"scenario": {"const": name}}},
            "then": {
                "properties": {
                    "detail": {"$ref": f"#/$defs/details/{name}"},
                    "explanation": {"oneOf": [{"type": "null"}, scenario.explanation_schema]}
                    if scenario.explanation_schema
                    else {"type": "null"},
                }
            },
        }
        for name, scenario in SCENARIOS.items()
    ]
    return schema
