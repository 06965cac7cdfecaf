"""The capacity calculator against hand arithmetic (no weights, no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_kvguard.cli.capacity import capacity_table, main, predict_kv_bytes
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.inputs.architecture import arch_from_config

CONFIG = Path(__file__).parent.parent / "fixtures" / "gemma-3-270m.config.json"


def test_config_json_reads_the_sliding_layout() -> None:
    arch = arch_from_config(CONFIG)
    assert (arch.n_layers, arch.n_kv_heads, arch.head_dim_k, arch.sliding_window) == (
        18,
        1,
        256,
        512,
    )
    assert [i for i, slides in enumerate(arch.swa_layers) if not slides] == [5, 11, 17]


def test_table_matches_hand_arithmetic() -> None:
    # One token in one layer: 1 KV head x (256 + 256) x 2 bytes = 1,024 B.
    # 4,096 tokens: full 18 x 4,096 x 1,024 = 75,497,472 B = 72.00 MiB.
    # cap 256: 18 x 256 x 1,024 = 4,718,592 B = 4.50 MiB.
    # swa: 15 sliding layers x pad256(512 + 512) = 1,024 cells, 3 full layers x 4,096:
    #      (15,360 + 12,288) x 1,024 = 28,311,552 B = 27.00 MiB; saving 72 / 27 = 2.67x.
    headers, rows = capacity_table(arch_from_config(CONFIG), [4096], cap=256)
    assert headers == ["context", "full", "window/sink 256", "swa", "swa_full", "full / swa"]
    assert rows == [["4096", "72.00 MiB", "4.50 MiB", "27.00 MiB", "72.00 MiB", "2.67x"]]


def test_short_contexts_do_not_slide() -> None:
    arch = arch_from_config(CONFIG)
    assert (
        predict_kv_bytes(arch, 800, "swa") == predict_kv_bytes(arch, 800, "full") == 18 * 800 * 1024
    )


def test_more_slots_and_a_bigger_ubatch_widen_the_sliding_cells() -> None:
    arch = arch_from_config(CONFIG)
    # pad256(512 x 2 + 1,024) = 2,048 cells per sliding layer.
    assert (
        predict_kv_bytes(arch, 4096, "swa", n_ubatch=1024, n_seq=2) == (15 * 2048 + 3 * 4096) * 1024
    )


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(CONFIG), "--contexts", "4096"]) == 0
    out = capsys.readouterr().out
    assert "sliding window 512 on 15 of 18 layers" in out and "27.00 MiB" in out


def test_command_line_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{}")
    assert main([str(bad)]) == 2
    assert "lacks 'num_hidden_layers'" in capsys.readouterr().err


def test_quantized_caches_against_hand_arithmetic() -> None:
    """Quantized predictions from the formats' own layouts (no engine)."""
    from pytest_kvguard.core.policies import make_policy
    from pytest_kvguard.engines.llama_cpp.kv_size import predict_stream_kv_bytes as llama_bytes
    from pytest_kvguard.engines.mlx.kv_size import predict_stream_kv_bytes as mlx_bytes
    from pytest_kvguard.inputs.models import ModelArch

    # One layer, 3 KV heads of 64: mlx-lm 0.28 to 0.32 measured 221,184 bytes for 300 tokens
    # of a float32 KVCache quantized to 8 bits (4 bits: 122,880): 512 allocated rows (steps of
    # 256) x 3 heads x K,V x (64 x bits/8 + 2 x 64/64 x 4 bytes of scale and bias).
    arch = ModelArch("llama", 1, 3, 64, 64, 0, None, (False,))
    q8, q4 = make_policy("full", kv_bits=8), make_policy("full", kv_bits=4)
    assert mlx_bytes(arch, 300, q8, element_bytes=4.0) == 221_184
    assert mlx_bytes(arch, 300, q4, element_bytes=4.0) == 122_880
    # Not yet at quantized_kv_start: the float32 buffer (786,432 bytes measured).
    later = make_policy("full", kv_bits=8, quantized_kv_start=1024)
    assert mlx_bytes(arch, 300, later, element_bytes=4.0) == 786_432
    # llama.cpp: q8_0 is 34 bytes per 32 elements, q4_0 18; 100 tokens of a 256-cap sink.
    sink = make_policy("sink", cap=256, cache_type_k="q8_0", cache_type_v="q4_0")
    assert llama_bytes(arch, 100, sink, element_bytes=2.0) == 100 * 3 * 64 * (34 + 18) / 32


def test_the_calculator_takes_llama_cpps_cache_types(capsys: pytest.CaptureFixture[str]) -> None:
    # q8_0 on K and V: 18 layers x 1 KV head x (256 + 256) x 34/32 bytes = 9,792 B per token;
    # 4,096 tokens full: 38.25 MiB (f16: 72.00).
    assert main([str(CONFIG), "--contexts", "4096", "--cache-type-k", "q8_0",
                 "--cache-type-v", "q8_0"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "K q8_0, V q8_0: 9,792 B/token" in out
    assert "4096       38.25 MiB" in out


def test_config_json_shares_the_folder_readers_sliding_layout(tmp_path: Path) -> None:
    """One reader (model_folder.config_swa_layers) for kvguard-capacity and model facts."""
    base = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64}
    config = tmp_path / "config.json"
    # Qwen2 with use_sliding_window false: full attention, however wide its window.
    config.write_text(json.dumps(base | {"model_type": "qwen2", "sliding_window": 64,
                                         "use_sliding_window": False}))  # fmt: skip
    arch = arch_from_config(config)
    assert (arch.sliding_window, arch.swa_layers) == (None, (False,) * 4)
    # Gemma 2: transformers' period of 2 where the config names none (was: every layer).
    config.write_text(json.dumps(base | {"model_type": "gemma2", "sliding_window": 64}))
    assert arch_from_config(config).swa_layers == (True, False, True, False)
    # A window whose layers nothing says: one line, not a guess.
    config.write_text(json.dumps(base | {"model_type": "llama", "sliding_window": 64}))
    with pytest.raises(KvguardError, match="which layers of this llama model slide"):
        arch_from_config(config)
