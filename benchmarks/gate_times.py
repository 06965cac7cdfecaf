"""Where the bundled gate's time goes, per engine and scenario, from its JSON reports.

    .venv/bin/pytest --kvguard fixtures/budgets.yaml --kvguard-json after.json
    .venv/bin/python benchmarks/gate_times.py after.json [before.json]

Sums each check's wall ``seconds`` (a run several checks share counts once, for the check that
computed it; runs decoded together count for the check that asked first) by engine and
scenario. With a second report, the same sums from it and the ratio between the two, as
measured in those two runs. Not a test: wall time is reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from tabulate import tabulate


def seconds_by_group(report: dict[str, Any]) -> dict[tuple[str, str], float]:
    """Wall seconds of every check, summed per (engine, scenario)."""
    sums: dict[tuple[str, str], float] = defaultdict(float)
    for row in report["checks"]:
        if "seconds" in row:  # an ERROR row has none
            sums[(row["engine"], row["scenario"])] += sum(row["seconds"].values())
    return dict(sums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a JSON report of the bundled gate")
    parser.add_argument("before", type=Path, nargs="?", help="an earlier report to compare with")
    args = parser.parse_args()
    after = seconds_by_group(json.loads(args.report.read_text(encoding="utf-8")))
    before = (
        seconds_by_group(json.loads(args.before.read_text(encoding="utf-8")))
        if args.before
        else None
    )
    groups = sorted(set(after) | set(before or {}), key=lambda g: -after.get(g, 0.0))
    total = sum(after.values())
    rows = []
    for group in [*groups, ("all", "")]:
        now = total if group == ("all", "") else after.get(group, 0.0)
        row: list[Any] = [group[0], group[1], f"{now:.1f}", f"{now / total:.0%}" if total else ""]
        if before is not None:
            then = sum(before.values()) if group == ("all", "") else before.get(group, 0.0)
            row += [f"{then:.1f}", f"{now / then:.2f}x" if then else ""]
        rows.append(row)
    headers = ["engine", "scenario", "seconds", "share"]
    if before is not None:
        headers += ["before s", "ratio"]
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()
