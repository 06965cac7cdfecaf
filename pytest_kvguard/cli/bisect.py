"""Which engine release broke a check: a binary search over the releases on the package index.

    kvguard bisect BUDGETS --engine mlx --good "mlx-lm==0.28.0" --bad "mlx-lm==0.31.1" -k cap256

Each release tested gets its environment from ``kvguard env`` (cached) and one gate run, a
pytest subprocess with ``--kvguard-engine-python ENGINE=PYTHON`` and ``--kvguard-json``, whose
report says whether the picked checks pass there. Progress goes to stderr; the first bad
release, both neighbours' figures and the time go to stdout. The search itself is
``isolation.bisection``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pytest_kvguard.core.args import OneLineParser
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.units import format_change, format_figure
from pytest_kvguard.engines import engine_info
from pytest_kvguard.gate.budgets_file import load_budgets_file
from pytest_kvguard.gate.engine_pythons import Environments
from pytest_kvguard.isolation.bisection import (
    CRASH,
    UNUSABLE,
    Bisection,
    EndpointError,
    Trial,
    bisect_releases,
    estimate_lines,
    format_seconds,
    parse_index_versions,
    parse_version,
    read_report,
    releases_between,
)
from pytest_kvguard.isolation.environments import (
    MARKER,
    create_environment,
    default_root,
    environment_dir,
    environment_requirements,
)
from pytest_kvguard.isolation.workers import package_path
from pytest_kvguard.scenarios import SCENARIOS

PROGRESS = "[bisect]"


def main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-bisect") -> int:
    parser = OneLineParser(
        prog=prog,
        description="Find the first engine release that fails the picked checks of a budgets "
        "file: list the releases between a good and a bad one on the package index, then test "
        "them by halves, each in its own kvguard env environment (cached). Progress goes to "
        "stderr, the result to stdout. Exit status: 0 found, 1 stopped at --max-builds with "
        "the range narrowed so far, 2 bad input or an end that is not what was said.",
    )
    parser.add_argument("budgets", type=Path, help="the budgets file whose checks decide")
    parser.add_argument("--engine", required=True, help="the engine to bisect: llama_cpp or mlx")
    parser.add_argument(
        "--good", required=True, metavar="REQUIREMENT",
        help='a release that passes, e.g. "mlx-lm==0.28.0" or 0.28.0',
    )  # fmt: skip
    parser.add_argument(
        "--bad", required=True, metavar="REQUIREMENT",
        help='a later release that fails, e.g. "mlx-lm==0.31.1" or 0.31.1',
    )  # fmt: skip
    parser.add_argument(
        "-k", dest="expression", metavar="EXPR",
        help="pick checks by name as pytest -k does (default: every check in the file)",
    )  # fmt: skip
    parser.add_argument(
        "--versions", metavar="V1,V2,...",
        help="the releases to search, comma-separated, instead of asking the package index "
        "(the two ends are added where missing)",
    )  # fmt: skip
    parser.add_argument(
        "--pre", action="store_true", help="search pre-releases and dev releases too"
    )
    parser.add_argument(
        "--crash-is-bad", action="store_true",
        help="a gate run that dies without a report counts as bad (default: skipped, like an "
        "environment that does not install)",
    )  # fmt: skip
    parser.add_argument(
        "--max-builds", type=_count, metavar="N",
        help="make at most N new environments (cached ones are free); at the cap, stop and "
        "print the range narrowed so far (default: no cap)",
    )  # fmt: skip
    parser.add_argument(
        "--json", type=Path, metavar="PATH",
        help="write every tested release (outcome, checks, figures, seconds) and the result here",
    )  # fmt: skip
    parser.add_argument(
        "--dir", type=Path, default=None,
        help="where environments are cached (default: $KVGUARD_ENV_DIR, else "
        "~/.cache/pytest-kvguard/envs), as kvguard env",
    )  # fmt: skip
    args = parser.parse_args(argv)
    started = time.monotonic()
    root = args.dir or default_root()
    trials: list[Trial] = []
    try:
        distribution = _distribution(args.engine)
        good = _version_of(args.good, distribution, "--good")
        bad = _version_of(args.bad, distribution, "--bad")
        budgets = _budgets_path(args.budgets)
        listed = (args.versions.split(",") if args.versions is not None
                  else index_versions(distribution, pre=args.pre))  # fmt: skip
        releases = releases_between(listed, good, bad, pre=args.pre)
        picked = picked_checks(budgets, args.expression)
        require_engine(budgets, picked, args.engine)
        cached = [v for v in releases if is_cached(distribution, v, root)]
        _progress(f"{distribution} on {', '.join(picked)}")
        for line in estimate_lines(releases, cached, distribution):
            _progress(line)

        def test(version: str) -> Trial:
            return try_release(
                distribution, version, args.engine, budgets, args.expression, picked, root
            )

        def report(trial: Trial) -> None:
            trials.append(trial)
            _progress(
                f"{trial.version}: {_outcome_text(trial, args.crash_is_bad)} "
                f"({_shortened(trial.reason)}) "
                f"{format_seconds(trial.seconds)}" + (", environment built" if trial.built else "")
            )

        result = bisect_releases(
            releases, test, is_cached=lambda v: is_cached(distribution, v, root),
            max_builds=args.max_builds, crash_is_bad=args.crash_is_bad, on_trial=report,
        )  # fmt: skip
    except EndpointError as exc:
        _write_log(args, trials, None, time.monotonic() - started, error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KvguardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seconds = time.monotonic() - started
    print(render_result(result, distribution, seconds))
    _write_log(args, trials, result, seconds)
    return 1 if result.stopped else 0


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of environments (0 or more)"
        )
    return value


def _distribution(engine: str) -> str:
    """The engine's package on the index; an engine that is a program or a server has none."""
    info = engine_info(engine)  # an unknown engine is refused with the known ones
    if info.binary or info.remote:
        raise KvguardError(
            f"engine {engine} is {'a program' if info.binary else 'a server'}, not a Python "
            "package whose releases kvguard env can install",
            fix="bisect llama_cpp or mlx",
        )
    return info.distribution


def _version_of(requirement: str, distribution: str, flag: str) -> str:
    """``mlx-lm==0.28.0`` or ``0.28.0`` -> ``0.28.0``; another package's name is refused."""
    name, sep, version = requirement.partition("==")
    if not sep:
        name, version = distribution, requirement
    if _normal(name) != _normal(distribution):
        raise KvguardError(
            f"{flag} {requirement!r} names {name.strip()}, not {distribution}",
            fix=f'write {flag} "{distribution}==VERSION" or the version alone',
        )
    parse_version(version.strip(), flag)
    return version.strip()


def _normal(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def _budgets_path(path: Path) -> Path:
    if not path.is_file():
        raise KvguardError(f"{path}: no budgets file there", fix="pass an existing YAML file")
    return path.resolve()


def gate_environment() -> dict[str, str]:
    """The gate subprocess imports this very pytest_kvguard (a checkout's, not an installed
    copy's), as the engine workers do."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_path(), env.get("PYTHONPATH")) if p)
    return env


def _pytest(budgets: Path, expression: str | None, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "--kvguard", str(budgets),
            *(["-k", expression] if expression else []), "-p", "no:cacheprovider", "-q",
            *extra]  # fmt: skip


def picked_checks(budgets: Path, expression: str | None) -> list[str]:
    """The checks the budgets file and ``-k`` pick, from a collection in this environment
    (seconds, nothing run), so a bad file or an expression that picks nothing fails first."""
    done = subprocess.run(_pytest(budgets, expression, "--collect-only"), capture_output=True,
                          text=True, env=gate_environment())  # fmt: skip
    names = [line.partition("::")[2] for line in done.stdout.splitlines() if "::" in line]
    if done.returncode == 5 or (done.returncode == 0 and not names):
        raise KvguardError(
            f"-k {expression!r} picks no check in {budgets}"
            if expression
            else f"{budgets} declares no check",
            fix="pick checks by their names (pytest --kvguard FILE --collect-only -q lists them)",
        )
    if done.returncode != 0:
        # pytest's own one line names the file, the line and the fix.
        raise KvguardError(_last_line(done.stderr + done.stdout))
    return names


def require_engine(budgets: Path, picked: Sequence[str], engine: str) -> None:
    """Refuse checks none of which runs on the engine: every release would read good."""
    # The engine runs elsewhere, so this environment need not have it installed.
    elsewhere = Environments(python={engine: sys.executable})
    engines = {c.name: c.engines for c in load_budgets_file(budgets, elsewhere).checks}
    if not any(engine in engines.get(name, ()) for name in picked):
        others = sorted({e for name in picked for e in engines.get(name, ())})
        raise KvguardError(
            f"no picked check runs on engine {engine} (they run on {', '.join(others)})",
            fix=f"pick a check of {engine} with -k, or bisect --engine {others[0]}"
            if others
            else f"pick a check of {engine} with -k",
        )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1].removeprefix("ERROR: ") if lines else "no output"


def index_versions(distribution: str, *, pre: bool) -> list[str]:
    """The distribution's releases on pip's configured index (``pip index versions``)."""
    command = [sys.executable, "-m", "pip", "index", "versions", distribution,
               "--disable-pip-version-check", *(["--pre"] if pre else [])]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise KvguardError(
            f"pip index versions {distribution} failed: {_last_line(done.stderr)}",
            fix="check pip's index (pip config list), or give the releases with --versions",
        )
    return parse_index_versions(done.stdout)


def is_cached(distribution: str, version: str, root: Path) -> bool:
    """Whether kvguard env has this release's environment made already (its marker file)."""
    requirements = environment_requirements([f"{distribution}=={version}"])
    return (environment_dir(requirements, root) / MARKER).is_file()


def try_release(
    distribution: str,
    version: str,
    engine: str,
    budgets: Path,
    expression: str | None,
    picked: Sequence[str],
    root: Path,
) -> Trial:
    """Make (or reuse) the release's environment and run the gate there once."""
    started = time.monotonic()
    built = not is_cached(distribution, version, root)
    try:
        python = create_environment([f"{distribution}=={version}"], root)
    except KvguardError as exc:
        # The command that failed (first line) and what pip said last.
        said = [line.strip() for line in exc.message.splitlines() if line.strip()]
        reason = "environment not made: " + " ".join(dict.fromkeys([said[0], said[-1]]))
        return Trial(version, UNUSABLE, reason, seconds=time.monotonic() - started, built=built)
    with tempfile.TemporaryDirectory(prefix="kvguard-bisect-") as folder:
        path = Path(folder) / "report.json"
        done = subprocess.run(
            _pytest(budgets, expression, "--kvguard-engine-python", f"{engine}={python}",
                    "--kvguard-json", str(path)),
            capture_output=True, text=True, env=gate_environment(), stdin=subprocess.DEVNULL,
        )  # fmt: skip
        report: dict[str, Any] | None = None
        if path.is_file():
            report = json.loads(path.read_text(encoding="utf-8"))
    why = f"pytest exit {done.returncode}: {_last_line(done.stderr + done.stdout)}"
    outcome, reason, checks = read_report(report, picked, engine, version, why)
    return Trial(version, outcome, reason, checks, time.monotonic() - started, built)


def _outcome_text(trial: Trial, crash_is_bad: bool) -> str:
    if trial.outcome == CRASH:
        return "bad (crashed, --crash-is-bad)" if crash_is_bad else "skipped (crashed)"
    return "skipped (untestable)" if trial.outcome == UNUSABLE else trial.outcome


PROGRESS_REASON = 110
"""Characters of a release's reason on its progress line (the --json log has all of it)."""


def _shortened(reason: str) -> str:
    return reason if len(reason) <= PROGRESS_REASON else reason[: PROGRESS_REASON - 3] + "..."


def _progress(line: str) -> None:
    print(f"{PROGRESS} {line}", file=sys.stderr, flush=True)


def render_result(result: Bisection, distribution: str, seconds: float) -> str:
    """The answer, the two neighbours' figures and verdicts per check, and the cost."""
    trials = {t.version: t for t in result.trials}
    good, bad = result.last_good, result.first_bad
    if result.stopped:
        head = (
            f"stopped ({result.stopped}): the first bad release is one of "
            f"{', '.join([*result.untested, bad])} (last good {good}, first known bad {bad})"
        )
    elif result.exact:
        head = f"first bad release: {distribution} {bad} (last good: {good})"
    else:
        reasons = "; ".join(f"{v}: {trials[v].reason}" for v in result.untested if v in trials)
        head = (f"first bad release: one of {distribution} {', '.join([*result.untested, bad])} "
                f"(last good: {good}; untestable: {reasons})")  # fmt: skip
    lines = [head, "", figures_table(trials.get(good), trials.get(bad)), ""]
    built = sum(t.built for t in result.trials)
    lines.append(
        f"{len(result.releases)} releases from {result.releases[0]} to {result.releases[-1]}; "
        f"{len(result.trials)} tested ({built} environment{'s' * (built != 1)} built, "
        f"{len(result.skipped)} skipped) in {format_seconds(seconds)}"
    )
    return "\n".join(lines)


def figures_table(good: Trial | None, bad: Trial | None) -> str:
    """Each picked check's verdicts in the two releases and the figures that differ."""
    if good is None or bad is None:
        return "(no figures: a neighbour was not tested)"
    before = {c.name: c for c in good.checks}
    rows = []
    for after in bad.checks:
        then = before.get(after.name)
        old = dict(then.metrics) if then else {}
        # The figures a baseline compares (a budget gates on), as the upgrade preview shows.
        compared = (
            SCENARIOS[after.scenario].comparable_metrics if after.scenario in SCENARIOS else ()
        )
        changed = [m for m in sorted(after.metrics)
                   if m in compared and m in old and old[m] != after.metrics[m]]  # fmt: skip
        verdict = f"{then.verdict if then else '-'} -> {after.verdict}"
        for i, metric in enumerate(changed or ["(no figure changed)"]):
            cells = ([metric, format_figure(old[metric]), format_figure(after.metrics[metric]),
                      format_change(old[metric], after.metrics[metric])]
                     if changed else [metric, "", "", ""])  # fmt: skip
            rows.append([after.name if i == 0 else "", *cells, verdict if i == 0 else ""])
    if not rows:
        return f"(no figures: {bad.version} {bad.reason})"
    headers = ["check", "figure", good.version, bad.version, "change", "verdict"]
    return tabulate(rows, headers=headers, disable_numparse=True)


def _write_log(
    args: argparse.Namespace,
    trials: Sequence[Trial],
    result: Bisection | None,
    seconds: float,
    error: str | None = None,
) -> None:
    if args.json is None:
        return
    log = {
        "budgets": str(args.budgets), "engine": args.engine, "expression": args.expression,
        "good": args.good, "bad": args.bad, "crash_is_bad": args.crash_is_bad,
        "max_builds": args.max_builds, "tested": [t.to_json() for t in trials],
        "result": result.to_json() if result else None, "error": error,
        "seconds": round(seconds, 1),
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(log, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
