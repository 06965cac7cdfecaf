"""The end-of-run table and the JSON report. Rows are plain dicts (they travel on reports)."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pytest_kvguard import __version__
from pytest_kvguard.budgets import format_size

REPORT_SCHEMA = 1
TABLE_HEADERS = [
    "check", "engine", "model", "policy", "tokens", "baseline", "base ppl", "ppl",
    "delta", "budget", "verdict",
]  # fmt: skip


def error_row(name: str, message: str) -> dict[str, Any]:
    """A check that could not produce figures still gets a row, so nothing looks like a pass."""
    return {"name": name, "verdict": "ERROR", "error": message}


REPLAY_HEADERS = [
    "check", "engine", "model", "policy", "follow-up", "prompt", "split", "reused",
    "re-prefilled", "memory", "replay s", "budget", "verdict",
]  # fmt: skip


def replay_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for row in rows:
        m = row["metrics"]
        out.append(
            [
                row["name"],
                f"{row['engine']} {row['engine_version']}",
                row["model"],
                row["policy"],
                row["baseline"],
                str(row["tokens"]),
                f"{m['split']:.0f}",
                f"{m['reused_tokens']:.0f}",
                f"{m['reprefill_tokens']:.0f}",
                f"{m['memory_bytes'] / 2**20:.1f} MiB",
                f"{row['seconds']['replay']:.1f}",
                row["budget_text"],
                row["verdict"],
            ]
        )
    return out


MEMORY_HEADERS = [
    "check", "engine", "model", "policy", "tokens", "held", "predicted", "measured",
    "deviation", "peak", "budget", "verdict",
]  # fmt: skip


def memory_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One line per measured length; the check's name, budget and verdict on its first line."""
    out = []
    for row in rows:
        for i, sample in enumerate(row["samples"]):
            first = i == 0
            deviation = f"{sample['deviation_pct']:+.2f}%"
            if sample["not_applied"]:
                deviation += " NOT APPLIED"
            out.append(
                [
                    row["name"] if first else "",
                    f"{row['engine']} {row['engine_version']}" if first else "",
                    row["model"] if first else "",
                    row["policy"] if first else "",
                    str(sample["tokens"]),
                    str(sample["held"]),
                    format_size(sample["predicted_bytes"]),
                    format_size(sample["kv_bytes"]),
                    deviation,
                    format_size(sample["peak_memory_bytes"]),
                    row["budget_text"] if first else "",
                    row["verdict"] if first else "",
                ]
            )
    return out


def sweep_table(rows: Sequence[dict[str, Any]], fmt: str) -> str:
    """One line per sweep check and position handling: post-eviction ppl (delta) per sink count."""
    counts = sorted({sample["sinks"] for row in rows for sample in row["samples"]})
    headers = ["check", "engine", "model", "positions", "full", *(f"S={c}" for c in counts)]
    headers += ["budget", "verdict"]
    lines = []
    for row in rows:
        modes = list(dict.fromkeys(sample["positions"] for sample in row["samples"]))
        for i, mode in enumerate(modes):
            by_count = {s["sinks"]: s for s in row["samples"] if s["positions"] == mode}
            cells = [
                f"{by_count[c]['post_eviction_ppl']:.2f} ({by_count[c]['ppl_increase_pct']:+.1f}%)"
                if c in by_count
                else ""
                for c in counts
            ]
            first = i == 0
            lines.append(
                [
                    row["name"] if first else "",
                    f"{row['engine']} {row['engine_version']}" if first else "",
                    row["model"] if first else "",
                    mode,
                    f"{row['base_ppl']:.2f}" if first else "",
                    *cells,
                    row["budget_text"] if first else "",
                    row["verdict"] if first else "",
                ]
            )
    return tabulate(lines, headers=headers, tablefmt=fmt, disable_numparse=True)


RECALL_HEADERS = [
    "check", "engine", "model", "policy", "prompt", "fact evicted", "recalled", "full cache",
    "budget", "verdict",
]  # fmt: skip


def recall_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for row in rows:
        m = row["metrics"]
        hits = f"{m['answer_hits']:.0f}/{m['answer_tokens']:.0f}"
        out.append(
            [
                row["name"],
                f"{row['engine']} {row['engine_version']}",
                row["model"],
                row["policy"],
                str(row["tokens"]),
                "yes" if m["fact_evicted"] else "no",
                f"{'yes' if m['recalled'] else 'no'} ({hits}, nll {m['answer_nll']:.2f})",
                f"{'yes' if m['baseline_recalled'] else 'no'} (nll {m['baseline_answer_nll']:.2f})",
                row["budget_text"],
                row["verdict"],
            ]
        )
    return out


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for row in rows:
        if row["verdict"] == "ERROR":
            out.append([row["name"]] + ["-"] * 9 + ["ERROR"])
            continue
        out.append(
            [
                row["name"],
                f"{row['engine']} {row['engine_version']}",
                row["model"],
                row["policy"],
                str(row["tokens"]),
                row["baseline"],
                f"{row['base_ppl']:.2f}",
                f"{row['ppl']:.2f}",
                f"{row['delta_pct']:+.1f}%",
                row["budget_text"],
                row["verdict"],
            ]
        )
    return out


def render_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """Quality checks (stream, parity) in one table; sweeps, edit-replay and memory in their own."""
    ran = [r for r in rows if r["verdict"] != "ERROR"]
    replays = [r for r in ran if r.get("scenario") == "edit_replay"]
    memory = [r for r in ran if r.get("scenario") == "memory"]
    sweeps = [r for r in ran if r.get("scenario") == "sweep"]
    recalls = [r for r in ran if r.get("scenario") == "recall"]
    own_tables = [*replays, *memory, *sweeps, *recalls]
    quality = [r for r in rows if r not in own_tables]

    def plain(to_rows: Any, headers: list[str]) -> Any:
        return lambda group: tabulate(
            to_rows(group), headers=headers, tablefmt=fmt, disable_numparse=True
        )

    tables = [
        (quality, plain(table_rows, TABLE_HEADERS)),
        (sweeps, lambda group: sweep_table(group, fmt)),  # columns: the sink counts swept
        (replays, plain(replay_rows, REPLAY_HEADERS)),
        (recalls, plain(recall_rows, RECALL_HEADERS)),
        (memory, plain(memory_rows, MEMORY_HEADERS)),
    ]
    parts = [render(group) for group, render in tables if group]
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


def build_report(
    rows: Sequence[dict[str, Any]],
    *,
    budgets_file: str | None,
    budgets_sha256: str | None,
    missing_checks: Sequence[str],
    exitstatus: int,
    baseline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON report. ``complete`` is false when a collected check left no figures."""
    complete = not missing_checks and all(r["verdict"] != "ERROR" for r in rows)
    return {
        "schema": REPORT_SCHEMA,
        "kvguard_version": __version__,
        "verdict": "pass" if passed(rows, exitstatus, missing_checks) else "fail",
        "complete": complete,
        "pytest_exitstatus": exitstatus,
        "missing_checks": list(missing_checks),
        "budgets_file": budgets_file,
        "budgets_sha256": budgets_sha256,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "baseline": baseline,
        "checks": list(rows),
    }


def passed(rows: Sequence[dict[str, Any]], exitstatus: int, missing: Sequence[str]) -> bool:
    """A run passes only when complete, pytest passed, and every check passed or caught."""
    return not missing and exitstatus == 0 and all(r["verdict"] in ("PASS", "CAUGHT") for r in rows)


def step_summary(
    rows: Sequence[dict[str, Any]],
    *,
    exitstatus: int,
    missing: Sequence[str],
    warning: str | None = None,
) -> str:
    """Markdown for $GITHUB_STEP_SUMMARY: the verdict, the tables, and what went wrong."""
    verdict = "pass" if passed(rows, exitstatus, missing) else "FAIL"
    lines = [f"## kvguard: {verdict}", ""]
    if warning:
        lines += [f"> **{warning}**", ""]
    lines += [render_table(rows, fmt="github"), ""]
    problems = [
        f"- **{r['name']}** ({r['verdict']}): "
        + ("; ".join(r.get("violations") or []) or r.get("error", "") or "no violation")
        for r in rows
        if r["verdict"] in ("FAIL", "MISSED", "ERROR")
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
