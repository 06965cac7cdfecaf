"""The OpenAI-compatible server adapter's declaration, registered under the
``pytest_kvguard.engines`` entry point (pyproject.toml) and read by ``engines.registry``.
Imports no engine."""

from __future__ import annotations

from pytest_kvguard.engines.registry import EngineInfo

ADAPTER = EngineInfo(
    "openai",
    "pytest_kvguard.engines.served.openai",
    "pytest_kvguard",
    "pytest-kvguard",
    "nothing to install: start the server (vLLM, SGLang, llama-server) and give "
    "model: http://HOST:PORT",
    # The server's own cache, whatever it was started with: the policy labels it.
    policies={"prefix_cache": ("full", "swa")},
    position_modes=("reindexed",),
    model_forms=("url",),
    remote=True,
    capabilities=frozenset({"replay"}),
)
