"""edit_replay follow-ups and budgets-file rules, without an engine."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pytest_kvguard.errors import KvguardError
from pytest_kvguard.gate.budgets_file import load_budgets_file
from pytest_kvguard.inputs.chats import (
    APPENDED_TURN,
    EDIT_SUFFIX,
    followup,
    history,
    load_conversation,
)
from pytest_kvguard.scenarios.edit_replay import default_via, format_gap
from pytest_kvguard.scenarios.replaying import common_prefix
from pytest_kvguard.scoring import reuse_gap

TUTOR = load_conversation("tutor", Path("."))


def test_bundled_chat_has_reasoning_to_trim() -> None:
    assert len(TUTOR.messages) == 25
    assert sum(1 for m in TUTOR.messages if m.reasoning) == 12


def test_a_shortened_chat_keeps_its_first_messages_and_says_so() -> None:
    short = TUTOR.first(11)
    assert short.messages == TUTOR.messages[:11] and short.name == "tutor[:11]"
    assert TUTOR.first(None) is TUTOR and TUTOR.first(25) is TUTOR
    assert followup(short, "append", None)[:-1] == history(short)
    with pytest.raises(KvguardError, match="chat_messages is 26, and chat 'tutor' has 25"):
        TUTOR.first(26)


def test_edit_changes_only_that_message() -> None:
    before, after = history(TUTOR), followup(TUTOR, "edit", 13)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert changed == [13] and after[13]["content"].endswith(EDIT_SUFFIX)


def test_regenerate_drops_the_last_reply_and_append_adds_a_turn() -> None:
    assert followup(TUTOR, "regenerate", None) == history(TUTOR)[:-1]
    assert followup(TUTOR, "append", None)[-1] == {"role": "user", "content": APPENDED_TURN}


def test_trim_reasoning_keeps_only_the_last_replys_reasoning() -> None:
    trimmed = followup(TUTOR, "trim_reasoning", None)
    with_think = [i for i, m in enumerate(trimmed) if m["content"].startswith("<think>")]
    assert with_think == [24]


def test_edit_index_out_of_range() -> None:
    with pytest.raises(KvguardError, match="within the chat's 25 messages"):
        followup(TUTOR, "edit", 25)


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


CHECK = """\
version: 1
defaults:
  engine: llama_cpp
  model: smollm2-135m
  params: {{tokens: 1500, cap: 256}}
  budgets: {{max_ppl_increase_pct: 25}}
checks:
  - name: replay
    scenario: edit_replay
    policy: {policy}
    params: {params}
    budgets: {budgets}
"""


def write(tmp_path: Path, policy: str = "full", params: str = "{followup: edit, message: 1}",
          budgets: str = "{max_reprefill_tokens: 10}") -> Path:  # fmt: skip
    path = tmp_path / "b.yaml"
    path.write_text(CHECK.format(policy=policy, params=params, budgets=budgets))
    return path


def test_defaults_of_other_scenarios_do_not_leak_in(tmp_path: Path) -> None:
    (check,) = load_budgets_file(write(tmp_path)).checks
    assert check.spec.message == 1
    assert check.budgets.declared() == {"max_reprefill_tokens": 10}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": "{followup: edit}"}, "b.yaml:11: params.message goes with followup: edit"),
        ({"params": "{followup: rewrite}"}, "b.yaml:11: unknown follow-up 'rewrite'"),
        (
            {"params": "{followup: append, cap: 5}"},
            "b.yaml:11: unknown edit_replay parameter 'cap'",
        ),
        ({"budgets": "{max_kv_entries: 5}"}, "b.yaml:12: budget max_kv_entries does not apply to"),
        (
            {"budgets": "{max_memory_bytes: 3 parsecs}"},
            "b.yaml:12: budget max_memory_bytes must be a size",
        ),
        (
            {"policy": "window"},
            "b.yaml:10: engine 'llama_cpp' does not implement policy 'window' for",
        ),
        ({"params": "{followup: edit, message: 99}"}, "b.yaml:11: edit needs a message index"),
        ({"params": "{followup: append, chat: none.json}"}, "b.yaml:11: chat file 'none.json'"),
        ({"params": "{followup: append, via: cache}"}, "b.yaml:11: unknown params.via 'cache'"),
        (
            {"params": "{followup: append, via: api, checkpoints: 2}", "policy": "swa"},
            "b.yaml:11: engine llama_cpp's user-facing API keeps no SWA checkpoints",
        ),
        (
            {"params": "{followup: append, reply_tokens: -1}"},
            "b.yaml:11: params.reply_tokens must be >= 0",
        ),
        (
            {
                "params": "{followup: append, reply_tokens: 0}",
                "budgets": "{max_mean_abs_nll_diff: 0.01}",
            },
            "b.yaml:12: budget max_mean_abs_nll_diff compares a scored reply with a fresh prefill",
        ),
    ],
)
def test_replay_check_errors(tmp_path: Path, kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(KvguardError) as caught:
        load_budgets_file(write(tmp_path, **kwargs))
    assert "\n" not in str(caught.value)
    assert message in str(caught.value).replace(str(tmp_path) + "/", "")


def test_via_defaults_to_the_engines_own_api_where_it_has_one(tmp_path: Path) -> None:
    (check,) = load_budgets_file(write(tmp_path)).checks
    assert (check.spec.via, check.spec.reply_tokens) == ("api", 64)
    (memory,) = load_budgets_file(write(tmp_path, params="{followup: append, via: memory}")).checks
    assert memory.spec.via == "memory"
    assert default_via("llama_server") == default_via("mlx") == "api"


def test_a_server_has_no_memory_path(tmp_path: Path) -> None:
    text = write(tmp_path, params="{followup: append, via: memory}").read_text()
    path = tmp_path / "s.yaml"
    path.write_text(text.replace("policy: full", "policy: full\n    engine: llama_server"))
    with pytest.raises(KvguardError, match=r"s.yaml:\d+: engine llama_server is a server"):
        load_budgets_file(path)


def test_correctness_budgets_apply_to_edit_replay(tmp_path: Path) -> None:
    path = write(tmp_path, budgets="{max_mean_abs_nll_diff: 0.01, max_ppl_diff_pct: 0.5}")
    (check,) = load_budgets_file(path).checks
    assert check.budgets.declared() == {"max_mean_abs_nll_diff": 0.01, "max_ppl_diff_pct": 0.5}


def test_reuse_gap_figures() -> None:
    fresh = np.array([1.0, 2.0, 3.0])
    gap = reuse_gap(fresh + np.array([0.0, 0.3, -0.1]), fresh)
    assert gap["scored_tokens"] == 3
    assert gap["mean_abs_nll_diff"] == pytest.approx(0.4 / 3)
    assert gap["max_abs_nll_diff"] == pytest.approx(0.3)
    assert gap["ppl_diff_pct"] == pytest.approx((math.exp(6.2 / 3) / math.exp(2.0) - 1) * 100)
    assert reuse_gap(fresh, fresh)["mean_abs_nll_diff"] == 0.0
    assert math.isnan(reuse_gap(None, fresh)["mean_abs_nll_diff"])
    assert format_gap(reuse_gap(fresh, fresh)) == "0"
    assert format_gap(reuse_gap(None, None)) == "-"


def test_memory_budget_in_human_units(tmp_path: Path) -> None:
    path = write(tmp_path, budgets="{max_memory_bytes: 24 MiB}")
    (check,) = load_budgets_file(path).checks
    assert check.budgets.max_memory_bytes == 24 * 2**20
