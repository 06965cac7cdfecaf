"""edit_replay follow-ups and budgets-file rules, without an engine."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.scoring import floor_cuts, reuse_gap
from pytest_kvguard.gate.budgets_file import load_budgets_file
from pytest_kvguard.inputs.chats import (
    APPENDED_TURN,
    EDIT_SUFFIX,
    common_prefix,
    followup,
    history,
    load_conversation,
)
from pytest_kvguard.scenarios.edit_replay import default_via, format_gap

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


def test_resend_edits_a_user_message_and_drops_what_followed() -> None:
    resent = followup(TUTOR, "resend", 13)
    assert resent[:13] == history(TUTOR)[:13] and len(resent) == 14
    assert resent[13]["content"] == TUTOR.messages[13].content + EDIT_SUFFIX
    assert followup(TUTOR, "resend", -2) == followup(TUTOR, "resend", 23)
    with pytest.raises(KvguardError, match="message 14 is the assistant's"):
        followup(TUTOR, "resend", 14)


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
        ({"params": "{followup: resend}"}, "b.yaml:11: params.message goes with followup: edit"),
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
                "budgets": "{max_reuse_excess: 0.1}",
            },
            "b.yaml:12: budget max_reuse_excess compares a scored reply with fresh prefills",
        ),
        (
            {"budgets": "{max_mean_abs_nll_diff: 0.01}"},
            "b.yaml:12: budget max_mean_abs_nll_diff does not apply to a edit_replay check",
        ),
        (
            {"params": "{followup: append, chat_template: none.jinja}"},
            "b.yaml:11: chat template 'none.jinja': No such file or directory",
        ),
        (
            {"params": "{followup: append, stale_window: yes please}"},
            "b.yaml:11: params.stale_window must be true or false",
        ),
        (
            {"params": "{followup: append, via: memory, stale_window: true}"},
            "b.yaml:11: params.stale_window is checked against the window",
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
    assert (check.spec.via, check.spec.reply_tokens) == ("api", 128)
    (memory,) = load_budgets_file(write(tmp_path, params="{followup: append, via: memory}")).checks
    assert memory.spec.via == "memory"
    assert default_via("llama_server") == default_via("mlx") == "api"


def test_a_server_has_no_memory_path(tmp_path: Path) -> None:
    text = write(tmp_path, params="{followup: append, via: memory}").read_text()
    path = tmp_path / "s.yaml"
    path.write_text(text.replace("policy: full", "policy: full\n    engine: llama_server"))
    with pytest.raises(KvguardError, match=r"s.yaml:\d+: engine llama_server is a server"):
        load_budgets_file(path)


def test_the_correctness_budget_of_edit_replay(tmp_path: Path) -> None:
    path = write(tmp_path, budgets="{max_reuse_excess: 0.1}")
    (check,) = load_budgets_file(path).checks
    assert check.budgets.declared() == {"max_reuse_excess": 0.1}
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    path = write(tmp_path, params="{followup: append, chat_template: t.jinja, stale_window: true}")
    (check,) = load_budgets_file(path).checks
    assert (check.spec.chat_template, check.spec.stale_window) == ("t.jinja", True)


def test_reuse_gap_figures() -> None:
    fresh = np.array([1.0, 2.0, 3.0])
    gap = reuse_gap(fresh + np.array([0.0, 0.3, -0.1]), fresh)
    assert gap["scored_tokens"] == 3
    assert gap["mean_abs_nll_diff"] == pytest.approx(0.4 / 3)
    assert gap["max_abs_nll_diff"] == pytest.approx(0.3)
    assert gap["nll_shift"] == pytest.approx(0.2 / 3)
    assert gap["ppl_diff_pct"] == pytest.approx((math.exp(6.2 / 3) / math.exp(2.0) - 1) * 100)
    assert (gap["reuse_floor"], gap["reuse_excess"]) == (0.0, gap["mean_abs_nll_diff"])
    assert reuse_gap(fresh, fresh)["mean_abs_nll_diff"] == 0.0
    assert math.isnan(reuse_gap(None, fresh)["mean_abs_nll_diff"])
    assert format_gap(reuse_gap(fresh, fresh)) == ("0.0000", "0.0000", "+0.0000")
    assert format_gap(reuse_gap(None, None)) == ("-", "-", "-")


def test_the_floor_is_the_largest_gap_between_correct_computations() -> None:
    """A stale cache moves predictions both ways: its signed shift nets out, its mean
    |dNLL| does not; the floor comes off the gap."""
    fresh = np.zeros(4)
    stale = np.array([0.4, -0.4, 0.3, -0.3])
    cuts = {100: np.array([0.05, -0.05, 0.0, 0.0]), 200: np.array([0.1, 0.1, 0.1, -0.1])}
    gap = reuse_gap(stale, fresh, cuts)
    assert gap["nll_shift"] == pytest.approx(0.0)
    assert gap["mean_abs_nll_diff"] == pytest.approx(0.35)
    assert gap["reuse_floor"] == pytest.approx(0.1)
    assert gap["reuse_excess"] == pytest.approx(0.25)


def test_the_floor_is_cut_where_the_reuse_was() -> None:
    assert floor_cuts(734, 745) == [734]
    assert floor_cuts(0, 745) == []  # nothing reused: the replay is a fresh prefill itself
    assert floor_cuts(745, 745) == []


def test_memory_budget_in_human_units(tmp_path: Path) -> None:
    path = write(tmp_path, budgets="{max_memory_bytes: 24 MiB}")
    (check,) = load_budgets_file(path).checks
    assert check.budgets.max_memory_bytes == 24 * 2**20
