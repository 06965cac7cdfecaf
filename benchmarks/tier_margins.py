"""How far each quick check's figures sit from their budgets, next to its full counterpart's.

    .venv/bin/pytest --kvguard fixtures/quick.yaml --kvguard-json quick.json
    .venv/bin/pytest --kvguard fixtures/budgets.yaml --kvguard-json full.json
    .venv/bin/python benchmarks/tier_margins.py quick.json full.json [--markdown]

A quick check and its full counterpart share a name. For every budget of every quick check:
the figure the budget judges, the budget, and the margin: how far the figure sits from the
budget on the passing side, as a share of the budget (negative: past it, as a negative
control's broken budget must be). Verdicts of both runs end each check's first line, and a
last line says whether every quick verdict equals its full counterpart's. Not a test.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pytest_kvguard.core.units import format_value
from pytest_kvguard.scenarios import declared_limits

BUDGET_FIELDS = declared_limits()
COUNTS = {
    name
    for name, meta in BUDGET_FIELDS.items()
    if meta.bound != "flag" and meta.unit in (" entries", " tokens", " B", " B/token")
}
"""Budgets on exact counts and bytes."""  # fmt: skip


def margin(budget: str, limit: float, measured: float) -> str:
    """The figure's distance from its limit on the passing side, relative to the limit."""
    meta = BUDGET_FIELDS[budget]
    if math.isnan(measured):
        return "broken (nan)"
    if meta.bound == "flag":
        return "ok" if measured <= 0 else "broken"
    room = limit - measured if meta.bound == "max" else measured - limit
    return f"{room / limit:+.0%}" if limit else f"{room:+g}"


def show(value: float, unit: str) -> str:
    """Sizes in binary units, other figures to 4 significant digits, with their unit."""
    if unit in (" B", " B/token"):
        return format_value(value, unit)
    return f"{value:,.4g}{unit}"


def figure(row: dict[str, Any] | None, budget: str) -> tuple[str, str, str]:
    """(figure, budget, margin) of one budget in one row; dashes where the row lacks it."""
    if row is None or budget not in row.get("budgets", {}):
        return "-", "-", "-"
    meta = BUDGET_FIELDS[budget]
    measured, limit = row["metrics"].get(meta.metric), row["budgets"][budget]
    if meta.bound == "flag":  # a flag's figure is what it forbids: 0 holds
        shown = "-" if measured is None else show(measured, meta.unit)
        return shown, "true", "-" if measured is None else margin(budget, 0.0, measured)
    if measured is None:
        return "-", show(limit, meta.unit), "-"
    return (show(measured, meta.unit), show(limit, meta.unit),
            margin(budget, float(limit), float(measured)))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quick", type=Path, help="JSON report of fixtures/quick.yaml")
    parser.add_argument("full", type=Path, help="JSON report of fixtures/budgets.yaml")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    parser.add_argument(
        "--quality-only", action="store_true",
        help="leave out budgets on counts and bytes (entries, tokens, bytes), whose budgets sit "
        "on the measured figure by design",
    )  # fmt: skip
    args = parser.parse_args()
    quick, full = (
        {r["name"]: r for r in json.loads(p.read_text(encoding="utf-8"))["checks"]}
        for p in (args.quick, args.full)
    )
    lines, unequal = [], []
    for name, row in quick.items():
        counterpart = full.get(name)
        verdicts = (row["verdict"], counterpart["verdict"] if counterpart else "absent")
        if verdicts[0] != verdicts[1]:
            unequal.append(name)
        budgets = [b for b in row.get("budgets") or {}
                   if not (args.quality_only and b in COUNTS)] or ["counts only"]  # fmt: skip
        for i, budget in enumerate(budgets):
            first = i == 0
            lines.append([
                name if first else "", budget, *figure(row, budget),
                *figure(counterpart, budget), " / ".join(verdicts) if first else "",
            ])  # fmt: skip
    headers = ["check", "budget", "quick figure", "quick budget", "quick margin", "full figure",
               "full budget", "full margin", "verdict quick / full"]  # fmt: skip
    print(tabulate(lines, headers=headers, tablefmt="github" if args.markdown else "simple",
                   disable_numparse=True))  # fmt: skip
    if unequal:
        print(f"\n{len(unequal)} quick check(s) with another verdict than full: "
              + ", ".join(unequal))  # fmt: skip
    else:
        print(f"\nall {len(quick)} quick verdicts equal their full counterparts'")


if __name__ == "__main__":
    main()
