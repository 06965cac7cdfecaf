"""``kvguard-compare A.json B.json``: two JSON reports, figure by figure, for exact equality.

For proving that a change of kvguard itself moved nothing (same engines, same machine): every
check's verdict, token count, every figure in ``metrics`` and every sample (KV bytes and entries
at each length, the sweep's grid) must be equal, bit for bit. Reads schema 1 and 2 reports.
Wall-clock figures (``seconds``, ``tokens_per_second``) are never compared.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def figures(row: Mapping[str, Any]) -> dict[str, Any]:
    """A check's comparable figures, by a flat name, whichever schema wrote the row."""
    detail = row.get("detail") or {}
    out: dict[str, Any] = {"verdict": row["verdict"], "tokens": row.get("tokens")}
    out.update({f"metrics.{k}": v for k, v in (row.get("metrics") or {}).items()})
    for key in ("samples", "layer_sizes"):
        values = detail.get(key, row.get(key)) or []
        for i, value in enumerate(values):
            if isinstance(value, Mapping):
                out.update({f"{key}[{i}].{k}": v for k, v in value.items()})
            else:
                out[f"{key}[{i}]"] = list(value)
    return out


def differences(
    before: Mapping[str, Any], after: Mapping[str, Any], ignore: Sequence[str] = ()
) -> tuple[int, list[str]]:
    """(figures compared, one line per difference) between two reports."""
    old = {row["name"]: figures(row) for row in before["checks"]}
    new = {row["name"]: figures(row) for row in after["checks"]}
    lines = [f"{name}: only in the first report" for name in sorted(old.keys() - new.keys())]
    lines += [f"{name}: only in the second report" for name in sorted(new.keys() - old.keys())]
    compared = 0
    for name in sorted(old.keys() & new.keys()):
        a, b = old[name], new[name]
        for key in sorted(a.keys() | b.keys()):
            if any(key.endswith(f".{skip}") or key == skip for skip in ignore):
                continue
            compared += 1
            if key not in a or key not in b:
                lines.append(f"{name}: {key} only in the {'second' if key in b else 'first'}")
            elif a[key] != b[key] and not (_nan(a[key]) and _nan(b[key])):
                lines.append(f"{name}: {key} {a[key]!r} -> {b[key]!r}")
    return compared, lines


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvguard-compare", description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument(
        "--ignore", action="append", default=[], metavar="FIGURE",
        help="a figure not to compare, e.g. process_peak_rss_bytes (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        before, after = (
            json.loads(p.read_text(encoding="utf-8")) for p in (args.first, args.second)
        )
    except (OSError, json.JSONDecodeError) as exc:
        print(f"kvguard-compare: {exc}", file=sys.stderr)
        return 2
    compared, lines = differences(before, after, args.ignore)
    for line in lines:
        print(line)
    checks = len({r["name"] for r in before["checks"]} & {r["name"] for r in after["checks"]})
    verdict = "identical" if not lines else f"{len(lines)} difference(s)"
    print(f"kvguard-compare: {checks} checks, {compared} figures compared: {verdict}")
    return 1 if lines else 0
