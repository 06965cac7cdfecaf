"""PNG plot of KV bytes against tokens fed, one line per check, next to the JSON report.

matplotlib is optional (``pip install "pytest-kvguard[plot]"``); it is imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_kvguard.errors import KvguardError
from pytest_kvguard.outcome import Outcome, Row


def require_matplotlib() -> None:
    """Fail before any check runs when a plot is asked for and matplotlib is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise KvguardError(
            "--kvguard-plot needs matplotlib, which is not installed",
            fix='pip install "pytest-kvguard[plot]"',
        )


def plot_path(json_path: Path, kind: str = "kv-bytes") -> Path:
    """``kvguard-report.json`` -> ``kvguard-report.kv-bytes.png`` (or ``.sink-sweep.png``)."""
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


def write_kv_plot(rows: Sequence[Row], path: Path) -> int:
    """Measured (solid) and predicted (dashed) KV MiB vs tokens, one panel per engine and model.

    Memory checks give every length; stream checks their samples (the cap and the end).
    Returns the number of lines drawn; no file is written when there is nothing to draw.
    """
    plt = _pyplot()

    panels: dict[str, list[Outcome]] = {}
    for row in rows:
        if not isinstance(row, Outcome) or row.scenario not in ("stream", "memory"):
            continue
        if len(row.detail.samples) > 1:
            panels.setdefault(f"{row.model} on {row.engine}", []).append(row)
    if not panels:
        return 0
    columns = min(2, len(panels))
    n_rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(
        n_rows, columns, figsize=(7 * columns, 4.5 * n_rows), squeeze=False, layout="constrained"
    )
    for spare in axes.flat[len(panels) :]:
        spare.set_visible(False)
    lines = 0
    for ax, (title, panel_rows) in zip(axes.flat, sorted(panels.items()), strict=False):
        for row in panel_rows:
            samples = row.detail.samples
            tokens = [s["tokens"] for s in samples]
            measured = [s["kv_bytes"] / 2**20 for s in samples]
            label = f"{row.policy} ({row.name})"
            (line,) = ax.plot(tokens, measured, marker="o", label=label)
            lines += 1
            if "predicted_bytes" in samples[0]:
                predicted = [s["predicted_bytes"] / 2**20 for s in samples]
                ax.plot(tokens, predicted, linestyle="--", color=line.get_color(), alpha=0.6)
        ax.set_title(title)
        ax.set_xlabel("tokens fed")
        ax.set_ylabel("KV MiB (solid: measured, dashed: predicted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    _save(fig, path)
    return lines


def write_sweep_plot(rows: Sequence[Row], path: Path) -> int:
    """Post-eviction perplexity against the number of sinks, a line per check and positions;
    the full cache's as a dotted line. Returns the lines drawn (0: nothing written)."""
    plt = _pyplot()

    sweeps = [r for r in rows if isinstance(r, Outcome) and r.scenario == "sweep"]
    if not sweeps:
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    lines = 0
    for row in sweeps:
        samples = row.detail.samples
        for mode in dict.fromkeys(s["positions"] for s in samples):
            points = sorted((s["sinks"], s["post_eviction_ppl"]) for s in samples
                            if s["positions"] == mode)  # fmt: skip
            label = f"{row.model}, {row.engine}, {mode}"
            (line,) = ax.plot(*zip(*points, strict=True), marker="o", label=label)
            lines += 1
        ax.axhline(row.detail.baseline_ppl, linestyle=":", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("sinks (same total cap)")
    ax.set_ylabel("post-eviction perplexity (dotted: full cache)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, path)
    return lines


def write_sink_heads_plot(rows: Sequence[Row], path: Path) -> int:
    """A layer x head heatmap of attention mass on the first tokens: one panel per attention
    check, and one per stream or sweep check that broke a budget, negative controls included
    (its engine's sink heads, which a policy that evicts the first tokens takes their sink
    from). Returns the panels drawn (0: no file)."""
    panels = []
    for row in rows:
        if not isinstance(row, Outcome):
            continue
        if row.scenario == "attention":
            panels.append((row, row.detail.head_sink_mass, f"sink token {row.detail.sink_token!r}"))
        elif row.explanation is not None:
            kept = row.explanation["sinks_kept"]
            panels.append(
                (row, row.explanation["head_sink_mass"], f"{row.verdict}: keeps {kept} sinks")
            )
    if not panels:
        return 0
    plt = _pyplot()
    columns = min(4, len(panels))
    n_rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(
        n_rows, columns, figsize=(3.6 * columns, 4.8 * n_rows), squeeze=False, layout="constrained"
    )
    for spare in axes.flat[len(panels) :]:
        spare.set_visible(False)
    image = None
    for ax, (row, mass, note) in zip(axes.flat, panels, strict=False):
        image = ax.imshow(mass, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto",
                          interpolation="nearest")  # fmt: skip
        ax.set_title(f"{row.name}\n{row.model} on {row.engine}\n{note}", fontsize="small")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    fig.colorbar(
        image, ax=axes, shrink=0.6, label="attention mass on the first `sinks` tokens (default 4)"
    )
    _save(fig, path)
    return len(panels)
