"""The budgets several scenarios judge, declared once (a scenario's own are in its module, and
every scenario lists what applies to it in ``Scenario.limits``)."""

from __future__ import annotations

import math

from pytest_kvguard.core.budgets import Limit

MAX_PPL_INCREASE_PCT = Limit(
    "max_ppl_increase_pct", "ppl_increase_pct", "max", "%", "ppl+",
    "post-eviction perplexity increase over baseline",
    "Post-eviction perplexity may exceed the baseline policy's on the same tokens by at most this"
    " many percent (sweep: at the largest sink count).",
)  # fmt: skip
MAX_POST_EVICTION_PPL = Limit(
    "max_post_eviction_ppl", "post_eviction_ppl", "max", "", "ppl",
    "post-eviction perplexity",
    "Perplexity over the tokens fed after the first eviction may not exceed this.",
)  # fmt: skip
MAX_KV_ENTRIES = Limit(
    "max_kv_entries", "kv_entries", "max", " entries", "kv",
    "KV entries held at the end",
    "KV entries held per layer at the end of the run (deterministic).",
)  # fmt: skip
MAX_KV_BYTES = Limit(
    "max_kv_bytes", "kv_bytes", "max", " B", "kv bytes",
    "KV bytes held at the end",
    "KV cache bytes at the end of the run (memory: at the longest length); bytes or a size such "
    "as '6 MiB'. llama.cpp: the context's state size; mlx-lm: the caches' buffers.",
)  # fmt: skip
MAX_PEAK_MEMORY_BYTES = Limit(
    "max_peak_memory_bytes", "peak_memory_bytes", "max", " B", "peak",
    "peak memory",
    "Peak memory of the run, weights included; bytes or a size such as '1.5 GiB'. mlx-lm: the "
    "weights plus the run's rise of mx.get_peak_memory(); llama.cpp: its own model + KV + compute"
    " buffers.",
)  # fmt: skip
BOUNDED = Limit(
    "bounded", "kv_growth_after_cap_bytes", "flag", " B", "bounded",
    "KV bytes grew after the cap was reached",
    "true: KV bytes may not grow once the cap is reached (needs a policy with a cap).",
)  # fmt: skip
MAX_KV_DEVIATION_PCT = Limit(
    "max_kv_deviation_pct", "kv_deviation_pct", "max", "%", "kv dev",
    "largest deviation of measured from predicted KV bytes",
    "memory: the largest |measured / predicted - 1| over the lengths, in percent; stream (a "
    "quantized candidate): the same at the end of the run.",
)  # fmt: skip
MAX_CHUNK_GAP_PCT = Limit(
    "max_chunk_gap_pct", "chunk_gap_pct", "max", "%", "chunk gap",
    "post-eviction perplexity fed in chunks over fed one token at a time",
    "stream with chunk > 1: post-eviction perplexity of the chunked run over the same policy fed "
    "one token at a time on the same ids, minus 1, in %; generate: the same for the reply tokens "
    "of the engine's generate path. An engine whose batched path keeps other tokens than its "
    "decode path shows here.",
    span=(-100.0, math.inf),
)  # fmt: skip
MAX_SINK_MASS_DIFF_PCT = Limit(
    "max_sink_mass_diff_pct", "sink_mass_diff_pct", "max", " pt", "sink diff",
    "largest per-head difference in mass on the first tokens between engines or precisions",
    "attention_parity: the largest |mass(B) - mass(A)| over layers and heads, mass on the first "
    "`sinks` tokens in percentage points; attention (a quantized cache): the same between the "
    "quantized and the full-precision cache, on one engine.",
    span=(0.0, 100.0),
)  # fmt: skip
