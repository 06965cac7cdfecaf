"""Engine adapters: one package per engine (``llama_cpp``, ``mlx``, ``served`` for the HTTP
servers), the protocols scenarios call them through (``protocols``), the registry of adapters
(``registry``) and what runs where (``support``).

This module re-exports what the rest of kvguard uses; it imports no engine.
"""

from __future__ import annotations

from pytest_kvguard.engines.options import EngineOptions
from pytest_kvguard.engines.protocols import (
    API_STATES,
    CAPABILITIES,
    PREFIX_CACHE_CAPABILITIES,
    AttentionRows,
    Decoded,
    Engine,
    GroupsStreams,
    PrefixCache,
    Prompt,
    ReadsAttention,
    ReplaysPrefix,
    ReportsShifts,
    Reuse,
    ReusesThroughApi,
    SnapshotsPrefix,
    Speculates,
    Stream,
    StreamGroup,
)
from pytest_kvguard.engines.registry import (
    ENGINES,
    EngineInfo,
    engine_info,
    installed_version,
    load_engine,
    require_installed,
)
from pytest_kvguard.engines.support import (
    check_chunk,
    check_chunk_gap_budget,
    check_policy,
    check_policy_kind,
    check_served_chunk,
    support_table,
)

__all__ = [
    "API_STATES",
    "CAPABILITIES",
    "ENGINES",
    "PREFIX_CACHE_CAPABILITIES",
    "AttentionRows",
    "Decoded",
    "Engine",
    "EngineInfo",
    "EngineOptions",
    "GroupsStreams",
    "PrefixCache",
    "ReadsAttention",
    "ReplaysPrefix",
    "ReportsShifts",
    "Prompt",
    "Reuse",
    "ReusesThroughApi",
    "SnapshotsPrefix",
    "Speculates",
    "Stream",
    "StreamGroup",
    "check_chunk",
    "check_chunk_gap_budget",
    "check_policy",
    "check_policy_kind",
    "check_served_chunk",
    "engine_info",
    "installed_version",
    "load_engine",
    "require_installed",
    "support_table",
]
