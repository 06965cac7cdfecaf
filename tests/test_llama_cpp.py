"""Real llama.cpp (llama-cpp-python) on the real bundled SmolLM2-135M: the adapter's contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.engines import Prompt
from pytest_kvguard.gate.checks import Written, build_check
from pytest_kvguard.gate.runner import Runner, run_check
from pytest_kvguard.inputs.models import ModelRef, read_arch
from pytest_kvguard.inputs.texts import pydoc_topics
from pytest_kvguard.scenarios.feeding import run_stream

pytestmark = pytest.mark.llama_cpp
SMOLLM2 = ModelRef("smollm2-135m")


@pytest.fixture(scope="session")
def runner(kvguard_runner: Runner) -> Runner:
    return kvguard_runner


def test_bundled_models_have_the_documented_architecture() -> None:
    smol = read_arch(SMOLLM2.resolve())
    assert (smol.architecture, smol.n_layers, smol.n_kv_heads, smol.head_dim_k) == (
        "llama",
        30,
        3,
        64,
    )
    assert smol.kv_bytes_per_token() == 23_040 and smol.sliding_window is None
    gemma = read_arch(ModelRef("gemma3-270m").resolve())
    assert (gemma.n_layers, gemma.n_kv_heads, gemma.head_dim_k, gemma.sliding_window) == (
        18,
        1,
        256,
        512,
    )
    assert gemma.kv_bytes_per_token() == 18_432
    assert sum(gemma.swa_layers) == 15  # 5 of every 6 layers slide


@pytest.mark.kv_budget(max_ppl_increase_pct=25, max_post_eviction_ppl=20, max_kv_entries=128)
def test_marker_on_a_real_engine(kvguard) -> None:  # type: ignore[no-untyped-def]
    # engine_checks.yaml's sweep measured this run at 16.80 (+1.1%) over 128 tokens past the cap.
    outcome = kvguard.stream(policy="sink", cap=128, sinks=4, tokens=256)
    # llama.cpp's own cell counts: the cap held, every token past it evicted.
    assert (outcome.metrics["kv_entries"], outcome.metrics["evicted"]) == (128, 256 - 128)


@pytest.fixture(scope="module")
def short_ids(runner: Runner) -> list[int]:
    return runner.token_ids("llama_cpp", SMOLLM2, pydoc_topics(), 200)


@pytest.mark.parametrize("positions", ["reindexed", "absolute"])
@pytest.mark.parametrize("step", [1, 16])
def test_eviction_bookkeeping_matches_the_engine(
    runner: Runner, short_ids: list[int], positions: str, step: int
) -> None:
    """The adapter checks llama.cpp's seq positions after every eviction (EngineError if not)."""
    engine = runner.engine("llama_cpp", SMOLLM2)
    policy = make_policy("sink", cap=64, sinks=4, positions=positions, evict_step=step)
    run = run_stream(engine, policy, short_ids)
    assert run.first_eviction == 64  # tokens 0..63 fill the cache
    assert run.kv_entries <= 64 and run.evicted + run.kv_entries == 200
    assert run.evicted % step == 0


def test_edit_replay_counts_are_repeatable(kvguard_runner: Runner) -> None:
    """Token counts, bytes and the reuse gap are exact: the same replay twice (each prefilling
    the chat itself: Gemma 3 has sliding layers, so no prefill is shared) gives the same
    figures, a checkpoint restored in both."""
    check = build_check(
        Written.plain({
            "name": "repeat", "scenario": "edit_replay", "engine": "llama_cpp",
            "model": "gemma3-270m", "policy": "swa",
            "params": {"via": "memory", "chat_messages": 11, "checkpoints": 3,
                       "checkpoint_step": 512, "followup": "edit", "message": 5,
                       "chat_template": "gemma3-it"},
        }),
        Written(), base_dir=Path("."), marker_budgets=Budgets(),
    )  # fmt: skip
    one, two = (run_check(kvguard_runner, check) for _ in range(2))
    assert one.seconds["prefill"] > 0 and two.seconds["prefill"] > 0  # neither was restored
    first, second = one.metrics, two.metrics
    assert first == second
    # A checkpoint before the split was restored: less than the whole prompt is re-prefilled.
    assert 0 < first["restored_checkpoint"] <= first["split"]
    assert first["reused_tokens"] == first["restored_checkpoint"]


def _tutor_edit(engine: Any, template_name: str | None = None) -> tuple[Prompt, Prompt]:
    from pytest_kvguard.inputs.chats import (
        followup,
        history,
        load_chat_template,
        load_conversation,
    )

    chat = load_conversation("tutor", Path(".")).first(11)
    template = None if template_name is None else load_chat_template(template_name, Path("."))
    return tuple(  # type: ignore[return-value]
        Prompt(tuple(engine.chat_ids(m, template)), tuple(m), template)
        for m in (history(chat), followup(chat, "edit", 5))
    )


def test_a_restored_prefill_replays_like_a_fresh_one(kvguard_runner: Runner) -> None:
    """llama_state_get_data / set_data on a model without sliding layers: a follow-up served
    from the saved prefill reuses, re-prefills, costs and scores exactly what it does after
    prefilling the chat itself."""
    from pytest_kvguard.inputs.chats import reply_ids
    from pytest_kvguard.scenarios.replaying import run_edit_replay

    policy = make_policy("full")
    engine = kvguard_runner.engine("llama_cpp", SMOLLM2)
    first, second = _tutor_edit(engine)
    reply = reply_ids(engine.tokenize, 16)
    fresh, prefilled, _ = run_edit_replay(engine, policy, first, second, reply_ids=reply)
    assert prefilled is not None
    restored, again, _ = run_edit_replay(engine, policy, first, second, prefilled, reply)
    assert again is prefilled

    def counts(run: Any) -> tuple[int, int, int | None]:
        return run.replay.reused, run.replay.reprefilled, run.replay.restored_checkpoint

    assert counts(restored) == counts(fresh)
    assert restored.memory == fresh.memory
    assert 0 < fresh.replay.reused < fresh.replay.prompt_tokens
    assert restored.metrics["mean_abs_nll_diff"] == fresh.metrics["mean_abs_nll_diff"] == 0


def test_a_model_with_sliding_layers_shares_no_prefill(kvguard_runner: Runner) -> None:
    """A restored iSWA state does not predict as the context it was saved from (0.069 nats on
    this chat, llama.cpp#18552), so each check prefills the chat itself."""
    from pytest_kvguard.scenarios.replaying import run_edit_replay

    engine = kvguard_runner.engine("llama_cpp", ModelRef("gemma3-270m"))
    first, second = _tutor_edit(engine, "gemma3-it")
    _, prefilled, _ = run_edit_replay(engine, make_policy("swa_full"), first, second)
    assert prefilled is None


@pytest.mark.kv_budget(min_reused_tokens=1735, max_reprefill_tokens=20, max_memory_bytes="21 MiB")
def test_edit_replay_marker(kvguard) -> None:  # type: ignore[no-untyped-def]
    # The quick gate's chat (its first 11 messages) under Gemma 3's own sliding-window cache.
    outcome = kvguard.edit_replay(
        policy="swa", followup="append", model="gemma3-270m", chat_messages=11,
        chat_template="gemma3-it",
    )  # fmt: skip
    # The two requests part where the first one's generation prompt (<start_of_turn>model)
    # meets the new turn (<start_of_turn>user): everything before its last 2 ids is reused.
    assert outcome.metrics["split"] == outcome.metrics["first_prompt_tokens"] - 2


@pytest.mark.parametrize(
    ("model", "policy"),
    [("smollm2-135m", "full"), ("gemma3-270m", "swa"), ("gemma3-270m", "swa_full")],
)
def test_state_bytes_match_the_capacity_prediction(
    kvguard_runner: Runner, model: str, policy: str
) -> None:
    """llama.cpp's state after N tokens against the calculator's f16 prediction, within 0.5%
    (1,500 tokens: past Gemma 3's 1,024-cell sliding cache)."""
    from pytest_kvguard.cli.capacity import predict_kv_bytes

    ref = ModelRef(model)
    engine = kvguard_runner.engine("llama_cpp", ref)
    arch = read_arch(ref.resolve())
    ids = kvguard_runner.token_ids("llama_cpp", ref, pydoc_topics(), 1500)
    for n in (600, 1500):
        cache = engine.open_prefix_cache(make_policy(policy), n)
        try:
            cache.extend(ids[:n], 0)
            measured = cache.memory_bytes()["state_bytes"]
        finally:
            cache.close()
        predicted = predict_kv_bytes(arch, n, policy)
        assert measured == pytest.approx(predicted, rel=5e-3), (n, measured, predicted)


@pytest.mark.parametrize(
    ("kept", "oldest_held", "n_swa", "missing"),
    [
        (2332, 0, 512, 0),  # everything held
        (2332, 1821, 512, 0),  # exactly the window before the split
        (2332, 1822, 512, 1),  # one position of it gone
        (784, 827, 512, 512 - 1),  # the quick chat's edit: the whole window gone
        (2332, 1309, 0, 0),  # no sliding layers (or swa_full)
        (0, 1309, 512, 0),  # nothing kept
        (784, -1, 512, 511),  # seq_rm left the sliding cells empty (the quick chat's edit)
        (5, -1, 512, 5),  # the same near the start
        (100, 40, 512, 40),  # a window reaching back to position 0
    ],
)
def test_window_missing_counts_the_positions_the_first_new_token_cannot_see(
    kept: int, oldest_held: int, n_swa: int, missing: int
) -> None:
    from pytest_kvguard.engines.llama_cpp.prefix_cache import window_missing

    assert window_missing(kept, oldest_held, n_swa) == missing


@pytest.mark.parametrize(("type_k", "type_v"), [("q8_0", "q8_0"), ("f16", "q4_0")])
def test_quantized_cache_types_hold_the_predicted_bytes(
    runner: Runner, short_ids: list[int], type_k: str, type_v: str
) -> None:
    """llama.cpp's context in the asked cache types (a quantized V runs under flash attention,
    which kvguard turns on): the state within 0.5% of the prediction, the scores close to f16."""
    from pytest_kvguard.core.scoring import perplexity
    from pytest_kvguard.engines.kv_size import predict_engine_kv_bytes

    engine = runner.engine("llama_cpp", SMOLLM2)
    f16 = run_stream(engine, make_policy("full"), short_ids)
    policy = make_policy("full", cache_type_k=type_k, cache_type_v=type_v)
    run = run_stream(engine, policy, short_ids)
    predicted = predict_engine_kv_bytes(
        "llama_cpp", read_arch(SMOLLM2.resolve()), 200, policy, element_bytes=2.0
    )
    assert run.engine_figures["kv_bytes"] == pytest.approx(predicted, rel=5e-3)
    assert run.engine_figures["kv_bytes"] < f16.engine_figures["kv_bytes"] * 0.8
    assert run.quantized_from == 0
    assert perplexity(run.nll) == pytest.approx(perplexity(f16.nll), rel=0.05)


def test_every_cache_type_kvguard_accepts_has_its_ggml_type() -> None:
    from pytest_kvguard.core.policies import LLAMA_CACHE_TYPES
    from pytest_kvguard.engines.llama_cpp.context import GGML_TYPES

    assert set(GGML_TYPES) == set(LLAMA_CACHE_TYPES)
