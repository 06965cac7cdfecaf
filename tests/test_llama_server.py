"""Engine llama_server on a real llama-server (built by .ci/install from the same llama.cpp as
llama-cpp-python) and the real bundled SmolLM2-135M: it is started, health-checked and stopped;
it tokenizes as the in-process engine does; its forced generation scores tokens as llama.cpp
does in process; its context shift is the in-process sink policy's eviction; an existing server
is reached by URL and refuses a check its settings contradict.

The edit-replay counts and the generate scenario beside the in-process engine's are in
test_scenarios_on_engines.py (and, for both gates, in .ci/run's and .ci/nightly's checks of
their reports).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import make_policy
from pytest_kvguard.engines import EngineOptions, load_engine
from pytest_kvguard.engines.conversation import Turn
from pytest_kvguard.engines.served.llama_server import LlamaServerEngine
from pytest_kvguard.engines.served.process import ServerSettings
from pytest_kvguard.gate.runner import Runner
from pytest_kvguard.inputs.models import ModelRef
from pytest_kvguard.inputs.texts import pydoc_topics

# Each test compares the server with llama.cpp in process.
pytestmark = [pytest.mark.llama_server, pytest.mark.llama_cpp]
SMOLLM2 = ModelRef("smollm2-135m")


def ids_of(runner: Runner, count: int) -> list[int]:
    return runner.token_ids("llama_cpp", SMOLLM2, pydoc_topics(), count)


def test_the_server_tokenizes_text_and_chats_as_llama_cpp(
    smollm2_server: LlamaServerEngine, kvguard_runner: Runner
) -> None:
    in_process = kvguard_runner.engine("llama_cpp", SMOLLM2)
    text = pydoc_topics().content[:6000]
    assert smollm2_server.tokenize(text) == in_process.tokenize(text)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    system = [{"role": "system", "content": "Be brief."}]
    # Both apply SmolLM2's own Jinja template, which adds its default system message to a
    # chat without one (llama.cpp's C template code, kvguard's before, did not).
    for messages in (system + chat, chat):
        assert smollm2_server.chat_ids(messages) == in_process.chat_ids(messages)
    pieces = [in_process.token_piece(t) for t in in_process.chat_ids(chat)[:8]]
    assert "".join(pieces).startswith("<|im_start|>system\nYou are a helpful AI")
    assert (
        not smollm2_server.adds_bos()
    )  # SmolLM2's tokenizer adds none: n_keep is the sinks as asked
    assert smollm2_server.version() != "unknown"


def test_forced_generation_scores_every_token_as_llama_cpp_does(
    smollm2_server: LlamaServerEngine, kvguard_runner: Runner
) -> None:
    """The full context: the server's probability of each forced token against the in-process
    engine's logits on the same ids. A 32-token prompt: both prefill it in batches under 64
    tokens (31 + 1 in process, 32 on the server), which llama.cpp computes by the same path."""
    ids = ids_of(kvguard_runner, 300)
    nll = smollm2_server.converse(make_policy("full"), ids, [Turn(32, 268)], 512)
    assert np.isnan(nll[:31]).all() and not np.isnan(nll[31:]).any()
    in_process = kvguard_runner.engine("llama_cpp", SMOLLM2).converse(
        make_policy("full"), ids, [Turn(32, 268)], 512
    )
    diff = np.abs(nll[31:] - in_process[31:])
    assert diff.mean() < 1e-3 and diff.max() < 0.01, (diff.mean(), diff.max())


def test_context_shift_is_the_sink_policy_evicting_as_asked(
    smollm2_server: LlamaServerEngine, kvguard_runner: Runner
) -> None:
    """cap 255 = --ctx-size 256 (the server shifts when one more token would not fit), n_keep 4,
    n_discard 125: the server's shifts and perplexity match the in-process sink policy's."""
    ids = ids_of(kvguard_runner, 640)
    policy = make_policy("sink", cap=255, sinks=4, evict_step=125)
    turns = [Turn(32, 608)]
    nll = smollm2_server.converse(policy, ids, turns, 512)
    # Full at 255 held, then every 125 tokens: tokens 255, 380, 505 and 630 are decoded after a
    # shift (the last token is sampled, never decoded).
    assert smollm2_server.last_shifts == [(4, 251, 125)] * len(range(255, 639, 125))
    in_process = kvguard_runner.engine("llama_cpp", SMOLLM2).converse(policy, ids, turns, 512)
    past_cap = np.arange(len(nll)) >= 255
    served = math.exp(float(np.nanmean(nll[past_cap])))
    local = math.exp(float(np.nanmean(in_process[past_cap])))
    assert abs(served / local - 1) < 1e-3, (served, local)


def test_an_existing_server_is_reached_by_url_and_checked_against_its_props(
    smollm2_server: LlamaServerEngine,
) -> None:
    http = smollm2_server.serve(ServerSettings(n_ctx=1024))
    existing = load_engine("llama_server", http.url, EngineOptions.from_env())
    assert isinstance(existing, LlamaServerEngine)
    try:
        assert existing.tokenize("Hello world") == smollm2_server.tokenize("Hello world")
        with pytest.raises(KvguardError, match="gives each slot 1024 tokens of context; this "
                           "check needs 4097") as refused:  # fmt: skip
            existing.serve(ServerSettings(n_ctx=4097))
        assert "--ctx-size 4097" in str(refused.value)
        with pytest.raises(KvguardError, match="use cap: 1023"):
            existing.serve(ServerSettings(n_ctx=257, context_shift=True))
    finally:
        existing.close()  # not kvguard's server: left running
    assert smollm2_server.server is not None and smollm2_server.server.process.poll() is None


def test_close_stops_the_server_it_started() -> None:
    engine = load_engine("llama_server", SMOLLM2.resolve(), EngineOptions.from_env())
    assert isinstance(engine, LlamaServerEngine)
    engine.tokenize("start it")
    assert engine.server is not None
    process = engine.server.process
    engine.close()
    assert process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)
