"""PNG plots next to the JSON report, drawn from the panels each check's scenario gives.

matplotlib is optional (``pip install "pytest-kvguard[plot]"``); it is imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.gate.outcome import Outcome, Row
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import Panel


def require_matplotlib() -> None:
    """Fail before any check runs when a plot is asked for and matplotlib is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise KvguardError(
            "--kvguard-plot needs matplotlib, which is not installed",
            fix='pip install "pytest-kvguard[plot]"',
        )


def plot_path(json_path: Path, kind: str = "kv-bytes") -> Path:
    """``kvguard-report.json`` -> ``kvguard-report.kv-bytes.png`` (``kind``: the plot's name)."""
    return json_path.with_name(f"{json_path.stem}.{kind}.png")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(rows: Sequence[Row], json_path: Path) -> list[Path]:
    """Every plot the checks' scenarios draw (``Scenario.panels``), one PNG per plot name
    beside the JSON report; panels of one group share axes. Returns the files written (a plot
    nothing was drawn in is not written)."""
    files: dict[str, dict[str, list[Panel]]] = {}
    for row in rows:
        if isinstance(row, Outcome):
            for panel in SCENARIOS[row.scenario].panels(row):
                files.setdefault(panel.file, {}).setdefault(panel.group, []).append(panel)
    written = []
    for name, groups in files.items():
        if _write_plot(list(groups.values()), plot_path(json_path, name)):
            written.append(plot_path(json_path, name))
    return written


def _write_plot(groups: list[list[Panel]], path: Path) -> int:
    """One axes per group on a grid the first panel sets; returns what was drawn."""
    plt = _pyplot()
    first = groups[0][0]
    columns = min(first.columns, len(groups))
    n_rows = -(-len(groups) // columns)
    width, height = first.size
    fig, axes = plt.subplots(n_rows, columns, figsize=(width * columns, height * n_rows),
                             squeeze=False, layout="constrained")  # fmt: skip
    for spare in axes.flat[len(groups) :]:
        spare.set_visible(False)
    drawn = sum(panel.draw(ax) for ax, group in zip(axes.flat, groups, strict=False)
                for panel in group)  # fmt: skip
    if not drawn:
        plt.close(fig)
        return 0
    _save(fig, path)
    return drawn
