"""What scenarios add to the report beyond their tables, shared by several of them: plot
panels (KV bytes against tokens, sink-head heatmaps) and the sink-head explanation's section.

Drawing functions take a matplotlib ``Axes`` and never import matplotlib themselves: only
``plot.py`` does, and only when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_kvguard.scenarios.base import Panel

SHADES = " .:-=+*#%@"
"""Text heatmap levels, 0-10% .. 90-100% of a head's attention on the first tokens."""


def text_heatmap(head_mass: Sequence[Sequence[float]]) -> list[str]:
    """One line per layer, one character per head: the share of its attention on the first
    tokens, in tenths (``SHADES``)."""
    lines = [
        f"layer  heads 0..{len(head_mass[0]) - 1} (' ' <10% ... '@' >=90% on the first tokens)"
    ]
    for layer, masses in enumerate(head_mass):
        cells = "".join(SHADES[min(9, int(m * 10))] for m in masses)
        lines.append(f"{layer:>5}  |{cells}|")
    return lines


def kv_bytes_panels(outcome: Any) -> list[Panel]:
    """Measured (solid) and predicted (dashed) KV MiB against tokens fed: one line per check,
    one axes per model and engine; nothing for a check sampled at one length only."""
    samples = outcome.detail.samples
    if len(samples) <= 1:
        return []

    def draw(ax: Any) -> int:
        tokens = [s["tokens"] for s in samples]
        measured = [s["kv_bytes"] / 2**20 for s in samples]
        (line,) = ax.plot(tokens, measured, marker="o", label=f"{outcome.policy} ({outcome.name})")
        if "predicted_bytes" in samples[0]:
            predicted = [s["predicted_bytes"] / 2**20 for s in samples]
            ax.plot(tokens, predicted, linestyle="--", color=line.get_color(), alpha=0.6)
        ax.set_title(f"{outcome.model} on {outcome.engine}")
        ax.set_xlabel("tokens fed")
        ax.set_ylabel("KV MiB (solid: measured, dashed: predicted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        return 1

    return [Panel("kv-bytes", f"{outcome.model} on {outcome.engine}", draw)]


def sink_heads_panel(outcome: Any, head_mass: Sequence[Sequence[float]], note: str) -> Panel:
    """A layer x head heatmap of attention mass on the first tokens, one axes per check."""

    def draw(ax: Any) -> int:
        image = ax.imshow(head_mass, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto",
                          interpolation="nearest")  # fmt: skip
        ax.set_title(f"{outcome.name}\n{outcome.model} on {outcome.engine}\n{note}",
                     fontsize="small")  # fmt: skip
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.figure.colorbar(image, ax=ax, shrink=0.6, label="mass on the first `sinks` tokens")
        return 1

    return Panel("sink-heads", outcome.name, draw, columns=4, size=(3.6, 4.8))


_HEAD_ROWS = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}

SINK_EXPLANATION_SCHEMA: dict[str, Any] = {
    "description": "a window or sink policy that broke a budget, on an engine that exposes "
    "its attention: which heads park their attention on the first tokens, and how many of "
    "those the policy kept",
    "type": "object",
    "required": ["summary", "sinks_kept", "sink_heads", "head_sink_mass"],
    "additionalProperties": False,
    "properties": {
        "summary": {"type": "string"},
        "sinks_kept": {"type": "integer"},
        "sink_heads": {
            **_HEAD_ROWS,
            "description": "[layer, head, mass] of each head with at least 50% of its "
            "attention on the first 4 tokens",
        },
        "head_sink_mass": {
            **_HEAD_ROWS,
            "description": "per layer, per head: mean attention mass on the first 4 tokens",
        },
    },
}
"""The JSON schema of ``sink_explanation.explain_sinks``'s explanation."""


def explanation_panels(outcome: Any) -> list[Panel]:
    """The sink heads of a check that broke a budget (negative controls included), from its
    ``explanation``: the heads a policy that evicts the first tokens takes their sink from."""
    explanation = outcome.explanation
    if explanation is None:
        return []
    note = f"{outcome.verdict}: keeps {explanation['sinks_kept']} sinks"
    return [sink_heads_panel(outcome, explanation["head_sink_mass"], note)]


def explanation_sections(outcome: Any) -> list[tuple[str, str]]:
    """The explanation's summary and its heads as a text heatmap, for the test's report."""
    explanation = outcome.explanation
    if explanation is None:
        return []
    heatmap = "\n".join(text_heatmap(explanation["head_sink_mass"]))
    return [("kvguard sink heads", f"{explanation['summary']}\n{heatmap}")]
