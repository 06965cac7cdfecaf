"""The bundled budgets file on the real engines and real bundled models: the proof the gate works.

Every check in fixtures/budgets.yaml runs here (about six minutes on 2 CPU cores); the runs are
shared with the other engine tests through the plugin's session runner.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvguard.budgets_file import Check, load_budgets_file
from pytest_kvguard.runner import Runner, run_check

pytestmark = pytest.mark.engine
BUNDLED = load_budgets_file(Path(__file__).parent.parent / "fixtures" / "budgets.yaml")


def test_the_bundled_file_shows_the_cliff_on_both_engines() -> None:
    """What the gate is for: on each engine a sink policy passes and a pure window is caught."""
    for engine in ("llama_cpp", "mlx"):
        stream = [c for c in BUNDLED.checks if c.engine == engine and c.scenario == "stream"]
        assert any(c.policy.kind == "sink" and not c.expect_violation for c in stream)
        assert any(c.policy.kind == "window" and c.expect_violation for c in stream)
        assert all(c.tokens >= 1500 for c in stream if c.model.name == "smollm2-135m")


@pytest.mark.parametrize("check", BUNDLED.checks, ids=lambda c: c.name)
def test_bundled_check(kvguard_runner: Runner, check: Check) -> None:
    outcome = run_check(kvguard_runner, check)
    assert outcome.verdict == ("CAUGHT" if check.expect_violation else "PASS"), outcome.violations
    m = outcome.metrics
    if check.scenario == "edit_replay":
        assert m["reused_tokens"] + m["reprefill_tokens"] == m["prompt_tokens"]
        assert m["reused_tokens"] <= min(m["split"], m["prompt_tokens"] - 1)
        if check.policy.kind in ("full", "swa_full") and check.engine == "llama_cpp":
            # Nothing slides out of these caches: the whole common prefix is reused.
            assert m["reused_tokens"] == min(m["split"], m["prompt_tokens"] - 1)
        return
    if check.scenario == "memory":
        # One figure per length, every length reached; a cap holds exactly min(n, cap) entries.
        assert [s["tokens"] for s in outcome.samples] == list(check.lengths)
        cap = check.policy.cap
        if check.policy.kind in ("sink", "window"):
            assert cap is not None
            assert [s["held"] for s in outcome.samples] == [min(n, cap) for n in check.lengths]
        return
    if check.scenario == "sweep":
        assert check.sweep is not None
        runs = [(s["positions"], s["sinks"]) for s in outcome.samples]
        assert runs == [(p, c) for p in check.sweep.positions for c in check.sweep.sinks]
        # Every run held exactly the cap once past it, and evicted from the same token on.
        assert {s["kv_entries"] for s in outcome.samples} == {check.policy.cap}
        assert {s["first_eviction"] for s in outcome.samples} == {check.policy.cap}
        return
    if check.scenario == "recall":
        assert m["baseline_recalled"] == 1  # the full cache answers: the probe is answerable
        # Eviction reaches the fact unless every fact token is a pinned sink.
        evicts = check.policy.kind != "full"
        assert m["fact_evicted"] == (evicts and check.policy.sinks < m["fact_tokens"])
        return
    if check.scenario == "parity":
        # Both engines scored every one of the same token ids.
        assert outcome.tokens == check.tokens and m["mean_abs_nll_diff"] > 0
        return
    cap = check.policy.cap
    assert cap is not None
    if check.policy.kind in ("sink", "window"):
        assert m["first_eviction"] == cap  # token `cap` is the first that does not fit
        assert m["kv_entries"] == cap
        assert m["evicted"] == check.tokens - cap
        # Before the first eviction every policy holds the same tokens: only batching differs.
        assert m["pre_eviction_ppl"] == pytest.approx(m["baseline_pre_eviction_ppl"], rel=2e-3)
    elif check.policy.kind == "engine_default":
        # The finding: the cap was asked for and not applied (some layers keep every token).
        assert m["kv_entries"] == check.tokens > cap
