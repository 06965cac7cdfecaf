"""The budgets file as a pytest file: one item per declared check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.gate.outcome import CheckError
from pytest_kvguard.isolation.workers import WorkerLost, failure_text
from pytest_kvguard.plugin.session import BUDGETS_KEY, record, record_error, run_gated
from pytest_kvguard.scenarios.base import Check


class BudgetsCollector(pytest.File):
    """Collects the checks of the session's budgets file."""

    def collect(self) -> Any:
        for check in self.config.stash[BUDGETS_KEY].checks:
            yield CheckItem.from_parent(self, name=check.name, check=check)


class CheckFailed(Exception):
    """A budget broken (or a negative control not caught); its text is the whole report."""


class CheckItem(pytest.Item):
    """One check from the budgets file."""

    def __init__(self, *, check: Check[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        if check.expect_violation:
            self.user_properties.append(("kvguard_expect", "violation"))

    def runtest(self) -> None:
        check = self.check
        try:
            outcome = run_gated(self.config, check)
        except KvguardError as exc:
            message = str(exc) if exc.path else f"{check.where}: {exc}"
            lost = isinstance(exc, WorkerLost)
            record_error(self, CheckError(check.name, message, check.scenario, lost=lost))
            raise KvguardError(failure_text(exc, message)) from None
        record(self, outcome)
        if outcome.verdict == "FAIL":
            raise CheckFailed(f"{'; '.join(outcome.violations)} [{check.where}]")
        if outcome.verdict == "MISSED":
            raise CheckFailed(
                f"negative control not caught: {outcome.policy} stayed within "
                f"{outcome.budget_text} ({check.reason}) [{check.where}]"
            )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, (CheckFailed, KvguardError)):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int, str]:
        line = int(self.check.where.rpartition(":")[2] or 1)
        return self.path, line - 1, f"kvguard check {self.check.name}"
