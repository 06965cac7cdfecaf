"""Input a new user gets wrong, refused at parse time with one line (file:line, what, fix), exit 4.

The classes of defect tried on every parameter and budget: zero, negative, infinite,
contradictory and self-comparison. Each case here was accepted (or hung, or failed at run
time with a wrong cause) before the scenario slices validated their own specs.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("fake_engine")

HEAD = "version: 1\ndefaults: {engine: fake, model: tiny.gguf}\nchecks:\n  - name: a\n"
"""Four lines: a check's keys start on line 5."""

CASES = {
    # zero
    "evict_step_zero": (
        "    policy: sink\n    params: {cap: 64, tokens: 400, evict_step: 0}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: params.evict_step must be >= 1, got 0",
    ),
    "checkpoint_step_zero": (
        "    scenario: edit_replay\n    policy: swa\n"
        "    params: {followup: append, checkpoints: 2, checkpoint_step: 0}\n"
        "    budgets: {max_reprefill_tokens: 9}\n",
        "budgets.yaml:7: params.checkpoint_step must be >= 1, got 0",
    ),
    "cap_zero": (
        "    policy: window\n    params: {cap: 0, tokens: 400}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: params.cap must be >= 2, got 0",
    ),
    "min_reused_zero": (
        "    scenario: edit_replay\n    policy: full\n    params: {followup: append}\n"
        "    budgets: {min_reused_tokens: 0}\n",
        "budgets.yaml:8: budget min_reused_tokens: 0 could never fail*",
    ),
    "positions_empty_list": (
        "    scenario: sweep\n    params: {cap: 64, tokens: 400, positions: []}\n"
        "    budgets: {min_sink_gain_pct: 1}\n",
        "budgets.yaml:6: params.positions is an empty list*",
    ),
    "positions_empty_name": (
        "    policy: sink\n    params: {cap: 64, tokens: 400, positions: ''}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: unknown position handling ''*",
    ),
    # negative
    "tokens_negative": (
        "    scenario: parity\n    engines: [fake, fake2]\n    params: {tokens: -5}\n"
        "    budgets: {max_ppl_diff_pct: 1}\n",
        "budgets.yaml:7: params.tokens must be >= 2, got -5",
    ),
    "sinks_negative": (
        "    policy: sink\n    params: {cap: 64, tokens: 400, sinks: -1}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: params.sinks must be >= 0, got -1",
    ),
    "chunk_zero": (
        "    policy: sink\n    params: {cap: 64, tokens: 400, chunk: 0}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: params.chunk must be >= 1, got 0",
    ),
    "chunk_past_the_sinks": (
        "    policy: sink\n    params: {cap: 64, tokens: 400, sinks: 4, chunk: 61}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: chunk 61 cannot fit beside 4 sink(s) in cap 64 (fix: use chunk: 60 or "
        "less (cap - sinks), or raise cap)",
    ),
    "sweep_chunk_past_the_largest_sink_count": (
        "    scenario: sweep\n    params: {cap: 64, tokens: 400, sinks: [0, 8], chunk: 60}\n"
        "    budgets: {min_sink_gain_pct: 1}\n",
        "budgets.yaml:6: chunk 60 cannot fit beside 8 sink(s) in cap 64*",
    ),
    "chunk_past_what_evict_steps_free": (
        "    policy: sink\n    params: {cap: 64, tokens: 400, evict_step: 8, chunk: 60}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: chunk 60 cannot fit beside 4 sink(s) in cap 64 when evicting 8 at a "
        "time (fix: use chunk: 56 or less (cap - sinks, down to a multiple of evict_step), or "
        "raise cap)",
    ),
    "chunk_on_a_policy_that_never_evicts": (
        "    scenario: memory\n    policy: full\n    params: {lengths: [100, 200], chunk: 16}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:7: policy 'full' never evicts, so chunk 16 would change nothing*",
    ),
    "generate_without_a_turn_past_the_cap": (
        "    scenario: generate\n    policy: sink\n"
        "    params: {cap: 64, tokens: 100, prompt: 30, reply: 10}\n"
        "    budgets: {max_chunk_gap_pct: 5}\n",
        "budgets.yaml:7: tokens 100 leave no whole turn (30 + 10 tokens) past the cap 64*",
    ),
    "chunk_gap_fed_one_at_a_time": (
        "    policy: sink\n    params: {cap: 64, tokens: 400}\n"
        "    budgets: {max_chunk_gap_pct: 5}\n",
        "budgets.yaml:7: max_chunk_gap_pct compares feeding in chunks with feeding one token at "
        "a time, and this check feeds one token at a time (chunk 1)*",
    ),
    # infinite
    "budget_inf": (
        "    policy: sink\n    params: {cap: 64, tokens: 400}\n"
        "    budgets: {max_ppl_increase_pct: .inf}\n",
        "budgets.yaml:7: budget max_ppl_increase_pct is infinite, so it could never fail*",
    ),
    "fraction_at_one": (
        "    scenario: edit_replay\n    policy: full\n    params: {followup: append}\n"
        "    budgets: {max_reprefill_fraction: 1}\n",
        "budgets.yaml:8: budget max_reprefill_fraction: 1 could never fail "
        "(reprefill_fraction is always at most 1)*",
    ),
    # contradictory
    "recall_and_forget": (
        "    scenario: recall\n    policy: sink\n    params: {cap: 64, filler_tokens: 100}\n"
        "    budgets: {must_recall: true, must_forget: true}\n",
        "budgets.yaml:8: must_recall and must_forget together can never both hold*",
    ),
    "forget_under_full": (
        "    scenario: recall\n    policy: full\n    params: {filler_tokens: 100}\n"
        "    budgets: {must_forget: true}\n",
        "budgets.yaml:8: must_forget with policy 'full', which never evicts*",
    ),
    "tokens_past_text": (
        "    policy: sink\n    params: {cap: 64, tokens: 400, text: short.txt}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: tokens 400 is more than text 'short.txt' can give (99 bytes, so at "
        "most 100 tokens)*",
    ),
    "empty_answer": (
        "    scenario: recall\n    policy: sink\n    params: {cap: 64, filler_tokens: 100, "
        "answer: ' '}\n    budgets: {must_forget: true}\n",
        "budgets.yaml:7: params.answer is empty*",
    ),
    "parity_with_engine": (
        "    scenario: parity\n    engine: fake\n    engines: [fake, fake2]\n"
        "    budgets: {max_ppl_diff_pct: 1}\n",
        "budgets.yaml:6: a parity check names its two engines under 'engines', not 'engine'*",
    ),
    # self-comparison
    "parity_same_engine": (
        "    scenario: parity\n    engines: [fake, fake]\n    params: {tokens: 400}\n"
        "    budgets: {max_ppl_diff_pct: 1}\n",
        "budgets.yaml:6: parity compares two engines, and both are 'fake'*",
    ),
    "baseline_is_candidate": (
        "    policy: sink\n    baseline: sink\n    params: {cap: 64, tokens: 400, sinks: 4}\n"
        "    budgets: {max_ppl_increase_pct: 5}\n",
        "budgets.yaml:6: baseline sink4/64 reidx step1 is the candidate policy itself*",
    ),
    "sweep_positions_twice": (
        "    scenario: sweep\n    params: {cap: 64, tokens: 400, positions: [absolute, absolute]}"
        "\n    budgets: {min_sink_gain_pct: 1}\n",
        "budgets.yaml:6: positions [[]'absolute', 'absolute'] names one handling twice*",
    ),
    # attention
    "attention_query_past_the_tokens": (
        "    scenario: attention\n    params: {tokens: 300, queries: [200, 300]}\n"
        "    budgets: {min_sink_heads_pct: 10}\n",
        "budgets.yaml:6: query position 300 is not among the 300 tokens fed (0 .. 299) (fix: use "
        "positions below 300, or raise tokens)",
    ),
    "attention_queries_inside_the_recent_window": (
        "    scenario: attention\n    params: {tokens: 300, queries: [60, 200]}\n"
        "    budgets: {min_sink_heads_pct: 10}\n",
        "budgets.yaml:6: the first query (60) minus recent (64) leaves no position past the "
        "first 4 tokens*(fix: move the queries later, or lower recent)",
    ),
    "attention_sinks_past_eight": (
        "    scenario: attention\n    params: {tokens: 300, sinks: 9}\n"
        "    budgets: {min_sink_heads_pct: 10}\n",
        "budgets.yaml:6: sinks 9 must be at most 8 and before the first query (150)*",
    ),
    "attention_threshold_over_a_hundred": (
        "    scenario: attention\n    params: {tokens: 300, sink_threshold: 150}\n"
        "    budgets: {min_sink_heads_pct: 10}\n",
        "budgets.yaml:6: sink_threshold is a percent, got 150 (fix: use sink_threshold: 50)",
    ),
    "attention_unknown_bos_mode": (
        "    scenario: attention\n    params: {tokens: 300, bos: remove}\n"
        "    budgets: {min_sink_heads_pct: 10}\n",
        "budgets.yaml:6: bos must be one of model, drop, add, got 'remove' (fix: use bos: model)",
    ),
    "attention_sink_heads_zero": (
        "    scenario: attention\n    params: {tokens: 300}\n"
        "    budgets: {min_sink_heads_pct: 0}\n",
        "budgets.yaml:7: budget min_sink_heads_pct: 0 could never fail*",
    ),
    "attention_parity_one_engine_twice": (
        "    scenario: attention_parity\n    engines: [fake, fake]\n    params: {tokens: 300}\n"
        "    budgets: {max_sink_mass_diff_pct: 5}\n",
        "budgets.yaml:6: attention_parity compares two engines, and both are 'fake'*",
    ),
    # llama-server: what a server cannot be asked
    "server_cap_between_context_steps": (
        "    scenario: generate\n    engine: llama_server\n    policy: sink\n"
        "    params: {cap: 256, tokens: 1500, prompt: 32, reply: 1468}\n"
        "    budgets: {max_ppl_increase_pct: 25}\n",
        "budgets.yaml:8: engine 'llama_server' holds at most a multiple of 256 cells minus one "
        "(it shifts when one more token would not fit), so cap 256 cannot be asked of it "
        "(fix: use cap: 255 or 511)",
    ),
    "server_chunk_gap": (
        "    scenario: generate\n    engine: llama_server\n    policy: sink\n"
        "    params: {cap: 255, tokens: 1500, prompt: 32, reply: 1468}\n"
        "    budgets: {max_chunk_gap_pct: 5}\n",
        "budgets.yaml:9: max_chunk_gap_pct compares the engine's generate path with kvguard's "
        "own one-token loop, which does not run through a server*",
    ),
    "one_turn_prompt_over_the_cap": (
        "    scenario: generate\n    policy: sink\n"
        "    params: {cap: 64, tokens: 400, prompt: 100, reply: 300}\n"
        "    budgets: {max_ppl_increase_pct: 25}\n",
        "budgets.yaml:7: the prompt (100 tokens) fills the cap 64*",
    ),
    "a_running_server_for_generate": (
        "    scenario: generate\n    engine: llama_server\n    model: http://127.0.0.1:8080\n"
        "    policy: sink\n    params: {cap: 255, tokens: 1500, prompt: 32, reply: 1468}\n",
        "budgets.yaml:7: a running server (model: http://127.0.0.1:8080) can serve edit_replay "
        "checks only*",
    ),
    "a_running_servers_memory": (
        "    scenario: edit_replay\n    engine: llama_server\n    model: http://127.0.0.1:8080\n"
        "    policy: full\n    params: {followup: append}\n"
        "    budgets: {max_memory_bytes: 10 MiB}\n",
        "budgets.yaml:10: memory is read from the log of a server kvguard starts*",
    ),
    "server_sweep_chunk": (
        "    scenario: sweep\n    engine: llama_server\n"
        "    params: {cap: 255, chunk: 64}\n    budgets: {min_sink_gain_pct: 40}\n",
        "budgets.yaml:7: engine llama_server decodes its generated tokens itself, one at a "
        "time: chunk does not apply (fix: remove params.chunk)",
    ),
    "server_sweep_prompt_over_the_cap": (
        "    scenario: sweep\n    engine: llama_server\n"
        "    params: {cap: 255, prompt: 300}\n    budgets: {min_sink_gain_pct: 40}\n",
        "budgets.yaml:7: the prompt (300 tokens) fills the cap 255*",
    ),
    "server_sweep_baseline": (
        "    scenario: sweep\n    engine: llama_server\n    baseline: swa_full\n"
        "    params: {cap: 255}\n    budgets: {min_sink_gain_pct: 40}\n",
        "budgets.yaml:7: a server's sweep is scored against its own full-context generation, "
        "not 'swa_full' (fix: remove baseline*",
    ),
    "sweep_prompt_in_process": (
        "    scenario: sweep\n    params: {cap: 256, prompt: 32}\n"
        "    budgets: {min_sink_gain_pct: 40}\n",
        "budgets.yaml:6: engine fake is fed and scored token by token by kvguard's own "
        "loop: a sweep on it has no prompt (fix: remove params.prompt: it applies to served "
        "engines such as llama_server)",
    ),
    "openai_checkpoints": (
        "    scenario: edit_replay\n    engine: openai\n    model: http://127.0.0.1:8000\n"
        "    policy: swa\n    params: {followup: append, checkpoints: 2}\n"
        "    budgets: {min_reused_tokens: 10}\n",
        "budgets.yaml:9: engine openai talks to a running server whose checkpoints are its own "
        "settings: kvguard cannot set them*",
    ),
    "chat_messages_past_the_chat": (
        "    scenario: edit_replay\n    policy: full\n"
        "    params: {followup: append, chat_messages: 99}\n"
        "    budgets: {min_reused_tokens: 10}\n",
        "budgets.yaml:7: params.chat_messages is 99, and chat 'tutor' has 25 messages (fix: use "
        "chat_messages: 2 to 25, or leave it out for all)",
    ),
    "chat_messages_one": (
        "    scenario: edit_replay\n    policy: full\n"
        "    params: {followup: append, chat_messages: 1}\n"
        "    budgets: {min_reused_tokens: 10}\n",
        "budgets.yaml:7: params.chat_messages must be >= 2, got 1",
    ),
    "edit_past_the_shortened_chat": (
        "    scenario: edit_replay\n    policy: full\n"
        "    params: {followup: edit, message: 13, chat_messages: 11}\n"
        "    budgets: {min_reused_tokens: 10}\n",
        "budgets.yaml:7: edit needs a message index within the chat's 11 messages*",
    ),
    "kv_bits_on_an_engine_without_them": (
        "    policy: full\n    params: {tokens: 400, kv_bits: 8}\n"
        "    budgets: {max_ppl_increase_pct: 5}\n",
        "budgets.yaml:6: engine 'fake' takes no KV precision settings*",
    ),
    "cache_type_unknown": (
        "    policy: sink\n    params: {cap: 64, tokens: 400, cache_type_k: q3}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: cache_type_k 'q3' is not a cache type llama.cpp takes (fix: use "
        "cache_type_k: f32, f16, bf16, q8_0*",
    ),
    "unquantized_baseline_of_an_unquantized_policy": (
        "    policy: sink\n    baseline: unquantized\n    params: {cap: 64, tokens: 400}\n"
        "    budgets: {max_kv_entries: 64}\n",
        "budgets.yaml:6: baseline 'unquantized' is the candidate's policy at full precision*",
    ),
    "attention_with_a_quantized_v": (
        "    engine: llama_cpp\n    scenario: attention\n"
        "    params: {cache_type_k: q8_0, cache_type_v: q8_0}\n"
        "    budgets: {min_sink_mass_pct: 10}\n",
        "budgets.yaml:7: attention reads llama.cpp's probabilities with flash attention off, "
        "and a q8_0 V cache needs it on (fix: quantize K only*",
    ),
    "sink_mass_diff_of_an_unquantized_attention_check": (
        "    engine: llama_cpp\n    scenario: attention\n"
        "    budgets: {max_sink_mass_diff_pct: 5}\n",
        "budgets.yaml:7: max_sink_mass_diff_pct compares the quantized cache's sink mass*",
    ),
    "server_stream": (
        "    engine: llama_server\n    policy: sink\n    params: {cap: 255, tokens: 1500}\n"
        "    budgets: {max_ppl_increase_pct: 25}\n",
        "budgets.yaml:6: engine 'llama_server' does not implement policy 'sink' for stream*",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_at_parse_time_with_file_line_and_fix(gate: pytest.Pytester, case: str) -> None:
    body, expected = CASES[case]
    gate.makefile(".yaml", budgets=HEAD + body)
    (gate.path / "short.txt").write_text("x" * 99)
    result = gate.runpytest("--kvguard", "budgets.yaml", "--kvguard-json", "r.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([f"ERROR: {expected}*"])
    errors = [line for line in result.stderr.lines if line.strip()]
    assert len(errors) == 1 and "(fix: " in errors[0], errors
    assert not (gate.path / "r.json").exists()  # no partial report that could pass for a run


def test_a_text_too_short_for_its_tokens_names_the_real_count(gate: pytest.Pytester) -> None:
    """Past the byte bound the count is only known once tokenized: the run-time error says it."""
    gate.makefile(
        ".yaml",
        budgets=HEAD + "    policy: sink\n    params: {cap: 64, tokens: 400, text: mid.txt}\n"
        "    budgets: {max_kv_entries: 64}\n",
    )
    (gate.path / "mid.txt").write_text("x" * 1000)  # the toy makes 1 token of 4 characters
    result = gate.runpytest("--kvguard", "budgets.yaml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["budgets.yaml:4: text 'mid.txt' has only 250 tokens on tiny.gguf, 400 asked*"]
    )
