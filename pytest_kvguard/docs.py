"""Every scenario's parameters and budgets as Markdown, from the scenarios' own tables.

README.md carries this text between ``<!-- scenarios -->`` markers (a test keeps them equal);
``kvguard-scenarios`` prints it, so a user can see what their installed version takes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from pytest_kvguard.report import report_schema
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import PARAM_KINDS


def scenarios_markdown() -> str:
    """A section per scenario: what it does, its check keys, its parameters, its budgets."""
    parts = []
    for name, scenario in SCENARIOS.items():
        keys = "`engines` (two)" if scenario.engines == 2 else "`engine`"
        if scenario.takes_policy:
            keys += ", `policy`"
        if scenario.takes_baseline:
            keys += ", `baseline` (default `full`)"
        lines = [
            f"### `{name}`",
            "",
            f"{scenario.summary[0].upper()}{scenario.summary[1:]}. Check keys: {keys}.",
            "",
            "| param | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for p in scenario.params:
            default = "—" if p.default is None else f"`{p.default!r}`".replace("'", "")
            kind = PARAM_KINDS[p.kind] + (f" >= {p.minimum}" if p.minimum is not None else "")
            lines.append(f"| `{p.name}` | {kind} | {default} | {p.doc} |")
        lines += ["", "Budgets: " + ", ".join(f"`{b}`" for b in scenario.budgets) + "."]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``kvguard-scenarios``: the tables as Markdown; ``--schema``: the JSON report's schema."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--schema"]:
        sys.stdout.write(json.dumps(report_schema(), indent=2) + "\n")
    elif args:
        sys.stderr.write("usage: kvguard-scenarios [--schema]\n")
        return 2
    else:
        sys.stdout.write(scenarios_markdown())
    return 0
