"""``kvguard compare A.json B.json``: two JSON reports, figure by figure.

For proving that a change of kvguard itself moved nothing (same engines, same machine): every
check's verdict, token count, every figure in ``metrics`` and every sample (KV bytes and entries
at each length, the sweep's grid) must be equal, bit for bit, or with ``--tolerance PCT`` within
that relative change. The largest relative change is always printed. Reads schema 1 and 2
reports. Wall-clock figures (``seconds``, ``tokens_per_second``) are never compared.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_kvguard.core.args import OneLineParser
from pytest_kvguard.core.errors import KvguardError


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


def relative_change(a: Any, b: Any) -> float | None:
    """|b - a| / |a| for two finite numbers (0 where they are equal, NaN twice included);
    None for anything else, which is then compared for equality only."""
    numbers = (int, float)
    if not (isinstance(a, numbers) and isinstance(b, numbers)) or isinstance(a, bool):
        return None
    if a == b or (_nan(a) and _nan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return None  # a figure that became NaN or infinite is a difference at any tolerance
    return math.inf if a == 0 else abs(b - a) / abs(a)


def differences(
    before: Mapping[str, Any], after: Mapping[str, Any], ignore: Sequence[str] = (),
    tolerance: float = 0.0,
) -> tuple[int, list[str], tuple[float, str]]:  # fmt: skip
    """(figures compared, one line per difference beyond ``tolerance`` (relative), the largest
    relative change and where) between two reports."""
    old = {row["name"]: figures(row) for row in before["checks"]}
    new = {row["name"]: figures(row) for row in after["checks"]}
    lines = [f"{name}: only in the first report" for name in sorted(old.keys() - new.keys())]
    lines += [f"{name}: only in the second report" for name in sorted(new.keys() - old.keys())]
    compared = 0
    largest = (0.0, "")
    for name in sorted(old.keys() & new.keys()):
        a, b = old[name], new[name]
        for key in sorted(a.keys() | b.keys()):
            if any(key.endswith(f".{skip}") or key == skip for skip in ignore):
                continue
            compared += 1
            if key not in a or key not in b:
                lines.append(f"{name}: {key} only in the {'second' if key in b else 'first'}")
                continue
            change = relative_change(a[key], b[key])
            if change is not None and change > largest[0]:
                largest = (change, f"{name}: {key} {a[key]!r} -> {b[key]!r}")
            same = change == 0.0 if change is not None else a[key] == b[key]
            if not same and (change is None or change > tolerance):
                lines.append(f"{name}: {key} {a[key]!r} -> {b[key]!r}")
    return compared, lines, largest


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def percent(text: str) -> float:
    """A tolerance in percent: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number: write e.g. 0.1")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0: write a percentage >= 0")
    return value


def load_report(path: Path) -> dict[str, Any]:
    """A JSON report as ``--kvguard-json`` writes it: an object whose ``checks`` each have a
    ``name`` and a ``verdict``; anything else is a KvguardError naming the file."""
    fix = "give two reports that pytest --kvguard-json wrote"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KvguardError(f"cannot read it: {exc.strerror or exc}", path=path, fix=fix) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KvguardError(f"not JSON: {exc}", path=path, fix=fix) from None
    if not isinstance(report, dict):
        raise KvguardError(
            f"a JSON {type(report).__name__}, not a kvguard report (an object with 'checks')",
            path=path, fix=fix,
        )  # fmt: skip
    if not isinstance(report.get("checks"), list):
        lacks = "has no 'checks' list" if "checks" not in report else "'checks' is not a list"
        raise KvguardError(f"{lacks}: not a kvguard JSON report", path=path, fix=fix)
    for i, row in enumerate(report["checks"]):
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("name"), str)
            or "verdict" not in row
        ):
            raise KvguardError(
                f"checks[{i}] is not a check (an object with 'name' and 'verdict')",
                path=path, fix=fix,
            )  # fmt: skip
        for key in ("metrics", "detail"):
            if not isinstance(row.get(key) or {}, dict):
                raise KvguardError(
                    f"checks[{i}] ({row['name']}): '{key}' is not an object", path=path, fix=fix
                )
    return report


def main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-compare") -> int:
    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path, help="a JSON report (--kvguard-json): the earlier run")
    parser.add_argument("second", type=Path, help="the report to compare with it: the later run")
    parser.add_argument(
        "--ignore", action="append", default=[], metavar="FIGURE",
        help="a figure not to compare, e.g. process_peak_rss_bytes (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--tolerance", type=percent, default=0.0, metavar="PCT",
        help="relative change, in percent, up to which numbers count as equal (default 0)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        before, after = (load_report(p) for p in (args.first, args.second))
        compared, lines, (change, where) = differences(
            before, after, args.ignore, args.tolerance / 100.0
        )
    except KvguardError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except (TypeError, ValueError, AttributeError) as exc:  # a figure shaped like no report's
        print(f"{prog}: {args.first}, {args.second}: a check's figures are not a kvguard "
              f"report's ({type(exc).__name__}: {exc})", file=sys.stderr)  # fmt: skip
        return 2
    for line in lines:
        print(line)
    checks = len({r["name"] for r in before["checks"]} & {r["name"] for r in after["checks"]})
    within = f" beyond {args.tolerance:g}%" if args.tolerance else ""
    verdict = "identical" if not lines else f"{len(lines)} difference(s){within}"
    if change:
        print(f"{prog}: largest relative change {change * 100:.4g}%: {where}")
    print(f"{prog}: {checks} checks, {compared} figures compared: {verdict}")
    return 1 if lines else 0
