"""The speculative scenario: its bookkeeping (rounds, divergence) on known inputs, its refusals
at parse time, and one run through llama-cpp-python's own draft path with the fixture.

The gate rows (quick and full files) run both engines; test_faults.py injects a trim that
does nothing into mlx-lm's full cache and expects this scenario, and only its divergence
budget, to catch it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.gate.budgets_file import load_budgets_file
from pytest_kvguard.scenarios.speculative import first_difference


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a missing token differs


@pytest.mark.mlx
def test_mlx_rounds_follow_speculative_generate_steps_flags() -> None:
    from pytest_kvguard.engines.mlx.speculative import rounds_of

    # 3 drafted: 2 accepted then the target's token; 3 drafted, all accepted, then the
    # target's bonus token; the last round drafts only the 1 token still to make.
    flags = [True, True, False, True, True, True, False, True]
    assert rounds_of(flags, new_tokens=8, num_draft=3) == [(0, 3, 2), (3, 3, 3), (7, 1, 1)]
    # Every draft rejected: each round yields the target's token alone, and drafts no more
    # than the tokens still to make.
    assert rounds_of([False, False], new_tokens=2, num_draft=3) == [(0, 2, 0), (1, 1, 0)]


@pytest.mark.llama_cpp
def test_prompt_lookup_rounds_count_the_drafts_that_match() -> None:
    from pytest_kvguard.engines.llama_cpp.speculative import rounds_of

    emitted = [7, 8, 9, 7, 8]
    # Asked with 11 ids (prompt 10 + 1 emitted): proposals for tokens 1.. of the reply.
    proposals = [(11, [8, 9, 1]), (13, []), (13, [7, 8]), (15, [3])]
    assert rounds_of(proposals, prompt=10, emitted=emitted) == [(1, 3, 2), (3, 2, 2)]
    # A proposal that runs past the last emitted token: only what was verified counts, and a
    # draft the call never reached is no rejection.
    assert rounds_of([(14, [8, 5])], prompt=10, emitted=emitted) == [(4, 1, 1)]


def _written(tmp_path: Path, check: str) -> Path:
    path = tmp_path / "budgets.yaml"
    path.write_text(
        "version: 1\ndefaults: {model: smollm2-135m}\nchecks:\n  - name: a\n"
        "    scenario: speculative\n" + check
    )
    return path


@pytest.mark.llama_cpp
@pytest.mark.mlx
@pytest.mark.parametrize(
    ("check", "message"),
    [
        ("    engine: llama_cpp\n    policy: full\n    params: {prefilled: 20}\n"
         "    budgets: {max_divergent_tokens: 0}\n",
         "budgets.yaml:8: engine 'llama_cpp''s speculative call starts from its own prompt"),
        ("    engine: mlx\n    policy: full\n    params: {draft: prompt_lookup}\n"
         "    budgets: {max_divergent_tokens: 0}\n",
         "budgets.yaml:8: engine 'mlx' has no draft 'prompt_lookup'"),
        ("    engine: mlx\n    policy: sink\n    params: {cap: 512, prompt: 160, new_tokens: 64}\n"
         "    budgets: {max_divergent_tokens: 0}\n",
         "budgets.yaml:8: prompt 160 + new_tokens 64 never fill the cap 512"),
        ("    engine: mlx\n    policy: sink\n    params: {cap: 64, prompt: 100, prefilled: 100}\n"
         "    budgets: {max_divergent_tokens: 0}\n",
         "budgets.yaml:8: prefilled 100 leaves no prompt for the call"),
        ("    engine: llama_cpp\n    policy: sink\n    params: {cap: 64}\n"
         "    budgets: {max_divergent_tokens: 0}\n",
         "engine 'llama_cpp' does not implement policy 'sink' for speculative checks"),
    ],
    ids=["prefilled_on_llama_cpp", "draft_of_another_engine", "cap_never_filled",
         "nothing_left_to_call", "policy_without_a_draft_path"],
)  # fmt: skip
def test_a_check_that_cannot_mean_anything_is_refused(
    tmp_path: Path, check: str, message: str
) -> None:
    with pytest.raises(KvguardError) as caught:
        load_budgets_file(_written(tmp_path, check))
    assert message in str(caught.value)


@pytest.mark.llama_cpp
@pytest.mark.kv_budget(max_divergent_tokens=0, max_logprob_gap_excess=0)
def test_prompt_lookup_matches_plain_greedy_on_a_full_cache(kvguard) -> None:  # type: ignore[no-untyped-def]
    outcome = kvguard.speculative(policy="full", prompt=160, new_tokens=96)
    m = outcome.metrics
    # Drafts made and some rejected (no hollow pass), and every rejection trimmed: whatever
    # differs is within llama.cpp's own verification noise.
    assert m["drafted"] > 0 and m["rejections_past_cap"] > 0 and m["accepted"] < m["drafted"]
    assert m["noise_logprob"] > 0  # Q4_1 on CPU: a batched verification moves log p a little
