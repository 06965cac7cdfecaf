"""The session's end: the table, the JSON report, the plots and the GitHub step summary.

Rows arrive on test reports, so this works on the xdist controller, which runs no check; it is
registered on the controller (or a plain session) only, so a run writes each output once. The
rows, the checks expected and the session-level failures are the ``KvguardSession``'s; this
module prints and writes them. A model preview that compared nothing fails the session through
``KvguardSession.fail`` (pytest's exit status), never through a failed-test count.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.gate.baseline import render_preview
from pytest_kvguard.gate.model_preview import FactsDiff
from pytest_kvguard.gate.outcome import CheckError, Outcome
from pytest_kvguard.gate.plot import write_plots
from pytest_kvguard.gate.report import build_report, machine, render_table, step_summary, write_json
from pytest_kvguard.plugin.session import KvguardSession
from pytest_kvguard.scenarios import SCENARIOS


def _same_path(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def _previewed_here(diff: FactsDiff, outcomes: list[Outcome]) -> bool:
    """Whether the run asked for this swap's comparison: always for the command line's or
    ini's; for a budgets file's standing swap, when a check on its model ran."""
    return not diff.from_budgets_file or any(
        _same_path(row.model_path, diff.model_path) for row in outcomes
    )


def uncompared_line(diff: FactsDiff) -> str:
    """Why a run whose model preview compared nothing fails."""
    return (
        f"kvguard: model preview compared nothing on {diff.candidate}: no selected check on "
        f"{diff.model} ran on it (fix: select checks on {diff.model} whose engines can load "
        "the candidate; a check that ran on the model alone says why in its row)"
    )


class KvguardReporter:
    """Hands every check's row to the session as reports arrive, then prints the table and
    writes files."""

    def __init__(self, config: pytest.Config, json_path: Path | None, plot: bool) -> None:
        self.config = config
        self.json_path = json_path
        self.plot = plot
        self.json_error: str | None = None
        self.plot_paths: list[Path] = []
        self.counted_diffs: list[FactsDiff] | None = None
        """The model preview's facts diffs with ``compared_checks``, once the checks ran."""

    @property
    def session(self) -> KvguardSession:
        return KvguardSession.of(self.config)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.session.add_rows(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The step summary and the JSON report, with the exit status as the kvguard session
        left it (``KvguardSession.finish`` ran first)."""
        if self.config.option.collectonly:
            return  # nothing ran: a report would read as a gate run with no check in it
        exitstatus = int(session.exitstatus)
        self._write_step_summary(exitstatus)
        if self.json_path is None:
            return
        kvguard = self.session
        budgets_file = kvguard.budgets_file
        baseline = kvguard.baseline
        rows = kvguard.all_rows()
        report = build_report(
            rows,
            budgets_file=str(budgets_file.path) if budgets_file else None,
            budgets_sha256=budgets_file.sha256 if budgets_file else None,
            missing_checks=kvguard.missing(),
            exitstatus=exitstatus,
            baseline=None
            if baseline is None
            else {"path": str(baseline.path), "differences": baseline.differences(machine())},
            model_preview=[diff.to_json() for diff in self.facts_diffs()] or None,
        )
        try:
            write_json(self.json_path, report)
            if self.plot:
                self.plot_paths = write_plots(rows, self.json_path)
        except OSError as exc:
            self.json_error = f"cannot write {exc.filename or self.json_path}: {exc.strerror}"
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Any:
        """After the last check: a model preview that compared nothing fails the session
        (``KvguardSession.fail``: pytest's exit status, set before any other sessionfinish
        hook reads it), when no test failed."""
        result = yield
        kvguard = self.session
        outcomes = [row for row in kvguard.all_rows() if isinstance(row, Outcome)]
        self.counted_diffs = diffs = [
            replace(diff, compared_checks=sum(
                1 for row in outcomes
                if row.against and _same_path(row.model_path, diff.candidate_path)
            ))
            for diff in kvguard.facts_diffs
        ]  # fmt: skip
        if not session.testsfailed:
            for diff in diffs:
                if not diff.compared_checks and _previewed_here(diff, outcomes):
                    kvguard.fail(uncompared_line(diff))
        return result

    def facts_diffs(self) -> list[FactsDiff]:
        """The model preview's facts diffs: counted, once the checks ran."""
        if self.counted_diffs is not None:
            return self.counted_diffs
        return self.session.facts_diffs

    def _write_step_summary(self, exitstatus: int) -> None:
        """On GitHub Actions ($GITHUB_STEP_SUMMARY set): the tables as Markdown, appended."""
        target = os.environ.get("GITHUB_STEP_SUMMARY")
        kvguard = self.session
        rows = kvguard.all_rows()
        if not target or not (rows or kvguard.expected):
            return
        text = step_summary(rows, exitstatus=exitstatus, missing=kvguard.missing(),
                            warning="; ".join(filter(None, [kvguard.baseline_warning(),
                                                            *kvguard.failures])) or None,
                            preview=render_preview(rows, fmt="github"))  # fmt: skip
        try:
            with open(target, "a", encoding="utf-8") as summary:
                summary.write(text)
        except OSError as exc:
            self.json_error = f"cannot append to $GITHUB_STEP_SUMMARY {target}: {exc.strerror}"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        kvguard = self.session
        rows = kvguard.all_rows()
        warning = kvguard.baseline_warning()
        if warning:
            terminalreporter.write_line(warning, yellow=True, bold=True)
        changes: dict[str, int] = {}
        for row in rows:
            for change in getattr(row, "baseline_changes", []):
                changes[change] = changes.get(change, 0) + 1
        if changes:
            others = [row.against for row in rows if isinstance(row, Outcome) and row.against]
            swapped = any(
                row.against.get("model", row.model) != row.model
                for row in rows
                if isinstance(row, Outcome) and row.against
            )
            terminalreporter.write_line(
                (
                    "kvguard: changed since the baseline: "
                    if not others
                    else "kvguard: changed since the model preview's other run: "
                    if swapped
                    else "kvguard: changed since the upgrade preview's other run: "
                )  # fmt: skip
                + "; ".join(f"{c} ({n} check{'s' * (n != 1)})" for c, n in changes.items()),
                yellow=True,
            )
        if rows:
            terminalreporter.write_sep("=", "kvguard")
            terminalreporter.write_line(render_table(rows))
            preview = render_preview(rows)
            if preview:
                terminalreporter.write_line(preview)
            ran = {row.scenario for row in rows if isinstance(row, Outcome)}
            for name, scenario in SCENARIOS.items():
                if name in ran and scenario.footnote:
                    terminalreporter.write_line(scenario.footnote)
        lost = [r.name for r in rows if isinstance(r, CheckError) and r.lost]
        if lost:
            terminalreporter.write_line(
                f"kvguard: {len(lost)} check(s) lost to an engine worker that died or hung (the "
                "worker was restarted for the others): " + ", ".join(lost),
                red=True,
            )
        for line in kvguard.failures:
            terminalreporter.write_line(line, red=True)
        missing = kvguard.missing()
        if missing:
            terminalreporter.write_line(
                f"kvguard: {len(missing)} check(s) collected but never ran: " + ", ".join(missing),
                red=True,
            )
        if self.json_error:
            terminalreporter.write_line(f"kvguard: ERROR {self.json_error}", red=True)
        elif self.json_path is not None and self.config.option.collectonly:
            terminalreporter.write_line("kvguard: --collect-only: no JSON report written")
        elif self.json_path is not None:
            terminalreporter.write_line(f"kvguard: JSON report written to {self.json_path}")
            for target in self.plot_paths:
                terminalreporter.write_line(f"kvguard: plot written to {target}")
            if self.plot and not self.plot_paths:
                terminalreporter.write_line("kvguard: no plot (no check drew a panel)")
