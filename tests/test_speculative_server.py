"""Scenario speculative on engine llama_server: a real llama-server started with the target
re-quantized to Q4_0 as its draft (``--model-draft --spec-type draft-simple``), against the
same server without it, on the bundled models.

SmolLM2 on the full policy must pass with drafts made and rejected (Gemma 3's sliding-window
rows, slower, are the full gate's). The server gives no log probability for the tokens its
verification rounds emit, so the draft path has no log-probability gap to judge.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pytest_kvguard.engines import EngineOptions
from pytest_kvguard.engines.served.server_speculative import DraftSettings, rounds_of
from pytest_kvguard.gate.budgets_file import load_budgets_file
from pytest_kvguard.gate.runner import Runner, run_check

# The draft is written by llama.cpp's quantizer (llama-cpp-python).
pytestmark = [pytest.mark.llama_server, pytest.mark.llama_cpp]

BUDGETS = """\
version: 1
defaults:
  engine: llama_server
  params: {text: pydoc, draft: gguf_q4_0}
checks:
  - name: smollm2-server-spec-full
    scenario: speculative
    model: smollm2-135m
    policy: full
    params: {prompt: 160, new_tokens: 64}
    budgets: {max_divergent_tokens: 0}
"""


def test_rounds_are_placed_in_the_context_from_the_log() -> None:
    """#tokens counts the cache's cells before the round: its first draft is the next reply
    token."""
    log = "\n".join([
        "handle_last_: generate_draft: id=18, #tokens=160, #draft=3, pos_next=160",
        "operator(): add accepted tokens: sampled=656, ids.size=1, n_draft=3",
        "handle_last_: generate_draft: id=656, #tokens=161, #draft=3, pos_next=161",
        "operator(): add accepted tokens: sampled=18, ids.size=4, n_draft=3",
        "handle_last_: generate_draft: id=7, #tokens=165, #draft=2, pos_next=165",
        "operator(): add accepted tokens: sampled=9, ids.size=2, n_draft=2",
    ])  # fmt: skip
    assert rounds_of(log, 160) == [(1, 3, 0), (2, 3, 3), (6, 2, 1)]
    args = DraftSettings(512, draft_model=Path("d.gguf"), num_draft=3).args()
    assert args[args.index("--model-draft") + 1] == "d.gguf"
    assert args[args.index("--spec-draft-n-max") + 1] == "3"
    assert "--spec-type" in args and DraftSettings(512).args()[-1] != "5"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(BUDGETS, encoding="utf-8")
    runner = Runner(EngineOptions.from_env())
    try:
        return {check.name: run_check(runner, check) for check in load_budgets_file(path).checks}
    finally:
        runner.close()


def test_smollm2_full_passes_with_drafts_rejected(outcomes: dict[str, object]) -> None:
    outcome = outcomes["smollm2-server-spec-full"]
    m = outcome.metrics  # type: ignore[attr-defined]
    assert outcome.verdict == "PASS", outcome.violations  # type: ignore[attr-defined]
    assert m["drafted"] > 0 and 0 < m["accepted"] < m["drafted"]
    assert m["rejections_past_cap"] > 0
    # The server writes no log probability for a verified round's tokens: no gap is judged.
    assert "logprob_gap" not in m and "logprob_gap_excess" not in m
    assert np.isfinite(m["noise_margin"]) and m["noise_margin"] >= 0
