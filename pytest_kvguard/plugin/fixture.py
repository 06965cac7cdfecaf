"""The ``kvguard`` fixture: run any scenario from a hand-written test, judged by its marker.

``kvguard.stream(policy="sink", cap=256)`` (or ``kvguard.run("stream", ...)``) takes the check
keys ``engine``, ``engines``, ``model``, ``policy`` and ``baseline`` and the scenario's
parameters as keywords, and builds the check exactly as a budgets-file entry with the same keys
would be built (same parameter table, same defaults, same validation). ``FIXTURE_DEFAULTS``
plays the part of a budgets file's ``defaults:``. The session judges each run as it judges a
budgets-file check (``KvguardSession.judge``); the test's marker applies the verdicts once the
test body passed (the ``pytest_runtest_makereport`` hook).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.gate.checks import Written, build_check
from pytest_kvguard.gate.outcome import CheckError, Outcome
from pytest_kvguard.isolation.workers import WorkerLost, failure_text
from pytest_kvguard.plugin.session import KvguardSession
from pytest_kvguard.scenarios import SCENARIOS

FIXTURE_DEFAULTS = {"engine": "llama_cpp", "engines": ["llama_cpp", "mlx"], "model": "smollm2-135m"}
"""What a fixture call gets where it names no engine or model: the bundled default model on
llama.cpp (parity: llama.cpp against mlx)."""
CHECK_KEYWORDS = ("engine", "engines", "model", "policy", "baseline", "timeout")
"""Keywords that are check keys; every other keyword is a scenario parameter."""


class KvguardFixture:
    """Runs scenarios from a hand-written test; the test's kv_budget marker judges them.

    Every registered scenario is a method: ``kvguard.stream(...)``, ``kvguard.parity(...)``,
    ``kvguard.edit_replay(...)``, ``kvguard.memory(...)``, ``kvguard.sweep(...)``,
    ``kvguard.recall(...)``, ``kvguard.generate(...)``.
    """

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        marker = request.node.get_closest_marker("kv_budget")
        self.budgets = Budgets(**marker.kwargs) if marker else Budgets()

    def __getattr__(self, name: str) -> Callable[..., Outcome]:
        if name in SCENARIOS:
            return partial(self.run, name)
        raise AttributeError(
            f"kvguard has no scenario '{name}' (scenarios: {', '.join(SCENARIOS)})"
        )

    def run(self, scenario: str, **settings: Any) -> Outcome:
        """Run ``scenario`` for this test under its kv_budget marker, and record the figures."""
        node = self._request.node
        session = KvguardSession.of(node.config)
        given = {k: v for k, v in settings.items() if v is not None}  # None: not given
        entry = Written.plain(
            {
                "name": node.name,
                "scenario": scenario,
                **{k: v for k, v in given.items() if k in CHECK_KEYWORDS},
                "params": {k: v for k, v in given.items() if k not in CHECK_KEYWORDS},
            }
        )
        try:
            check = build_check(
                entry,
                Written.plain(FIXTURE_DEFAULTS),
                base_dir=node.path.parent,
                where=node.nodeid,
                marker_budgets=self.budgets,
                installed_elsewhere=frozenset(session.environments.python),
            )
        except KvguardError as exc:  # the test's own call is wrong: no check to report
            error = f"{node.nodeid}: {exc}"
        else:
            try:
                verdict = session.run(check)
            except KvguardError as exc:  # a lost worker too: a row that says so, and the cause
                lost = isinstance(exc, WorkerLost)
                text = f"{node.nodeid}: {exc}"
                session.record_error(node, CheckError(check.name, text, scenario, lost=lost))
                error = failure_text(exc, text)
            else:
                session.record(node, verdict)
                return verdict.outcome
        pytest.fail(error, pytrace=False)  # outside the except: no chained traceback
