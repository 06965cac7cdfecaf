"""Which engine release broke a check: the releases between a good and a bad one, a binary
search over them that steps around releases it cannot test (as ``git bisect skip`` does), and
how one gate run's JSON report reads as good or bad.

Plain logic, no pytest and no subprocess: ``kvguard bisect`` (``cli/bisect.py``) lists the
releases with pip, makes each environment with ``kvguard env`` and runs the gate; the tests
drive ``bisect_releases`` with a function from version to outcome.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version

from pytest_kvguard.core.errors import KvguardError

GOOD, BAD, CRASH, UNUSABLE = "good", "bad", "crash", "unusable"
"""A release's outcome: every picked check passed (or caught what it expects); one did not;
the gate run died and wrote no report; or it could not be tested (its environment did not
install, or a picked check did not run)."""
PASSING = ("PASS", "CAUGHT")
"""Check verdicts that make a release good."""
BUILD_SECONDS = {"mlx-lm": 30.0, "llama-cpp-python": 540.0}
"""One new environment, measured on x86-64 with 2 cores: mlx-lm installs wheels (27 s, pip's
cache warm); llama-cpp-python compiles llama.cpp (about 9 minutes)."""
DEFAULT_BUILD_SECONDS = 60.0


def parse_index_versions(text: str) -> list[str]:
    """The versions ``pip index versions DIST`` prints on its ``Available versions:`` line, in
    the order printed."""
    for line in text.splitlines():
        label, sep, listed = line.partition(":")
        if sep and label.strip() == "Available versions":
            return [v.strip() for v in listed.split(",") if v.strip()]
    raise KvguardError(
        "pip index versions printed no 'Available versions:' line",
        fix="check pip's index (pip config list), or give the releases with --versions",
    )


def parse_version(text: str, written_as: str) -> Version:
    """A PEP 440 version, or a one-line error naming where it was written."""
    try:
        return Version(text)
    except InvalidVersion:
        raise KvguardError(
            f"{written_as}: {text!r} is not a version", fix="write a release such as 0.28.0"
        ) from None


def releases_between(
    versions: Iterable[str], good: str, bad: str, *, pre: bool = False
) -> list[str]:
    """The good release, every release strictly between, and the bad one, oldest first.

    Pre-releases and dev releases in between are left out unless ``pre``; a version the index
    lists that is no PEP 440 version is ignored. The two ends are kept as given, listed or not
    (a release that is not on the index fails to install and is reported then).
    """
    low, high = parse_version(good, "--good"), parse_version(bad, "--bad")
    if low >= high:
        raise KvguardError(
            f"--good {good} is not older than --bad {bad}",
            fix="give the release that passes as --good and a later one that fails as --bad",
        )
    between: dict[Version, str] = {}
    for text in versions:
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        # is_prerelease covers dev releases too; a post release is a final one.
        if low < version < high and (pre or not version.is_prerelease):
            between.setdefault(version, text)
    return [good, *(between[v] for v in sorted(between)), bad]


def steps_needed(releases: int) -> int:
    """Releases tested after the two ends to find the first bad one among ``releases``
    (ends included), when none has to be skipped."""
    return math.ceil(math.log2(releases - 1)) if releases > 2 else 0


@dataclass(frozen=True)
class CheckResult:
    """One picked check's verdict and figures in one release's gate run."""

    name: str
    scenario: str
    verdict: str
    engine_version: str
    message: str
    """Its first violation, or its error; empty for a check that passed."""
    metrics: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "scenario": self.scenario, "verdict": self.verdict,
                "engine_version": self.engine_version, "message": self.message,
                "metrics": dict(self.metrics)}  # fmt: skip


@dataclass(frozen=True)
class Trial:
    """One release tested: its outcome (``GOOD``, ``BAD``, ``CRASH``, ``UNUSABLE``), why,
    its checks, and what it cost."""

    version: str
    outcome: str
    reason: str
    """One line: the first failing check and its message, or why it could not be tested."""
    checks: tuple[CheckResult, ...] = ()
    seconds: float = 0.0
    built: bool = False
    """A new environment was made for it (the --max-builds count)."""

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "outcome": self.outcome, "reason": self.reason,
                "seconds": round(self.seconds, 1), "built": self.built,
                "checks": [c.to_json() for c in self.checks]}  # fmt: skip


def read_report(
    report: Mapping[str, Any] | None, picked: Sequence[str], engine: str, version: str, why: str
) -> tuple[str, str, tuple[CheckResult, ...]]:
    """A gate run's outcome from its JSON report (``--kvguard-json``): BAD where a picked check
    failed, missed or errored; UNUSABLE where one did not run or ran another engine version;
    CRASH where there is no report (``why``: what the run said last); else GOOD."""
    if report is None:
        return CRASH, f"the gate run wrote no report ({why})", ()
    rows = {row["name"]: row for row in report.get("checks", [])}
    checks = tuple(
        CheckResult(
            name, str(row.get("scenario") or ""), row["verdict"],
            str(row.get("engine_version", "")),
            row.get("error") or next(iter(row.get("violations") or []), ""),
            {k: v for k, v in (row.get("metrics") or {}).items() if isinstance(v, (int, float))},
        )
        for name, row in rows.items() if name in picked
    )  # fmt: skip
    not_run = [n for n in picked if n not in rows or n in report.get("missing_checks", [])]
    if not_run:
        return UNUSABLE, f"did not run: {', '.join(not_run)}", checks
    other = [c for c in checks if rows[c.name].get("engine") == engine
             and c.engine_version not in ("", version)]  # fmt: skip
    if other:
        ran = f"{other[0].name} ran {engine} {other[0].engine_version}, not {version}"
        return UNUSABLE, ran, checks
    failing = [c for c in checks if c.verdict not in PASSING]
    if failing:
        first = failing[0]
        more = f" (and {len(failing) - 1} more)" if len(failing) > 1 else ""
        return BAD, f"{first.name} {first.verdict}: {first.message}{more}", checks
    return GOOD, ", ".join(f"{c.name} {c.verdict}" for c in checks), checks


@dataclass(frozen=True)
class Bisection:
    """Where the search ended. ``first_bad`` is the oldest release known bad; ``untested``
    the releases between ``last_good`` and it that were skipped or (``stopped``) not reached:
    the first bad release is one of them or ``first_bad``."""

    releases: tuple[str, ...]
    last_good: str
    first_bad: str
    untested: tuple[str, ...]
    skipped: tuple[str, ...]
    """Releases that could not be tested, anywhere in the range."""
    trials: tuple[Trial, ...]
    stopped: str | None = None
    """Why the search stopped before the end (the build cap), or None."""

    @property
    def exact(self) -> bool:
        """The first bad release is known, not one of several."""
        return not self.untested

    def to_json(self) -> dict[str, Any]:
        return {"releases": list(self.releases), "last_good": self.last_good,
                "first_bad": self.first_bad, "exact": self.exact,
                "untested": list(self.untested), "skipped": list(self.skipped),
                "stopped": self.stopped}  # fmt: skip


class EndpointError(KvguardError):
    """The good end is not good, or the bad end not bad: nothing to search."""


def bisect_releases(
    releases: Sequence[str],
    test: Callable[[str], Trial],
    *,
    is_cached: Callable[[str], bool] = lambda version: True,
    max_builds: int | None = None,
    crash_is_bad: bool = False,
    on_trial: Callable[[Trial], None] = lambda trial: None,
) -> Bisection:
    """Test both ends, then halve the releases between the last good and the first bad one
    until they are adjacent. A release that cannot be tested is skipped and its neighbours
    tried instead; a crash counts as bad with ``crash_is_bad``, else it is skipped too.
    ``max_builds`` caps the releases tested whose environment ``is_cached`` says is not made
    yet; at the cap only cached releases are tried, then the search stops with the range
    narrowed so far."""
    trials: list[Trial] = []
    outcomes: dict[int, str] = {}
    builds = 0

    def judged(outcome: str) -> str:
        if outcome == CRASH:
            return BAD if crash_is_bad else UNUSABLE
        return outcome

    def run(index: int) -> str | None:
        """The release's judged outcome, or None where the build cap forbids testing it."""
        nonlocal builds
        version = releases[index]
        if not is_cached(version):
            if max_builds is not None and builds >= max_builds:
                return None
            builds += 1
        trial = test(version)
        trials.append(trial)
        on_trial(trial)
        outcomes[index] = judged(trial.outcome)
        return outcomes[index]

    def ended(low: int, high: int, stopped: str | None = None) -> Bisection:
        return Bisection(
            tuple(releases), releases[low], releases[high], tuple(releases[low + 1 : high]),
            tuple(releases[i] for i, o in sorted(outcomes.items()) if o == UNUSABLE),
            tuple(trials), stopped,
        )  # fmt: skip

    low, high = 0, len(releases) - 1
    cap = f"--max-builds {max_builds} reached"
    for index, wanted, flag in ((low, GOOD, "--good"), (high, BAD, "--bad")):
        outcome = run(index)
        if outcome is None:
            return ended(low, high, cap)
        if outcome != wanted:
            raise EndpointError(
                f"{flag} {releases[index]} is {_said(outcome)}, not {wanted}: {trials[-1].reason}",
                fix=_endpoint_fix(flag, outcome),
            )
    while True:
        candidates = [i for i in range(low + 1, high) if i not in outcomes]
        if not candidates:
            return ended(low, high)
        middle = (low + high) / 2
        cached = {i: is_cached(releases[i]) for i in candidates}
        if max_builds is not None and builds >= max_builds:
            # No build left, but a cached release still narrows the range for free.
            candidates = [i for i in candidates if cached[i]] or candidates
        candidates.sort(key=lambda i: (abs(i - middle), not cached[i], i))
        outcome = run(candidates[0])
        if outcome is None:
            return ended(low, high, cap)
        if outcome == GOOD:
            low = candidates[0]
        elif outcome == BAD:
            high = candidates[0]


def _said(outcome: str) -> str:
    return {UNUSABLE: "untestable", BAD: "bad", GOOD: "good"}[outcome]


def _endpoint_fix(flag: str, outcome: str) -> str:
    if outcome == UNUSABLE:
        return f"give a {flag} release whose environment installs and runs the picked checks"
    if flag == "--good":
        return "give an older --good release that passes the picked checks"
    return "give a later --bad release, or pick (-k) the check that fails on it"


def estimate_lines(releases: Sequence[str], cached: Sequence[str], distribution: str) -> list[str]:
    """What the search will cost, before it starts: releases, steps, environments cached and
    to build, and the building time (the gate's own time per release comes on top)."""
    steps = steps_needed(len(releases))
    uncached_ends = sum(v not in cached for v in (releases[0], releases[-1]))
    between_uncached = sum(v not in cached for v in releases[1:-1])
    to_build = uncached_ends + min(steps, between_uncached)
    per_build = BUILD_SECONDS.get(distribution, DEFAULT_BUILD_SECONDS)
    return [
        f"{len(releases)} releases from {releases[0]} to {releases[-1]} "
        f"({len(releases) - 2} between); the two ends, then about {steps} "
        f"step{'s' * (steps != 1)} (ceil(log2({len(releases) - 1})))",
        f"environments: {len(cached)} of {len(releases)} cached, up to {to_build} to build "
        f"(about {format_seconds(per_build)} each for {distribution}): "
        f"about {format_seconds(to_build * per_build)} building, plus one gate run per release "
        "tested",
    ]


def format_seconds(seconds: float) -> str:
    """``41.2 s``, ``3 min 12 s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"
