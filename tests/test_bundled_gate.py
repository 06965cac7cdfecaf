"""The bundled budgets file on the real engines and real bundled models: the proof the gate works.

Every check in fixtures/budgets.yaml runs here as README command 1 runs it: in the session's
engine worker, told of every bundled check first, so runs of several checks decode together.
The kvguard fixture's tests later in the session send the same worker checks whose runs are
already there, and reuse them. The last test writes the JSON report of these outcomes and
validates it against the documented schema.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.budgets_file import load_budgets_file
from pytest_kvguard.environments import Environments
from pytest_kvguard.outcome import Outcome
from pytest_kvguard.report import build_report, report_schema
from pytest_kvguard.scenarios.base import Check
from pytest_kvguard.session import run_gated, sendable, session_pool

pytestmark = pytest.mark.engine
BUNDLED = load_budgets_file(Path(__file__).parent.parent / "fixtures" / "budgets.yaml")
OUTCOMES: dict[str, Outcome] = {}
"""Filled by test_bundled_check, read by the report test that follows it."""


def test_the_bundled_file_shows_the_cliff_on_both_engines() -> None:
    """What the gate is for: on each engine a sink policy passes and a pure window is caught."""
    for engine in ("llama_cpp", "mlx"):
        stream = [c for c in BUNDLED.checks if c.engine == engine and c.scenario == "stream"]
        assert any(c.spec.policy.kind == "sink" and not c.expect_violation for c in stream)
        assert any(c.spec.policy.kind == "window" and c.expect_violation for c in stream)
        assert all(c.spec.tokens >= 1500 for c in stream if c.model.name == "smollm2-135m")


@pytest.fixture(scope="module", autouse=True)
def planned(pytestconfig: pytest.Config) -> None:
    """As command 1 tells its engine worker: runs of several checks then decode together."""
    python = Environments().python_for(("llama_cpp", "mlx"))
    worker = session_pool(pytestconfig).worker(python)
    worker.add_plan([sendable(check) for check in BUNDLED.checks])


@pytest.mark.parametrize("check", BUNDLED.checks, ids=lambda c: c.name)
def test_bundled_check(pytestconfig: pytest.Config, check: Check[Any]) -> None:
    outcome = run_gated(pytestconfig, check)
    OUTCOMES[check.name] = outcome
    assert outcome.verdict == ("CAUGHT" if check.expect_violation else "PASS"), outcome.violations
    m, spec = outcome.metrics, check.spec
    if check.scenario == "edit_replay":
        # The engine may keep no more than the common prefix, and always re-prefills one token.
        assert m["reused_tokens"] <= min(m["split"], m["prompt_tokens"] - 1)
        if spec.policy.kind in ("full", "swa_full") and check.engine != "mlx":
            # Nothing slides out of these caches: the whole common prefix is reused.
            assert m["reused_tokens"] == min(m["split"], m["prompt_tokens"] - 1)
        return
    if check.scenario == "memory":
        # Every length reached; a cap holds exactly min(n, cap) entries (the engine's count).
        samples = outcome.detail.samples
        assert [s["tokens"] for s in samples] == list(spec.lengths)
        if spec.policy.kind in ("sink", "window"):
            assert [s["held"] for s in samples] == [min(n, spec.policy.cap) for n in spec.lengths]
        return
    if check.scenario == "sweep":
        # Every run held exactly the cap once past it, and evicted from the same token on.
        assert {s["kv_entries"] for s in outcome.detail.samples} == {spec.cap}
        assert {s["first_eviction"] for s in outcome.detail.samples} == {spec.cap}
        return
    if check.scenario == "recall":
        assert m["baseline_recalled"] == 1  # the full cache answers: the probe is answerable
        # Eviction reaches the fact unless every fact token is a pinned sink.
        evicts = spec.policy.kind != "full"
        assert m["fact_evicted"] == (evicts and spec.policy.sinks < m["fact_tokens"])
        return
    if check.scenario == "generate":
        # Reply tokens past the cap were scored against both comparison runs (a server has no
        # decode loop of kvguard's to compare with: its chunk gap is not measured).
        assert m["scored_tokens"] > 0
        served = check.engine == "llama_server"
        assert ("single_token_post_eviction_ppl" in m) != served
        assert math.isfinite(m["post_eviction_ppl"])
        return
    if check.scenario == "parity":
        assert outcome.tokens == spec.tokens and m["mean_abs_nll_diff"] > 0
        return
    if check.scenario == "attention":
        # Every row read is a probability distribution, for every query asked, on every layer.
        assert m["max_row_sum_error"] < 1e-3
        assert outcome.detail.queries == list(spec.queries)
        assert len(outcome.detail.head_mass_by_k) == len(outcome.detail.layer_sink_mass) > 0
        by_k = outcome.detail.sink_mass_by_k  # mass on the first k tokens grows with k
        assert all(a <= b + 1e-6 for a, b in zip(by_k, by_k[1:], strict=False))
        return
    if check.scenario == "attention_parity":
        assert 0 < m["mean_sink_mass_diff_pct"] <= m["sink_mass_diff_pct"]
        return
    if outcome.violations and spec.policy.kind in ("sink", "window"):
        # A red sink or window check names the heads that park attention on the first tokens.
        assert outcome.explanation is not None
        assert outcome.explanation["sinks_kept"] == spec.policy.sinks
        assert outcome.explanation["sink_heads"]
    cap = spec.policy.cap
    assert cap is not None
    if spec.policy.kind in ("sink", "window"):
        assert m["first_eviction"] == cap  # token `cap` is the first that does not fit
        assert m["kv_entries"] == cap
        assert m["evicted"] == spec.tokens - cap
        # A chunked run is compared with the same policy fed one token at a time.
        assert ("chunk_gap_pct" in m) == (spec.policy.chunk > 1)
        # Before the first eviction every policy holds the same tokens: only batching differs.
        assert m["pre_eviction_ppl"] == pytest.approx(m["baseline_pre_eviction_ppl"], rel=2e-3)
    elif spec.policy.kind == "engine_default":
        # The finding: the cap was asked for and not applied (some layers keep every token).
        assert m["kv_entries"] == spec.tokens > cap


SERVED_AND_IN_PROCESS = {
    "smollm2-server-full-edit-start": "smollm2-full-edit-start",
    "smollm2-server-full-edit-end": "smollm2-full-edit-end",
    "gemma3-server-swa-edit-end": "gemma3-swa-edit-end",
    "gemma3-server-swa-append": "gemma3-swa-append",
    "gemma3-server-swafull-edit-middle": "gemma3-swafull-edit-middle",
}


def outcomes_of(*names: str) -> list[Outcome]:
    if not all(name in OUTCOMES for name in names):
        pytest.skip(f"{', '.join(names)} did not all run in this session (deselected)")
    return [OUTCOMES[name] for name in names]


@pytest.mark.parametrize("served", SERVED_AND_IN_PROCESS)
def test_llama_server_counts_what_the_in_process_engine_counts(served: str) -> None:
    """The same chat, follow-up and token ids: llama-server's own cache_n and prompt_n are the
    in-process engine's reused and re-prefilled counts, token for token."""
    server, in_process = outcomes_of(served, SERVED_AND_IN_PROCESS[served])
    keys = ("prompt_tokens", "split", "reused_tokens", "reprefill_tokens")
    assert {k: server.metrics[k] for k in keys} == {k: in_process.metrics[k] for k in keys}


def test_llama_server_checkpoints_differ_where_documented() -> None:
    """The one count that differs: llama-server checkpoints only near a prompt's end, so the
    middle edit starts over where the in-process engine restores a checkpoint."""
    server, in_process = outcomes_of("gemma3-server-ckpt-edit-middle", "gemma3-ckpt-edit-middle")
    assert server.metrics["reused_tokens"] == 0 < in_process.metrics["reused_tokens"]
    assert server.metrics["reprefill_tokens"] == server.metrics["prompt_tokens"]


def test_llama_server_context_shift_scores_as_the_in_process_sink_policy() -> None:
    """One prompt, then a long forced generation, shifted by the server (n_keep 4, one token at
    a time) and by the in-process engine: the same perplexity, up to float rounding. (Their
    baselines differ by how the full cache was fed: the server generates it a token at a time,
    kvguard's own loop in 512-token batches.)"""
    server, in_process = outcomes_of("smollm2-server-generate-sink4",
                                     "smollm2-generate-sink4-onecall")  # fmt: skip
    assert server.metrics["scored_tokens"] == in_process.metrics["scored_tokens"]
    post = server.metrics["post_eviction_ppl"]
    assert post == pytest.approx(in_process.metrics["post_eviction_ppl"], rel=1e-3)


def test_llama_server_sink_sweep_keeps_each_sink_count() -> None:
    """Each sink count of the served sweep is one request whose every shift the server logged
    with n_keep = that count (SmolLM2 adds no BOS); the runs the generate checks made at 0 and
    4 sinks are the sweep's own (the same figures, shared)."""
    sweep, sink4, window = outcomes_of("smollm2-server-sweep", "smollm2-server-generate-sink4",
                                       "smollm2-server-generate-window")  # fmt: skip
    rows = {row["sinks"]: row for row in sweep.detail.samples}
    assert sorted(rows) == [0, 1, 2, 4, 8]
    for sinks, row in rows.items():
        assert row["sinks_kept"] == sinks
        assert row["kv_entries"] == row["first_eviction"] == 255  # cap: --ctx-size 256
        assert row["context_shifts"] == sink4.metrics["context_shifts"] > 0
    # Shared, not recomputed: the sweep reports no time of its own for those runs.
    shared = [policy for policy, seconds in sweep.seconds.items() if seconds == 0.0]
    assert sorted(shared) == ["baseline", "sink4/255 reidx step1", "window/255 reidx step1"]
    assert rows[4]["post_eviction_ppl"] == sink4.metrics["post_eviction_ppl"]
    assert rows[0]["post_eviction_ppl"] == window.metrics["post_eviction_ppl"]
    assert all(rows[s]["post_eviction_ppl"] < rows[0]["post_eviction_ppl"] for s in (1, 2, 4, 8))


def test_the_real_report_matches_its_schema() -> None:
    """The JSON report of the bundled checks above, as --kvguard-json writes it, is schema-valid."""
    import jsonschema

    if not OUTCOMES:
        pytest.skip("no bundled check ran in this session (deselected)")
    report = build_report(
        list(OUTCOMES.values()), budgets_file=str(BUNDLED.path), budgets_sha256=BUNDLED.sha256,
        missing_checks=[], exitstatus=0,
    )  # fmt: skip
    report = json.loads(json.dumps(report))  # exactly what the file holds
    jsonschema.validate(report, report_schema())
    assert len(report["checks"]) == len(OUTCOMES)
