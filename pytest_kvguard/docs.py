"""Every scenario's parameters and budgets as Markdown, from the scenarios' own tables.

README.md carries this text between ``<!-- scenarios -->`` markers (a test keeps them equal);
``kvguard-scenarios`` prints it, so a user can see what their installed version takes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pytest_kvguard.budgets import Budgets
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
    assert set(Budgets.names()) == {b for s in SCENARIOS.values() for b in s.budgets}
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    sys.stdout.write(scenarios_markdown())
    return 0
