"""Injected engine faults, on the real engines and bundled models: the gate must catch each one.

Each fault breaks the engine the way an upgrade could; every bundled check it names must turn
red with a message that points at the cause. The checks run at the quick gate's sizes
(fixtures/quick.yaml has every check a fault names; test_tiers.py keeps it so); the clean run
(every check green) is .ci/run's quick gate. A fresh runner per fault, so no run from a clean
engine is reused; it is told of the fault's checks first, so their runs decode together.
"""

from __future__ import annotations

import re

import pytest
from gate_invariants import QUICK, checks_by_name

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import EngineOptions
from pytest_kvguard.gate.faults import FAULTS, inject
from pytest_kvguard.gate.runner import Runner, run_check

# The quick gate's checks the faults turn red run on both in-process engines (and parsing the
# quick gate needs both installed: it is parsed inside the tests, never at import).
pytestmark = [pytest.mark.llama_cpp, pytest.mark.mlx]

STALE_REUSE = r"^max_reuse_excess: [^;]*$"
"""The correctness budget is the check's only violation: every count budget passed."""

CAUSE = {
    "sinks_dropped": {"smollm2-mlx-sink4": r"max_ppl_increase_pct: .* measured \d+"},
    "positions_not_rebased": {
        "smollm2-sink4-reindexed": r"expected 0\.\.254: the survivors were not re-based",
        "smollm2-window-reindexed": r"expected 0\.\.254: the survivors were not re-based",
    },
    "cap_not_applied": {
        "smollm2-mlx-memory-sink4": r"cap or window not applied",
        "smollm2-mlx-sink4": r"max_kv_entries: .*measured [\d,]+ entries.*bounded: KV bytes",
    },
    "swa_full_ignored": {
        "gemma3-memory-swafull": r"max_kv_deviation_pct: .* measured -?\d+",
        "gemma3-swafull-edit-middle": r"could not keep the first \d+ .*swa_full was asked for",
        # The Llama asked for swa_full gets the small sliding cache, and keeps the stale prefix
        # with the same counts: only the reuse gap can tell.
        "gemma3-swafull-resend-api": STALE_REUSE,
    },
    "checkpoint_not_restored": {"gemma3-ckpt-edit-middle": r"restored 0 of \d+ checkpoint bytes"},
    # Stale reuse with the same counts: only the correctness budget may fail (the whole message
    # is that one violation), on kvguard's memory paths and on mlx-lm's own prompt cache. A
    # prefix kept without its window (window_not_checked): a stale reuse on llama.cpp's memory
    # path, caught where the reply follows the edit.
    "stale_trim": {
        "smollm2-mlx-full-edit-end": STALE_REUSE,
        "smollm2-mlx-full-edit-end-api": STALE_REUSE,
    },
    "window_not_checked": {"gemma3-swa-resend": STALE_REUSE},
    # Rejected drafts left in mlx-lm's full cache: the draft path's tokens leave plain greedy
    # decoding where no noise explains it, and every other budget of the check passes.
    "draft_trim_ignored": {"smollm2-mlx-speculative-full": r"^max_divergent_tokens: [^;]*$"},
    # These kill the engine: they run in workers only (test_engine_upgrades.py).
    "engine_crash": {
        "smollm2-sink4-reindexed": r"engine worker died: SIGILL",
        "smollm2-window-reindexed": r"engine worker died: SIGILL",
    },
    "engine_hang": {
        "smollm2-sink4-reindexed": r"engine worker timed out",
        "smollm2-window-reindexed": r"engine worker timed out",
    },
}
IN_PROCESS = sorted(name for name, f in FAULTS.items() if not f.kills_worker)


def test_every_fault_names_bundled_checks_and_an_expected_cause() -> None:
    quick_checks = checks_by_name(QUICK)
    assert set(CAUSE) == set(FAULTS)
    for name, f in FAULTS.items():
        assert set(f.caught_by) == set(CAUSE[name]) and set(f.caught_by) <= set(quick_checks)


@pytest.mark.parametrize("name", IN_PROCESS)
def test_fault_turns_its_checks_red_with_the_cause(name: str) -> None:
    quick_checks = checks_by_name(QUICK)  # parsed before any fault is injected
    runner = Runner(EngineOptions.from_env())
    try:
        with inject(name) as fault:
            runner.plan([quick_checks[check_name] for check_name in fault.caught_by])
            for check_name in fault.caught_by:
                check = quick_checks[check_name]
                try:
                    outcome = run_check(runner, check)
                except KvguardError as exc:
                    message = str(exc)  # the check errors: red, never a pass
                else:
                    assert outcome.verdict == "FAIL", (check_name, outcome.violations)
                    message = "; ".join(outcome.violations)
                assert re.search(CAUSE[name][check_name], message), (check_name, message)
    finally:
        runner.close()
