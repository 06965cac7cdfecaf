"""What runs where, and the one place that refuses what does not: the support table of
scenario path x engine x policy kind (from ``registry.ENGINES``), and every refusal of a
policy, position handling, eviction step or ``chunk`` an engine cannot run.

An engine path is how a scenario drives the engine (``ENGINE_PATHS``); each scenario names its
own (``Scenario.engine_path``), and the engines name none.
"""

from __future__ import annotations

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.registry import ENGINES, engine_info


def support_table() -> list[tuple[str, str, tuple[str, ...]]]:
    """(engine path, engine, policy kinds) for every path each engine can run."""
    rows = [
        (path, info.name, kinds)
        for info in ENGINES.values()
        for path, kinds in info.policies.items()
    ]
    # Attention is read under the full cache, from engines that expose it.
    rows += [
        ("reads_attention", i.name, ("full",))
        for i in ENGINES.values()
        if "reads_attention" in i.capabilities
    ]
    return sorted(rows)


def check_policy_kind(name: str, kind: str, path: str, scenario: str = "") -> None:
    """Refuse a policy kind the engine's adapter does not implement on this engine path; the
    message names the check's scenario where it is given."""
    kinds = engine_info(name).policies.get(path, ())
    what = f"{scenario} checks" if scenario else f"the {path} path"
    if kind not in kinds:
        raise KvguardError(
            f"engine '{name}' does not implement policy '{kind}' for {what}",
            fix="use one of " + ", ".join(kinds) if kinds else f"use another engine for {what}",
        )


def check_policy(name: str, policy: Policy, path: str = "feed", scenario: str = "") -> None:
    """Refuse a policy, position handling, eviction step or chunk the engine's adapter cannot
    run on this engine path."""
    info = engine_info(name)
    check_policy_kind(name, policy.kind, path, scenario)
    check_chunk(policy.chunk, policy, name)
    check_kv_precision(name, policy, path, scenario)
    if policy.bounded and policy.positions not in info.position_modes:
        raise KvguardError(
            f"engine '{name}' cannot run positions '{policy.positions}'",
            fix="use positions: " + " or ".join(info.position_modes),
        )
    if policy.cap is not None and info.context_step and (policy.cap + 1) % info.context_step:
        cells = info.context_step
        low = max((policy.cap + 1) // cells * cells - 1, cells - 1)
        raise KvguardError(
            f"engine '{name}' holds at most a multiple of {info.context_step} cells minus one "
            f"(it shifts when one more token would not fit), so cap {policy.cap} cannot be "
            "asked of it",
            fix=f"use cap: {low} or {low + cells}",
            key="params.cap",
        )
    step = info.fixed_evict_step
    if policy.bounded and step is not None and policy.evict_step != step:
        raise KvguardError(
            f"engine '{name}' evicts {step} token(s) per step, not {policy.evict_step}",
            fix=f"use evict_step: {step}",
        )


PRECISION_PARAMS = {
    "kv_bits": ("kv_bits", "kv_group_size", "quantized_kv_start"),
    "cache_types": ("cache_type_k", "cache_type_v"),
}
"""The parameters of each way an engine is asked to quantize its KV cache."""


def check_kv_precision(name: str, policy: Policy, path: str = "feed", scenario: str = "") -> None:
    """Refuse KV precision settings the engine does not take, or not on this engine path."""
    if not policy.precision_set:
        return
    info = engine_info(name)
    given = "kv_bits" if policy.kv_bits is not None else "cache_types"
    if policy.kv_bits is not None and (policy.cache_type_k, policy.cache_type_v) != ("f16", "f16"):
        raise KvguardError(
            "kv_bits (mlx-lm) and cache_type_k / cache_type_v (llama.cpp) are set together",
            fix="set the one the check's engine takes",
            key="params.kv_bits",
        )
    key = f"params.{PRECISION_PARAMS[given][0] if given == 'kv_bits' else _type_key(policy)}"
    if info.kv_precision is None:
        raise KvguardError(
            f"engine '{name}' takes no KV precision settings",
            fix="remove " + " / ".join(PRECISION_PARAMS[given]) + ", or use engine llama_cpp "
            "(cache_type_k, cache_type_v) or mlx (kv_bits)",
            key=key,
        )
    if info.kv_precision != given:
        wanted = PRECISION_PARAMS[info.kv_precision]
        example = "kv_bits: 8" if info.kv_precision == "kv_bits" else "cache_type_k: q8_0"
        raise KvguardError(
            f"engine '{name}' quantizes its KV cache with {' / '.join(wanted)}, not "
            f"{' / '.join(PRECISION_PARAMS[given])}",
            fix=f"write the same precision in its terms (e.g. {example})",
            key=key,
        )
    if path not in info.kv_precision_paths:
        what = f"{scenario} checks" if scenario else PATH_SCENARIOS.get(path, f"the {path} path")
        raise KvguardError(
            f"engine '{name}' applies KV precision settings to "
            + ", ".join(PATH_SCENARIOS.get(p, p) for p in info.kv_precision_paths)
            + f" only, not to {what}",
            fix="remove " + " / ".join(PRECISION_PARAMS[given]) + " from this check",
            key=key,
        )


PATH_SCENARIOS = {
    "feed": "stream checks",
    "feed_unscored": "memory checks",
    "prefix_cache": "edit_replay checks",
    "generation": "generate checks",
    "reads_attention": "attention checks",
}
"""Which checks an engine path's KV precision settings reach, for messages."""


def _type_key(policy: Policy) -> str:
    return "cache_type_k" if policy.cache_type_k != "f16" else "cache_type_v"


def check_chunk(
    chunk: int | None, policy: Policy, engine: str | None = None, *, candidate: bool = True
) -> None:
    """Refuse a ``chunk`` (tokens fed per engine call once the cache is full) that cannot mean
    what it says under ``policy`` (the policy built from it: one that never evicts drops it)
    on ``engine`` (None: not known yet). ``candidate``: the policy is the one judged (a
    baseline of full may share the check's chunk). Every refusal of a chunk is in this module
    (``check_served_chunk``, ``check_chunk_gap_budget``)."""
    if chunk is None:
        return
    _check_positive(chunk)
    if candidate and chunk > policy.chunk:
        raise KvguardError(
            f"policy '{policy.kind}' never evicts, so chunk {chunk} would change nothing",
            fix="remove chunk, or use a policy with a cap",
            key="params.chunk",
        )
    largest = policy.max_chunk
    if largest is not None and chunk > largest:
        # The chunk's own entries must fit beside the pinned ones, freed evict_step at a time.
        stepped = policy.evict_step > 1
        raise KvguardError(
            f"chunk {chunk} cannot fit beside {policy.sinks} sink(s) in cap {policy.cap}"
            + (f" when evicting {policy.evict_step} at a time" if stepped else ""),
            fix=f"use chunk: {largest} or less (cap - sinks"
            + (", down to a multiple of evict_step" if stepped else "")
            + "), or raise cap",
            key="params.chunk",
        )
    if engine is None:
        return
    info = engine_info(engine)
    if chunk > 1 and policy.kind in info.self_evicting:
        raise KvguardError(
            f"engine '{engine}' trims its '{policy.kind}' cache inside each decode call, so "
            "chunk has nothing to change there",
            fix="remove chunk, or use a policy with a cap",
            key="params.chunk",
        )
    if info.max_chunk is not None and chunk > info.max_chunk:
        raise KvguardError(
            f"engine '{engine}' takes at most {info.max_chunk} tokens per call, not chunk {chunk}",
            fix=f"use chunk: {info.max_chunk} or less",
            key="params.chunk",
        )


def check_served_chunk(
    chunk: int | None, engine: str | None = None, *, gap_budget: bool = False
) -> None:
    """Where the engine generates through its own server: it decodes one token at a time
    itself, so only chunk 1 means anything, and kvguard's one-token loop (what
    ``max_chunk_gap_pct``, set where ``gap_budget``, compares with) does not run there."""
    if gap_budget:
        raise KvguardError(
            "max_chunk_gap_pct compares the engine's generate path with kvguard's own "
            "one-token loop, which does not run through a server",
            fix="remove max_chunk_gap_pct from this check",
            key="budgets.max_chunk_gap_pct",
        )
    if chunk is not None:
        _check_positive(chunk)
        if chunk != 1:
            raise KvguardError(
                f"engine {engine} decodes its generated tokens itself, one at a time: "
                "chunk does not apply",
                fix="remove params.chunk",
                key="params.chunk",
            )


def check_chunk_gap_budget(chunk: int) -> None:
    """``max_chunk_gap_pct`` compares a chunked run with one fed a token at a time: refused
    where the check itself feeds one token at a time."""
    if chunk == 1:
        raise KvguardError(
            "max_chunk_gap_pct compares feeding in chunks with feeding one token at a time, "
            "and this check feeds one token at a time (chunk 1)",
            fix="set params.chunk above 1 (e.g. chunk: 64), or remove max_chunk_gap_pct",
            key="budgets.max_chunk_gap_pct",
        )


def _check_positive(chunk: int) -> None:
    if chunk < 1:
        raise KvguardError(
            f"chunk must be >= 1, got {chunk}",
            fix="use chunk: 1 (one token per call) or more",
            key="params.chunk",
        )
