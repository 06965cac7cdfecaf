"""The budgets file as a pytest file: one item per declared check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.gate.outcome import CheckError
from pytest_kvguard.isolation.workers import WorkerLost, failure_text
from pytest_kvguard.plugin.session import KvguardSession
from pytest_kvguard.scenarios.base import Check


class BudgetsCollector(pytest.File):
    """Collects the checks of the session's budgets file."""

    def collect(self) -> Any:
        budgets_file = KvguardSession.of(self.config).budgets_file
        for check in budgets_file.checks if budgets_file else []:
            yield CheckItem.from_parent(self, name=check.name, check=check)


class CheckFailed(Exception):
    """A budget broken (or a negative control not caught); its text is the whole report."""


class CheckItem(pytest.Item):
    """One check from the budgets file, judged by the session (``KvguardSession.judge``)."""

    def __init__(self, *, check: Check[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        if check.expect_violation:
            self.user_properties.append(("kvguard_expect", "violation"))

    def runtest(self) -> None:
        check = self.check
        session = KvguardSession.of(self.config)
        try:
            verdict = session.run(check)
        except KvguardError as exc:
            message = str(exc) if exc.path else f"{check.where}: {exc}"
            lost = isinstance(exc, WorkerLost)
            session.record_error(self, CheckError(check.name, message, check.scenario, lost=lost))
            raise KvguardError(failure_text(exc, message)) from None
        session.record(self, verdict)
        if verdict.failure is not None:
            raise CheckFailed(f"{verdict.failure} [{check.where}]")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, (CheckFailed, KvguardError)):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int, str]:
        line = int(self.check.where.rpartition(":")[2] or 1)
        return self.path, line - 1, f"kvguard check {self.check.name}"
